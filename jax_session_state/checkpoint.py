"""Crash-safe checkpoints of sessions, written with Orbax.

A checkpoint is a directory::

    path/
      ckpt-000007/           the newest complete checkpoint
        manifest.json        format and version, what is saved ("session"), its
                             record (kinds, specs, residency, attrs structure, RNG
                             key implementations) and a table of its arrays with
                             shapes, dtypes and fingerprints
        arrays/              an Orbax PyTree checkpoint of those arrays
      .partial-000008/       a save in progress, or one that crashed: never read
      .superseded-000006/    an older checkpoint being deleted: never read

:func:`save` writes a whole checkpoint into a partial directory, flushes it,
renames it to the next ``ckpt-N`` (a rename is atomic) and only then removes
older ones: a crash at any moment leaves the previous checkpoint complete.
:func:`restore` reads the newest ``ckpt-N``, checks every array against its
fingerprint, and returns the whole session or raises :class:`CheckpointError`.

Arrays are placed on restore, not as they were saved, so a checkpoint written
on 8 devices restores onto 4 or onto 1: pass ``shardings=`` (ShardingRules for
every object, attrs replicated), or a ``target`` session to copy placement
from, or neither for the default device.

What a checkpoint holds is dispatched on type through ``_CONTENTS``: a new
content (a manager's sessions, LRU order and parked objects) adds an entry
whose record reuses the session records and whose arrays share the one table.

Example:
  >>> import tempfile
  >>> import jax, jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> session = jss.Session(
  ...     objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)},
  ...     attrs={"rng": jax.random.key(0)},
  ... )
  >>> session = session.append(kv=(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4))))
  >>> path = tempfile.mkdtemp()
  >>> jss.checkpoint.save(path, session).name
  'ckpt-000001'
  >>> jss.checkpoint.restore(path)["kv"].view().lengths
  Array([3], dtype=int32)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jax_session_state import _codec
from jax_session_state._fingerprint import fingerprint
from jax_session_state.base import StateObject
from jax_session_state.errors import CheckpointError
from jax_session_state.manager import SessionStateManager
from jax_session_state.session import Session
from jax_session_state.sharding import ShardingRules

__all__ = ["FORMAT", "VERSION", "restore", "save"]

FORMAT = "jax_session_state.checkpoint"
VERSION = 3
"""The on-disk format version this library writes and reads (2: ``KVCache``,
``LatentBuffer`` and ``RetrievalStore`` keep their counts in one
``bookkeeping`` array; 3: ``EncodeOnceKV`` keeps one ``phase`` for its two
flags, ``FixedState`` keeps the committed value as ``undo_value`` while one
is staged)."""

_COMPLETE = re.compile(r"ckpt-(\d+)")
_PARTIAL = ".partial-"
_TRASH = ".superseded-"
_MANIFEST = "manifest.json"
_ARRAYS = "arrays"

Placement = Any  # a jax.sharding.Sharding for device arrays, or HOST for numpy arrays
HOST = "host"


# --------------------------------------------------------------------- API
def save(path: str | os.PathLike, state: Session | SessionStateManager) -> Path:
    """Saves ``state`` as the newest checkpoint in directory ``path``, atomically.

    The previous checkpoint stays complete and restorable until the new one
    is; it is removed once the new one is in place.  One writer per ``path``
    at a time.

    Args:
      path: the checkpoint directory (created if missing).
      state: a :class:`~jax_session_state.Session` (objects, attrs including
        typed PRNG keys, lengths, flags and static specs; non-resident
        objects are saved as non-resident), or a
        :class:`~jax_session_state.SessionStateManager`: its settings and
        every session it holds, least recently used first, parked objects
        included (read from host memory, nothing is brought back), dropped
        objects recorded as dropped.  Pins, counters, callbacks and rebuild
        functions are not saved.  Sessions between a ``get`` and the ``put``
        of a step that donated them cannot be saved.

    Returns:
      The directory of the new checkpoint.

    Raises:
      TypeError: ``state`` is not something a checkpoint can hold.
      CheckpointError: a spec, structure or attr that cannot be recorded.
    """
    content = next((c for c in _CONTENTS.values() if isinstance(state, c.type)), None)
    if content is None:
        kinds = ", ".join(c.type.__name__ for c in _CONTENTS.values())
        raise TypeError(f"checkpoint.save() saves a {kinds}; got {type(state).__name__}.")
    if jax.process_count() > 1:
        raise NotImplementedError(
            "checkpoint.save() writes from one process; multi-process saves need one primary process "
            "to write the manifest and rename after Orbax's barrier, which is not implemented yet."
        )
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in (*root.glob(f"{_PARTIAL}*"), *root.glob(f"{_TRASH}*")):  # left by a crashed save
        shutil.rmtree(leftover, ignore_errors=True)
    number = max((n for n, _ in _complete(root)), default=0) + 1
    partial, final = root / f"{_PARTIAL}{number:06d}", root / f"ckpt-{number:06d}"
    table = _ArrayTable()
    manifest = {"format": FORMAT, "version": VERSION, "content": content.name, "record": content.encode(state, table)}
    partial.mkdir()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # fingerprints (numpy, GIL released) beside Orbax's writes
        fingerprints = pool.submit(table.fingerprints)
        if table.values:
            _checkpointer().save(partial / _ARRAYS, args=ocp.args.PyTreeSave(table.values))
        manifest["arrays"] = fingerprints.result()
    _write_durably(partial / _MANIFEST, json.dumps(manifest, indent=1))
    _fsync_directory(partial)
    os.rename(partial, final)
    _fsync_directory(root)
    # Older checkpoints leave by an atomic rename; their files are deleted off the caller's path.
    trash = [older.rename(root / f"{_TRASH}{n:06d}") for n, older in _complete(root)[:-1]]
    if trash:
        threading.Thread(target=lambda: [shutil.rmtree(t, ignore_errors=True) for t in trash], daemon=True).start()
    return final


def restore(
    path: str | os.PathLike,
    *,
    target: Session | SessionStateManager | None = None,
    shardings: ShardingRules | None = None,
) -> Session | SessionStateManager:
    """Restores the newest checkpoint in directory ``path``.

    Args:
      path: the checkpoint directory given to :func:`save`.
      target: for a session checkpoint, a session the checkpoint must match
        (object names, kinds, specs, attrs structure, shapes and dtypes);
        restored objects take its placement (each object's ShardingRules,
        else where its arrays are).  For a manager checkpoint, an empty
        manager to fill (its own settings, callbacks and registered rebuilds
        apply); without one, a new manager with the saved settings.
      shardings: rules to place every object by (attrs are replicated on the
        mesh), whatever the checkpoint was saved on; overrides ``target``'s.

    Without ``target`` or ``shardings`` everything lands on the default
    device.  A restored session continues a rollout bit for bit.  A restored
    manager admits the sessions least recently used first, by its usual
    rules (so under a smaller budget it parks or preempts as ``create``
    would); objects dropped when saved are rebuilt if a rebuild is
    registered on it, else left non-resident; its counters start at zero.

    Raises:
      CheckpointError: no checkpoint, another format version, damaged or
        truncated files, or a target that does not match.  Nothing is
        half-restored.
    """
    if target is not None and not isinstance(target, (Session, SessionStateManager)):
        raise TypeError(f"restore(target=...) takes a Session or a SessionStateManager; got {type(target).__name__}.")
    if shardings is not None and not isinstance(shardings, ShardingRules):
        raise TypeError(f"restore(shardings=...) takes ShardingRules; got {type(shardings).__name__}.")
    directory = _newest(Path(path))
    manifest = _read_manifest(directory)
    content = _CONTENTS.get(manifest.get("content"))
    if content is None:
        raise CheckpointError(f"{directory}: holds {manifest.get('content')!r}, which this library cannot restore.")
    if target is not None and not isinstance(target, content.type):
        raise CheckpointError(
            f"{directory} holds a {content.type.__name__}; restore(target=...) got a {type(target).__name__}."
        )
    try:
        placements, assemble = content.plan(manifest["record"], manifest["arrays"], target, shardings)
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise CheckpointError(f"{directory}/{_MANIFEST} is malformed: {error!r}.") from error
    return assemble(_read_arrays(directory, manifest["arrays"], placements))


# ------------------------------------------------------------- sessions
def _encode_session(session: Session, table: _ArrayTable) -> dict[str, Any]:
    objects = {}
    for name, obj in session.objects.items():
        where = f"session object {name!r}"
        record = _object_spec(obj, where)
        storage = {field: getattr(obj, field) for field in obj.storage_fields()}
        record["storage"] = (
            [table.add(x, f"{name}.{jax.tree_util.keystr(p)}") for p, x in jax.tree_util.tree_leaves_with_path(storage)]
            if obj.resident
            else None
        )
        objects[name] = record
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(session.attrs)
    leaves = [_encode_attr(leaf, f"attrs{jax.tree_util.keystr(p)}", table) for p, leaf in paths_and_leaves]
    return {"objects": objects, "attrs": {"treedef": _codec.encode_treedef(treedef, where="attrs"), "leaves": leaves}}


def _object_spec(obj: StateObject, where: str) -> dict[str, Any]:
    """What makes an object what it is, without storage or placement."""
    return {
        "kind": _codec.class_name(type(obj), where),
        "spec": {f: _codec.encode_value(getattr(obj, f), where=f"{where} spec {f}") for f in obj.spec_fields()},
        "recompute_source": list(obj.recompute_source),
        "recompute_cost": obj.recompute_cost,
    }


def _encode_attr(leaf: Any, where: str, table: _ArrayTable) -> dict[str, Any]:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return {"array": table.add(leaf, where)}
    if isinstance(leaf, (bool, int, float, str)):
        return {"value": leaf}
    raise CheckpointError(
        f"{where}: cannot save an attr of type {type(leaf).__qualname__}; attrs hold arrays (jax, numpy, "
        "typed PRNG keys) and bool/int/float/str values."
    )


def _plan_session(
    record: dict[str, Any], entries: dict[str, Any], target: Session | None, shardings: ShardingRules | None
) -> tuple[dict[str, Placement], Callable[[dict[str, Any]], Session]]:
    """Where each array of a session record goes, and how to build the session from them."""
    if target is not None:
        _check_matches(record, entries, target)
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    placements: dict[str, Placement] = {}
    objects: dict[str, StateObject] = {}
    storages: dict[str, tuple[Any, list[str]]] = {}
    for name, obj_record in record["objects"].items():
        cls = _codec.import_class(obj_record["kind"], StateObject)
        known = target[name] if target is not None else None
        rules = shardings if shardings is not None else getattr(known, "sharding", None)
        obj = cls(
            **{f: _codec.decode_value(v) for f, v in obj_record["spec"].items()},
            recompute_source=tuple(obj_record["recompute_source"]),
            recompute_cost=obj_record["recompute_cost"],
            sharding=rules,
        )
        objects[name] = obj
        if obj_record["storage"] is None:
            continue
        shapes = jax.eval_shape(obj._empty_storage)
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        keys = obj_record["storage"]
        _check_table(entries, keys, leaves, f"session object {name!r}")
        if rules is not None:
            where = jax.tree_util.tree_leaves(rules.shardings(obj.storage_axes(), shapes, owner=obj.describe()))
        elif known is not None and known.resident:
            where = [x.sharding for x in jax.tree_util.tree_leaves({f: getattr(known, f) for f in known.storage_fields()})]
        else:
            where = [default] * len(keys)
        placements.update(zip(keys, where))
        storages[name] = (treedef, keys)
    attr_treedef = _codec.decode_treedef(record["attrs"]["treedef"])
    known_attrs = jax.tree_util.tree_leaves(target.attrs) if target is not None else None
    for i, leaf in enumerate(record["attrs"]["leaves"]):
        if "array" in leaf:
            entry = entries[leaf["array"]]
            if entry["type"] in ("numpy", "numpy_scalar"):
                placements[leaf["array"]] = HOST
            elif shardings is not None:
                placements[leaf["array"]] = shardings.replicated()
            elif known_attrs is not None and isinstance(known_attrs[i], jax.Array):
                placements[leaf["array"]] = known_attrs[i].sharding
            else:
                placements[leaf["array"]] = default

    def assemble(arrays: dict[str, Any]) -> Session:
        for name, (treedef, keys) in storages.items():
            storage = treedef.unflatten([arrays[k] for k in keys])
            objects[name] = objects[name].replace(**storage)
        attrs = [arrays[leaf["array"]] if "array" in leaf else leaf["value"] for leaf in record["attrs"]["leaves"]]
        return Session(objects=objects, attrs=attr_treedef.unflatten(attrs))

    return placements, assemble


def _check_table(entries: dict[str, Any], keys: list[str], leaves: list[Any], where: str) -> None:
    saved = [(tuple(entries[k]["shape"]), entries[k]["dtype"]) for k in keys]
    expected = [(tuple(x.shape), np.dtype(x.dtype).name) for x in leaves]
    if saved != expected:
        raise CheckpointError(f"{where}: the checkpoint's arrays {saved} do not fit its spec, which needs {expected}.")


def _check_matches(record: dict[str, Any], entries: dict[str, Any], target: Session) -> None:
    """Raises naming every way the checkpoint differs from ``target``."""
    problems = []
    saved, wanted = set(record["objects"]), set(target.objects)
    if saved != wanted:
        problems.append(f"objects {sorted(saved)} in the checkpoint, {sorted(wanted)} in the target")
    for name in sorted(saved & wanted):
        obj_record = dict(record["objects"][name])
        del obj_record["storage"]
        if obj_record != json.loads(json.dumps(_object_spec(target[name], f"target object {name!r}"))):
            problems.append(f"object {name!r} is {_describe(obj_record)} in the checkpoint, {target[name].describe()} in the target")
    table = _ArrayTable(keep_values=False)
    target_attrs = json.loads(json.dumps(_encode_session(Session(objects={}, attrs=target.attrs), table)["attrs"]))
    saved_attrs = [_signature(leaf, entries) for leaf in record["attrs"]["leaves"]]
    wanted_attrs = [_signature(leaf, table.entries) for leaf in target_attrs["leaves"]]
    if record["attrs"]["treedef"] != target_attrs["treedef"] or saved_attrs != wanted_attrs:
        problems.append(f"attrs {saved_attrs} in the checkpoint, {wanted_attrs} in the target")
    if problems:
        raise CheckpointError("the checkpoint does not match the target: " + "; ".join(problems) + ".")


def _signature(leaf: dict[str, Any], entries: dict[str, Any]) -> str:
    if "value" in leaf:
        return type(leaf["value"]).__name__
    entry = entries[leaf["array"]]
    return f"{entry['type']} {entry['dtype']}{entry['shape']}" + (f" {entry['impl']}" if "impl" in entry else "")


def _describe(obj_record: dict[str, Any]) -> str:
    spec = ", ".join(f"{k}={_codec.decode_value(v)!r}" for k, v in obj_record["spec"].items())
    return f"{obj_record['kind'].rpartition(':')[2]}({spec})"


@dataclasses.dataclass(frozen=True)
class _Content:
    """One kind of thing a checkpoint holds: how to record it and how to plan its restore."""

    name: str
    type: type
    encode: Callable[[Any, _ArrayTable], dict[str, Any]]
    plan: Callable[..., tuple[dict[str, Placement], Callable[[dict[str, Any]], Any]]]


# ------------------------------------------------------------- managers
def _encode_manager(manager: SessionStateManager, table: _ArrayTable) -> dict[str, Any]:
    """Every session held, least recently used first; parked objects saved with their host arrays."""
    if manager.checked_out():
        raise CheckpointError(
            f"sessions {sorted(map(repr, manager.checked_out()))} are checked out into pool slots, so the "
            "manager does not hold them; checkin() them before saving the manager."
        )
    sessions = []
    for session_id, held in manager.held().items():
        if held.donated:
            raise CheckpointError(
                f"session {session_id!r} is in use: its arrays were donated to a step that has not been "
                "put back. put() it (or drop() it) before saving the manager."
            )
        objects = {name: held.parked[name].obj if name in held.parked else obj for name, obj in held.session.objects.items()}
        sessions.append(
            {
                "id": _codec.encode_value(session_id, where=f"session id {session_id!r}"),
                "session": _encode_session(held.session.replace(objects=objects), table),
                "dropped": sorted(held.dropped),
            }
        )
    return {"config": manager.config(), "sessions": sessions}


def _plan_manager(
    record: dict[str, Any],
    entries: dict[str, Any],
    target: SessionStateManager | None,
    shardings: ShardingRules | None,
) -> tuple[dict[str, Placement], Callable[[dict[str, Any]], SessionStateManager]]:
    """Each session planned as a session checkpoint; the manager filled in LRU order."""
    manager = SessionStateManager(**record["config"]) if target is None else target
    if len(manager):
        raise CheckpointError(f"restore(target=manager): the manager must be empty; it holds {len(manager)} sessions.")
    placements: dict[str, Placement] = {}
    sessions = []
    for saved in record["sessions"]:
        where, assemble = _plan_session(saved["session"], entries, None, shardings)
        placements.update(where)
        sessions.append((_codec.decode_value(saved["id"]), assemble, frozenset(saved["dropped"])))

    def assemble_manager(arrays: dict[str, Any]) -> SessionStateManager:
        manager._load((session_id, assemble(arrays), dropped) for session_id, assemble, dropped in sessions)
        return manager

    return placements, assemble_manager


_CONTENTS = {
    "session": _Content("session", Session, _encode_session, _plan_session),
    "manager": _Content("manager", SessionStateManager, _encode_manager, _plan_manager),
}
"""What checkpoints hold, by the name in the manifest."""


# --------------------------------------------------------------- arrays
class _ArrayTable:
    """The arrays of one checkpoint, keyed ``"0"``, ``"1"``, ..., with their manifest entries."""

    def __init__(self, *, keep_values: bool = True) -> None:
        self.keep_values = keep_values
        self.values: dict[str, Any] = {}
        self.entries: dict[str, dict[str, Any]] = {}

    def add(self, x: Any, where: str) -> str:
        key = str(len(self.entries))
        entry: dict[str, Any] = {"where": where}
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            entry.update(type="key", impl=str(jax.random.key_impl(x)))
            x = jax.random.key_data(x)
        elif isinstance(x, jax.Array):
            entry["type"] = "jax"
        else:
            entry["type"] = "numpy_scalar" if isinstance(x, np.generic) else "numpy"
            x = np.asarray(x)
        entry.update(shape=list(x.shape), dtype=np.dtype(x.dtype).name)
        if self.keep_values:
            self.values[key] = x
        self.entries[key] = entry
        return key

    def fingerprints(self) -> dict[str, dict[str, Any]]:
        """The manifest entries, each with its array's fingerprint."""
        return {key: {**entry, "fingerprint": fingerprint(self.values[key])} for key, entry in self.entries.items()}


def _read_arrays(directory: Path, entries: dict[str, Any], placements: dict[str, Placement]) -> dict[str, Any]:
    """Reads every array of the checkpoint, placed, and checks its fingerprint."""
    if not entries:
        return {}
    item, restore_args = {}, {}
    for key, entry in entries.items():
        place = placements[key]
        dtype = jnp.dtype(entry["dtype"])
        item[key] = jax.ShapeDtypeStruct(tuple(entry["shape"]), dtype, sharding=None if place == HOST else place)
        restore_args[key] = (
            ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
            if place == HOST
            else ocp.ArrayRestoreArgs(sharding=place, dtype=dtype)
        )
    try:
        arrays = _checkpointer().restore(
            directory / _ARRAYS, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        )
    except Exception as error:  # Orbax and TensorStore raise many types for damaged files
        raise CheckpointError(f"{directory}: the arrays cannot be read (damaged or truncated files?): {error}") from error
    out = {}
    for key, entry in entries.items():
        x = arrays.pop(key)
        if fingerprint(x) != entry["fingerprint"]:
            raise CheckpointError(
                f"{directory}: array {entry['where']} does not match its fingerprint: its files are damaged."
            )
        if isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set):
            # On CPU, JAX wraps suitably aligned host buffers without copying; Orbax reads into such
            # buffers and a donated step cannot reuse them (the first step would copy the whole
            # state). Copied into runtime-owned buffers one array at a time: the peak stays the
            # state plus its largest array.
            x, wrapped = jnp.copy(x), x
            wrapped.delete()
        if entry["type"] == "key":
            x = jax.random.wrap_key_data(x, impl=entry["impl"])
        elif entry["type"] == "numpy_scalar":
            x = np.asarray(x)[()]
        out[key] = x
    return out


_ORBAX_OPTIONS = {"use_ocdbt": False, "use_compression": False}
"""How arrays are written, chosen by measurement (``benchmarks/sharded.py``): session
state is a few large arrays of incompressible floats, so compression only costs
time, and plain zarr files saved faster than OCDBT's single data file."""


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**_ORBAX_OPTIONS))


class _WithoutOcdbtMergeWarning(logging.Filter):
    """Drops the warning Orbax logs on every save without OCDBT (there is nothing to merge)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


logging.getLogger("absl").addFilter(_WithoutOcdbtMergeWarning())


# ---------------------------------------------------------------- files
def _complete(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``root``, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _COMPLETE.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def _newest(root: Path) -> Path:
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {root}: it is not a directory.")
    complete = _complete(root)
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {root} (a save that crashed leaves none).")
    return complete[-1][1]


def _read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / _MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{directory}/{_MANIFEST} cannot be read (damaged or truncated?): {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a {FORMAT} checkpoint.")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{directory} was written in checkpoint format version {manifest.get('version')!r}; this "
            f"library reads version {VERSION}. Restore it with the jax_session_state that wrote it."
        )
    return manifest


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

