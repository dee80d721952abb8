"""Crash-safe, verified checkpoints of sessions and managers, written with Orbax.

A checkpoint is a directory::

    path/
      ckpt-000007/           the newest complete checkpoint
        manifest.json        format and version, what is saved ("session" or
                             "manager"), its record (kinds, specs, residency,
                             attrs structure, RNG key implementations), a table
                             of its arrays with shapes, dtypes and digests, and
                             a digest of the whole manifest
        arrays/              an Orbax PyTree checkpoint of those arrays
      .partial-000008/       a save in progress, or one that crashed: never read
      .superseded-000006/    an older checkpoint being deleted: never read

:func:`save` writes a whole checkpoint into a partial directory, flushes it,
renames it to the next ``ckpt-N`` (a rename is atomic) and only then removes
older ones: a crash at any moment leaves the previous checkpoint complete.

**What a restore verifies.**  :func:`restore` reads the newest ``ckpt-N`` and
checks, before it returns anything: that ``manifest.json`` parses, is of this
format and version, and matches its BLAKE2b digest (so every name, spec,
attr value, key implementation and array entry is the one saved); and that
every array's bytes, in row-major order, match their digest in the manifest
(CRC-32 of each 1 MiB chunk under a BLAKE2b root: every changed byte is
found, and any swapped or moved values but for one chance in 2**32 per
chunk).  A
:class:`~jax_session_state.errors.CheckpointError` means the checkpoint was
not restored, and says which file and what was wrong: none found, another
format or version, a damaged or truncated file, or a ``target`` that does not
match.  Nothing is half-restored.  The digests detect damage, not forgery:
whoever can write the files can write matching digests.

**What a restore trusts.**  A checkpoint is data: a restore imports and
evaluates nothing its manifest names.  Object kinds resolve among the
:class:`~jax_session_state.StateObject` subclasses already defined in the
process (:func:`~jax_session_state.base.state_object_classes`) and the
``classes`` passed to :func:`restore`; namedtuples among modules already
imported; dtypes and PRNG key implementations in fixed tables.  Before
anything is read, every array entry is checked for its form and the bytes
the entries claim against the files on disk, so an edited manifest cannot
make a restore allocate more than the checkpoint holds.

Arrays are placed on restore, not as they were saved, so a checkpoint written
on 8 devices restores onto 4 or onto 1: pass ``shardings=`` (ShardingRules for
every object, attrs replicated), or a ``target`` session to copy placement
from, or neither for the default device.

**Several processes.**  With ``jax.process_count() > 1`` (one process per
host, ``jax.distributed.initialize``) :func:`save` is collective: every
process writes its addressable shards through Orbax and digests them, the
digests of every process's pieces are gathered, and the primary process
writes the manifest and publishes.  :func:`restore` reads onto any process
count and mesh and checks every piece on some process; a damaged piece is a
:class:`~jax_session_state.errors.CheckpointError` on every process.  Each
step of either (a save's ``start``, ``write``, ``publish``; a restore's
``read``, ``check``) is exchanged with a timeout, so an error, a death or a
hang on any process raises on every process, never a wait without end; a
failed save leaves the previous checkpoint the newest and no partial
directory.  What the disk refuses (full, read-only, a folder deleted) is a
``CheckpointError`` naming the path.

:data:`FORMAT` is the name every manifest carries and :data:`VERSION` the
format version this library writes and reads (``CHANGELOG.md`` lists each).

Layout: ``_save_restore`` (:func:`save`, :func:`restore` and a manager's
record), ``_sessions`` (a session's record, and where a restore places its
arrays), ``_manifest`` (the JSON that names every array and its digest),
``_codec`` (objects and their static specs to and from JSON), ``_claims``
(what a restore trusts of a manifest: names in fixed tables, sizes against
the files), ``_digest``
(the chunked digests of what was written), ``_pieces`` (digests of arrays
no one process holds whole), ``_processes`` (the named, timed steps every
process takes), ``_atomic`` (a checkpoint appears whole or not at all)
and ``_orbax_io`` (the arrays, through Orbax, onto any mesh).
It may import everything below it (``errors``, ``_core``, ``base``,
``session``, ``sharding``); only ``_save_restore`` imports ``manager``, for a
manager's record: saving a session does not depend on the manager.  Nothing
in the package imports it.

Example:
  >>> import tempfile
  >>> import jax, jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
  >>> rows = jnp.ones((1, 3, 2, 4))
  >>> session = jss.Session(objects={"kv": kv.append((rows, rows))}, attrs={"rng": jax.random.key(0)})
  >>> path = tempfile.mkdtemp()
  >>> jss.checkpoint.save(path, session).name
  'ckpt-000001'
  >>> jss.checkpoint.restore(path)["kv"].view().lengths
  Array([3], dtype=int32)
"""

from jax_session_state.checkpoint._save_restore import FORMAT, VERSION, restore, save

__all__ = ["FORMAT", "VERSION", "restore", "save"]
