"""``save`` and ``restore``: the tree of a session or a manager they walk, and its manifest's entries.

The format is told in the package docstring (:mod:`jax_session_state.checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_session_state.base import StateObject
from jax_session_state.checkpoint import _atomic, _codec, _manifest, _orbax_io, _pieces, _processes
from jax_session_state.checkpoint._manifest import FORMAT, VERSION, ArrayTable
from jax_session_state.checkpoint._orbax_io import AS_NUMPY, Destination
from jax_session_state.errors import CheckpointError, PayloadTypeError
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
        evicted.  Pins, counters, callbacks and rebuild functions are not
        saved.  Sessions between a ``get`` and the ``put`` of a step that
        donated them cannot be saved.

    Returns:
      The directory of the new checkpoint.

    Raises:
      PayloadTypeError: ``state`` is not something a checkpoint can hold.
      CheckpointError: a spec, structure or attr that cannot be recorded.

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
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # digests (hashlib releases the GIL) beside Orbax
            entries = pool.submit(table.digested_entries)
            if table.values:
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
    publishes; a last barrier returns on every process only once the
    checkpoint is in place.  A process that dies anywhere in between leaves
    no ``ckpt-N`` behind, so the previous one stays the newest.
    """
    number = _atomic.begin(root)[1].name if _processes.is_primary() else ""
    number = _processes.broadcast_int(int(number.rpartition("-")[2]) if number else 0)
    partial, final = _atomic.named(root, number)
    # Orbax refuses arrays one process holds whole: those (numpy, attrs on one device) are the same on
    # every process (checked by their digests) and written once, by the primary, as numpy.
    values = {k: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x
              for k, x in table.values.items()}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        local = pool.submit(_pieces.local_digests, table.values)
        if values:
            _orbax_io.write_arrays(partial / _ARRAYS, values)
        entries = _pieces.gather_digests(table.entries, local.result())
    if _processes.is_primary():
        _manifest.write(partial, content, record, entries)
        _atomic.publish(partial, final)
    _processes.barrier(f"jss-checkpoint-published-{final}")
    return final


def restore(
    path: str | os.PathLike,
    *,
    target: Session | SessionStateManager | None = None,
    shardings: ShardingRules | None = None,
) -> Session | SessionStateManager:
    """Restores the newest checkpoint in directory ``path``, verified.

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
    rules (:meth:`SessionStateManager.load`).

    Raises:
      CheckpointError: no checkpoint, another format version, a manifest or
        array that does not match its digest (damaged files), truncated
        files, or a target that does not match; naming the file and what is
        wrong.  Nothing is half-restored.
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
    directory = _atomic.newest(Path(path))
    manifest = _manifest.read(directory)
    content = _CONTENTS.get(manifest.get("content"))
    if content is None:
        raise CheckpointError(f"{directory}: holds {manifest.get('content')!r}, which this library cannot restore.")
    if target is not None and not isinstance(target, content.type):
        raise CheckpointError(
            f"{directory} holds a {content.type.__name__}; restore(target=...) got a {type(target).__name__}."
        )
    entries = manifest["arrays"]
    with _decoding(directory):
        destinations, uncommitted, assemble = content.plan(manifest["record"], entries, target, shardings)
        layout = {key: (tuple(entry["shape"]), str(entry["dtype"])) for key, entry in entries.items()}
        pieces = _pieces.expected(entries)
    read_to = {key: AS_NUMPY if key in uncommitted else where for key, where in destinations.items()}
    arrays = _orbax_io.read_arrays(directory / _ARRAYS, layout, read_to) if entries else {}
    _pieces.verify(directory, arrays, entries, pieces)
    with _decoding(directory):
        values = {
            key: _finish(arrays.pop(key), entry, destinations[key] if key in uncommitted else None)
            for key, entry in entries.items()
        }
    return assemble(values)


@contextlib.contextmanager
def _decoding(directory: Path) -> Iterator[None]:
    """Turns what a record that does not decode raises into a CheckpointError naming the manifest."""
    try:
        yield
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
    state plus its largest array).
    """
    if uncommitted_on is not None:
        x = jax.block_until_ready(place(x, uncommitted_on, committed=False))  # before the next array's copy
    elif isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set):
        x = jax.block_until_ready(runtime_owned(x))
    if entry["type"] == "key":
        return jax.random.wrap_key_data(x, impl=entry["impl"])
    if entry["type"] == "numpy_scalar":
        return np.asarray(x)[()]
    return x


# ------------------------------------------------------------- sessions
def _encode_session(session: Session, table: ArrayTable) -> dict[str, Any]:
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


def _encode_attr(leaf: Any, where: str, table: ArrayTable) -> dict[str, Any]:
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
) -> tuple[dict[str, Destination], set[str], Callable[[dict[str, Any]], Session]]:
    """Where each array of a session record goes, and how to build the session from them."""
    if target is not None:
        _check_matches(record, entries, target)
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    destinations: dict[str, Destination] = {}
    uncommitted: set[str] = set()  # placed like arrays jnp makes: on the default device, not committed to it
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
        shapes = obj.storage_shapes()
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        keys = obj_record["storage"]
        _check_table(entries, keys, leaves, f"session object {name!r}")
        if rules is not None:
            where = jax.tree_util.tree_leaves(rules.shardings(obj.storage_axes(), shapes, owner=obj.describe()))
        elif known is not None and known.resident:
            known_leaves = jax.tree_util.tree_leaves({f: getattr(known, f) for f in known.storage_fields()})
            where = [x.sharding for x in known_leaves]
            uncommitted.update(k for k, x in zip(keys, known_leaves) if not x.committed)
        else:
            where = [default] * len(keys)
            uncommitted.update(keys)
        destinations.update(zip(keys, where))
        storages[name] = (treedef, keys)
    attr_treedef = _codec.decode_treedef(record["attrs"]["treedef"])
    known_attrs = jax.tree_util.tree_leaves(target.attrs) if target is not None else None
    for i, leaf in enumerate(record["attrs"]["leaves"]):
        if "array" in leaf:
            entry = entries[leaf["array"]]
            if entry["type"] in ("numpy", "numpy_scalar"):
                destinations[leaf["array"]] = AS_NUMPY
            elif shardings is not None:
                destinations[leaf["array"]] = shardings.replicated()
            elif known_attrs is not None and isinstance(known_attrs[i], jax.Array):
                destinations[leaf["array"]] = known_attrs[i].sharding
                if not known_attrs[i].committed:
                    uncommitted.add(leaf["array"])
            else:
                destinations[leaf["array"]] = default
                uncommitted.add(leaf["array"])

    def assemble(arrays: dict[str, Any]) -> Session:
        for name, (treedef, keys) in storages.items():
            storage = treedef.unflatten([arrays[k] for k in keys])
            objects[name] = objects[name].replace(**storage)
        attrs = [arrays[leaf["array"]] if "array" in leaf else leaf["value"] for leaf in record["attrs"]["leaves"]]
        try:
            return Session(objects=objects, attrs=attr_treedef.unflatten(attrs))
        except (ValueError, TypeError) as error:  # e.g. a recompute source that names no object
            raise CheckpointError(f"the checkpoint's record does not make a valid session: {error}") from error

    return destinations, uncommitted, assemble


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
            problems.append(
                f"object {name!r} is {_describe(obj_record)} in the checkpoint, {target[name].describe()} in the target"
            )
    table = ArrayTable(keep_values=False)
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
    encode: Callable[[Any, ArrayTable], dict[str, Any]]
    plan: Callable[..., tuple[dict[str, Destination], set[str], Callable[[dict[str, Any]], Any]]]


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
            "session": _encode_session(held.session, table),
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
) -> tuple[dict[str, Destination], set[str], Callable[[dict[str, Any]], SessionStateManager]]:
    """Each session planned as a session checkpoint; the manager filled in LRU order."""
    if target is not None and len(target):
        raise CheckpointError(f"restore(target=manager): the manager must be empty; it holds {len(target)} sessions.")
    settings = dict(record["settings"])
    destinations: dict[str, Destination] = {}
    uncommitted: set[str] = set()
    sessions = []
    for saved in record["sessions"]:
        where, not_committed, assemble = _plan_session(saved["session"], entries, None, shardings)
        destinations.update(where)
        uncommitted |= not_committed
        sessions.append((_codec.decode_value(saved["id"]), assemble, frozenset(saved["evicted"])))

    def assemble_manager(arrays: dict[str, Any]) -> SessionStateManager:
        snapshot = ManagerSnapshot(
            settings, tuple(SnapshotSession(sid, assemble(arrays), evicted) for sid, assemble, evicted in sessions)
        )
        if target is None:
            return SessionStateManager.from_snapshot(snapshot)
        target.load(snapshot)
        return target

    return destinations, uncommitted, assemble_manager


_CONTENTS = {
    "session": _Content("session", Session, _encode_session, _plan_session),
    "manager": _Content("manager", SessionStateManager, _encode_manager, _plan_manager),
}
"""What checkpoints hold, by the name in the manifest."""
