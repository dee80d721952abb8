"""``save`` and ``restore``: what they write and read, and the record of a manager (a session's is in ``_sessions``).

The format is told in the package docstring (:mod:`jax_session_state.checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_session_state.checkpoint import _atomic, _claims, _codec, _manifest, _orbax_io, _pieces, _processes
from jax_session_state.checkpoint._manifest import FORMAT, VERSION, ArrayTable
from jax_session_state.checkpoint._orbax_io import AS_NUMPY, Destination
from jax_session_state.checkpoint._sessions import Plan, encode_session, plan_session, refuse_donated
from jax_session_state.errors import CheckpointError, PayloadError, PayloadTypeError
from jax_session_state.manager import (
    ManagerSnapshot,
    SessionStateManager,
    SnapshotSession,
)
from jax_session_state.manager.offload import place, runtime_owned
from jax_session_state.session import Session
from jax_session_state.sharding import ShardingRules

__all__ = ["FORMAT", "VERSION", "restore", "save"]

_ARRAYS = "arrays"


# --------------------------------------------------------------------- API
def save(path: str | os.PathLike, state: Session | SessionStateManager) -> Path:
    """Saves ``state`` as the newest checkpoint in directory ``path``, atomically.

    The previous checkpoint stays complete and restorable until the new one
    is; it is removed once the new one is in place.  One writer per ``path``
    at a time.  With several JAX processes every process calls it (a
    collective): each writes its addressable shards, the primary the manifest
    and the rename; ``path`` must be one directory all processes see.

    Args:
      path: the checkpoint directory (created if missing).
      state: a :class:`~jax_session_state.Session` (objects, attrs including
        typed PRNG keys, lengths, flags and static specs; non-resident
        objects are saved as non-resident), or a
        :class:`~jax_session_state.SessionStateManager`: its settings and
        every session it holds (:meth:`~SessionStateManager.snapshot`),
        least recently used first, parked objects included (read from host
        memory, nothing is brought back), evicted objects recorded as
        evicted.  Pins, counters, callbacks, rebuild and demotion functions
        are not saved.  Sessions between a ``get`` and the ``put`` of a step
        that donated them cannot be saved.

    Returns:
      The directory of the new checkpoint.

    Raises:
      PayloadTypeError: ``state`` is not something a checkpoint can hold.
      CheckpointError: a spec, structure or attr that cannot be recorded
        (numpy arrays of strings, objects, dates or records among them),
        naming it; nothing is written.
      DonatedError: an array of the session was donated to a jitted step
        (deleted), naming the object or attr; nothing is written.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> import jax_session_state as jss
      >>> session = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
      >>> path = tempfile.mkdtemp()
      >>> [jss.checkpoint.save(path, session).name for _ in range(2)]
      ['ckpt-000001', 'ckpt-000002']
      >>> [p.name for p in Path(path).glob("ckpt-*")]  # the older one goes once the new one is in place
      ['ckpt-000002']
    """
    content = next((c for c in _CONTENTS.values() if isinstance(state, c.type)), None)
    if content is None:
        kinds = ", ".join(c.type.__name__ for c in _CONTENTS.values())
        raise PayloadTypeError(f"checkpoint.save() saves a {kinds}; got {type(state).__name__}.")
    table = ArrayTable()
    record = content.encode(state, table)
    if _processes.count() == 1:
        partial, final = _atomic.begin(Path(path))
        with _atomic.removed_on_failure(partial), concurrent.futures.ThreadPoolExecutor(1) as pool:
            entries = pool.submit(table.digested_entries)  # digests (hashlib releases the GIL) beside Orbax
            _orbax_io.write_arrays(partial / _ARRAYS, table.values)
            _manifest.write(partial, content.name, record, entries.result())
            return _atomic.publish(partial, final)
    return _save_from_processes(Path(path), content.name, record, table)


def _save_from_processes(root: Path, content: str, record: dict[str, Any], table: ArrayTable) -> Path:
    """One save made by every process: each writes its shards, the primary the manifest and the rename.

    Collective: every process calls it with the same state.  The primary
    clears leftovers and creates the partial directory; Orbax writes every
    process's shards and finishes with its own barrier; the digests of every
    process's pieces are gathered; the primary writes the manifest and
    publishes; a last exchange returns on every process only once the
    checkpoint is in place.  What only the primary does is exchanged with
    its outcome: if it fails, every process raises (none waits for it), and
    a manifest or rename that failed takes the partial directory with it.
    A process that dies or raises anywhere before leaves no ``ckpt-N``
    behind, so the previous one stays the newest; its partial directory,
    which other processes may still be writing into, is cleared by the next
    save.
    """
    number = _processes.run_on_primary(
        lambda: _atomic.save_number(_atomic.begin(root)[1]), f"start a checkpoint in {root}"
    )
    partial, final = _atomic.named(root, number)
    # Orbax refuses arrays one process holds whole: those (numpy, attrs on one device) are the same on
    # every process (checked by their digests) and written once, by the primary, as numpy.
    values = {k: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x
              for k, x in table.values.items()}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        local = pool.submit(_pieces.local_digests, table.values)
        _orbax_io.write_arrays(partial / _ARRAYS, values)
        entries = _pieces.gather_digests(table.entries, local.result())
    _processes.run_on_primary(
        lambda: _publish(partial, final, content, record, entries), f"write the manifest of {final} and publish it"
    )
    return final


def _publish(partial: Path, final: Path, content: str, record: dict[str, Any], entries: dict[str, Any]) -> int:
    """Writes the manifest into ``partial`` and publishes it as ``final``; returns the save's number.

    Every process has written its shards by then, so a failure removes ``partial``.
    """
    with _atomic.removed_on_failure(partial):
        _manifest.write(partial, content, record, entries)
        return _atomic.save_number(_atomic.publish(partial, final))


def restore(
    path: str | os.PathLike,
    *,
    target: Session | SessionStateManager | None = None,
    shardings: ShardingRules | None = None,
    classes: Iterable[type] = (),
) -> Session | SessionStateManager:
    """Restores the newest checkpoint in directory ``path``, verified, running no code it names.

    Args:
      path: the checkpoint directory given to :func:`save`.
      target: for a session checkpoint, a session the checkpoint must match
        (object names, kinds, specs, attrs structure, shapes and dtypes);
        restored objects take its placement (each object's ShardingRules,
        else where its arrays are, memory kind included) and what a
        checkpoint does not record (demotion functions).  For a manager
        checkpoint, an empty manager to fill (its own settings, callbacks
        and registered rebuilds apply); without one, a new manager with the
        saved settings.
      shardings: rules to place every object by (attrs are replicated on the
        mesh), whatever the checkpoint was saved on; overrides ``target``'s.
      classes: state-object kinds and namedtuple classes the checkpoint may
        name besides those already defined in this process.  A restore
        imports nothing: the kinds it finds are the library's own and every
        :class:`~jax_session_state.StateObject` subclass whose module was
        imported (:func:`~jax_session_state.base.state_object_classes`), and
        namedtuples of modules already imported.

    Without ``target`` or ``shardings`` everything lands on the default
    device (``jax.default_device``'s, where ``jnp`` puts new arrays).  A
    restored session continues a rollout bit for bit.  A restored manager
    admits the sessions least recently used first, by its usual rules
    (:meth:`SessionStateManager.load`).

    Raises:
      CheckpointError: no checkpoint, another format version, a manifest or
        array that does not match its digest (damaged files), truncated
        files, a target that does not match (or a manager target that is not
        empty), a class, dtype or key implementation that is not known here,
        or arrays that claim more bytes than their files hold; naming the
        file and what is wrong.  Nothing is half-restored.
      PayloadError, PayloadTypeError: ``shardings`` (or ``target``'s rules)
        cannot place an object, naming the argument.
      BudgetExceededError, SessionAdmissionError: a manager's sessions do
        not fit ``target``; it is left empty.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> manager.create("user", jss.Session(objects={"h": jss.FixedState.allocate(shapes=(2,)).commit(jnp.ones(2))}))
      >>> path = tempfile.mkdtemp()
      >>> _ = jss.checkpoint.save(path, manager)
      >>> again = jss.checkpoint.restore(path, target=jss.SessionStateManager(max_sessions=8))
      >>> again.get("user")["h"].view()
      Array([1., 1.], dtype=float32)
    """
    if target is not None and not isinstance(target, (Session, SessionStateManager)):
        raise PayloadTypeError(
            f"restore(target=...) takes a Session or a SessionStateManager; got {type(target).__name__}."
        )
    if shardings is not None and not isinstance(shardings, ShardingRules):
        raise PayloadTypeError(f"restore(shardings=...) takes ShardingRules; got {type(shardings).__name__}.")
    known = _claims.Classes(classes)
    directory = _atomic.newest(Path(path))
    manifest = _manifest.read(directory)
    content = _CONTENTS.get(manifest.get("content"))
    if content is None:
        raise CheckpointError(f"{directory}: holds {manifest.get('content')!r}, which this library cannot restore.")
    if target is not None and not isinstance(target, content.type):
        raise CheckpointError(
            f"{directory} holds a {content.type.__name__}; restore(target=...) got a {type(target).__name__}."
        )
    if isinstance(target, SessionStateManager) and len(target):
        raise CheckpointError(f"restore(target=...): the manager must be empty; it holds {len(target)} sessions.")
    entries = manifest["arrays"]
    _claims.check_entries(directory, entries, directory / _ARRAYS)  # before anything is decoded or allocated
    with _decoding(directory):
        destinations, uncommitted, assemble = content.plan(manifest["record"], entries, target, shardings, known)
        layout = {key: (tuple(entry["shape"]), str(entry["dtype"])) for key, entry in entries.items()}
        pieces = _pieces.expected(entries)
    read_to = {key: AS_NUMPY if key in uncommitted else where for key, where in destinations.items()}
    arrays = _orbax_io.read_arrays(directory / _ARRAYS, layout, read_to)
    _pieces.verify(directory, arrays, entries, pieces)
    with _decoding(directory):
        values = {
            key: _finish(arrays.pop(key), entry, destinations[key] if key in uncommitted else None)
            for key, entry in entries.items()
        }
    return assemble(values)


@contextlib.contextmanager
def _decoding(directory: Path) -> Iterator[None]:
    """Turns what a record that does not decode raises into a CheckpointError naming the manifest.

    Errors about restore's own arguments (rules that cannot place an object)
    pass as they are.
    """
    try:
        yield
    except (PayloadError, PayloadTypeError):
        raise
    except CheckpointError as error:
        raise CheckpointError(f"{directory / _manifest.MANIFEST}: {error}") from error
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise _manifest.malformed(directory, error) from error


def _finish(x: Any, entry: dict[str, Any], uncommitted_on: jax.sharding.Sharding | None) -> Any:
    """A verified array as the session holds it: in runtime-owned buffers, committed or not, typed keys wrapped.

    An array a session made with ``jnp`` on the default device is not
    committed to it, and a jitted step compiles once more for the other kind;
    such arrays (``uncommitted_on`` their device) are read as numpy and
    placed uncommitted, at most one copy.  Orbax returns the others committed
    to their sharding; on CPU the shards that wrap Orbax's host buffers are
    copied into runtime-owned ones, one array at a time (the peak stays the
    state plus its largest array).  An array saved weakly typed (made from a
    Python scalar) is weakly typed again, so a jitted step does not trace
    once more for it.
    """
    if uncommitted_on is not None:
        x = jax.block_until_ready(place(x, uncommitted_on, committed=False))  # before the next array's copy
    elif isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set):
        x = jax.block_until_ready(runtime_owned(x))
    if entry["type"] == "key":
        return jax.random.wrap_key_data(x, impl=entry["impl"])
    if entry["type"] == "numpy_scalar":
        return np.asarray(x)[()]
    if entry.get("weak_type", False):
        return _weakly_typed(x)
    return x


def _weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` weakly typed, as an array made from a Python scalar is; placement and commitment kept.

    JAX sets the mark publicly only on arrays it makes from Python scalars;
    this is ``lax.convert_element_type`` with its private ``weak_type=True``.
    """
    from jax._src.lax import lax  # private: see the docstring

    return lax._convert_element_type(x, weak_type=True)


@dataclasses.dataclass(frozen=True)
class _Content:
    """One kind of thing a checkpoint holds: how to record it and how to plan its restore."""

    name: str
    type: type
    encode: Callable[[Any, ArrayTable], dict[str, Any]]
    plan: Callable[..., Plan]


# ------------------------------------------------------------- managers
def _encode_manager(manager: SessionStateManager, table: ArrayTable) -> dict[str, Any]:
    """The manager's snapshot: settings and every session, parked objects with their host arrays."""
    if manager.checked_out():
        raise CheckpointError(
            f"sessions {sorted(map(repr, manager.checked_out()))} are checked out into pool slots, so the "
            "manager does not hold them; checkin() them before saving the manager."
        )
    try:
        snapshot = manager.snapshot()
    except RuntimeError as error:  # a session donated to a step that has not been put back
        raise CheckpointError(f"cannot save the manager: {error}") from None
    sessions = [
        {
            "id": _codec.encode_value(held.session_id, where=f"session id {held.session_id!r}"),
            "session": encode_session(held.session, table),
            "evicted": sorted(held.evicted),
        }
        for held in snapshot.sessions
    ]
    return {"settings": dict(snapshot.settings), "sessions": sessions}


def _plan_manager(
    record: dict[str, Any],
    entries: dict[str, Any],
    target: SessionStateManager | None,
    shardings: ShardingRules | None,
    classes: _claims.Classes,
) -> Plan:
    """Each session planned as a session checkpoint; the (empty) manager filled in LRU order."""
    settings = dict(record["settings"])
    destinations: dict[str, Destination] = {}
    uncommitted: set[str] = set()
    sessions = []
    for saved in record["sessions"]:
        where, not_committed, assemble = plan_session(saved["session"], entries, None, shardings, classes)
        destinations.update(where)
        uncommitted |= not_committed
        sessions.append((_codec.decode_value(saved["id"], classes), assemble, frozenset(saved["evicted"])))

    def assemble_manager(arrays: dict[str, Any]) -> SessionStateManager:
        snapshot = ManagerSnapshot(
            settings, tuple(SnapshotSession(sid, assemble(arrays), evicted) for sid, assemble, evicted in sessions)
        )
        if target is None:
            return SessionStateManager.from_snapshot(snapshot)
        target.load(snapshot)
        return target

    return destinations, uncommitted, assemble_manager


def _encode_saved_session(session: Session, table: ArrayTable) -> dict[str, Any]:
    """The record of a session to save, refused (before anything is written) if its arrays were donated."""
    refuse_donated(session)
    return encode_session(session, table)


_CONTENTS = {
    "session": _Content("session", Session, _encode_saved_session, plan_session),
    "manager": _Content("manager", SessionStateManager, _encode_manager, _plan_manager),
}
"""What checkpoints hold, by the name in the manifest."""
