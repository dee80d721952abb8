"""A session's record in a checkpoint: its objects, specs and attrs, and how a restore places and recomputes it.

:func:`encode_session` turns a session into the manifest's record and its
arrays into an :class:`~._manifest.ArrayTable`; :func:`plan_session` reads a
record back: where each array goes (a sharding, numpy, or the default device
uncommitted, as arrays ``jnp`` makes) and how the session is built once the
arrays are read and verified.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_session_state._core._placement import is_donated
from jax_session_state.base import StateObject
from jax_session_state.checkpoint import _codec
from jax_session_state.checkpoint._claims import Classes
from jax_session_state.checkpoint._manifest import ArrayTable
from jax_session_state.checkpoint._orbax_io import AS_NUMPY, Destination
from jax_session_state.errors import CheckpointError, DonatedError, PayloadError, PayloadTypeError
from jax_session_state.session import Session
from jax_session_state.sharding import ShardingRules

__all__ = ["Plan", "encode_session", "plan_session", "refuse_donated"]

Plan = tuple[dict[str, Destination], set[str], Callable[[dict[str, Any]], Any]]
"""Where each array goes, the keys placed uncommitted, and what builds the restored state from the arrays."""

_RECORDED = ("recompute_source", "recompute_cost")
"""The static fields besides the spec that a record keeps."""


# ------------------------------------------------------------------ save
def refuse_donated(session: Session) -> None:
    """Raises, before anything is written, if an array of ``session`` was donated (deleted).

    Raises:
      DonatedError: naming the object or attr whose arrays are gone.
    """
    for name, obj in session.objects.items():
        if is_donated(obj):
            _raise_donated(f"session object {name!r} ({obj.describe()})")
    for path, leaf in jax.tree_util.tree_leaves_with_path(session.attrs):
        if is_donated(leaf):
            _raise_donated(f"the session's attrs{jax.tree_util.keystr(path)}")


def _raise_donated(what: str) -> None:
    raise DonatedError(
        f"checkpoint.save(): {what} was donated to a jitted step and deleted, so it cannot be saved; "
        "nothing was written. Save the step's output instead."
    )


def encode_session(session: Session, table: ArrayTable) -> dict[str, Any]:
    """The record of ``session``, its arrays added to ``table``."""
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


# --------------------------------------------------------------- restore
def plan_session(
    record: dict[str, Any],
    entries: dict[str, Any],
    target: Session | None,
    shardings: ShardingRules | None,
    classes: Classes,
) -> Plan:
    """Where each array of a session record goes, and how to build the session from them.

    Objects take ``shardings``, else their ``target`` object's placement and
    the management fields a record leaves out (``demote_fn``), else the
    default device (``jax.default_device``), uncommitted.  The kinds and
    namedtuples the record names are looked up in ``classes``.

    Raises:
      CheckpointError: the record does not match ``target`` or its own specs,
        or names a class that is not defined in this process.
      PayloadError, PayloadTypeError: the rules (``shardings``, or the
        target's) cannot place an object, naming the argument.
    """
    if target is not None:
        _check_matches(record, entries, target, classes)
    default = jax.sharding.SingleDeviceSharding(_default_device())
    destinations: dict[str, Destination] = {}
    uncommitted: set[str] = set()  # placed like arrays jnp makes: on the default device, not committed to it
    objects: dict[str, StateObject] = {}
    storages: dict[str, tuple[Any, list[str]]] = {}
    for name, obj_record in record["objects"].items():
        cls = classes.kind(obj_record["kind"])
        known = target[name] if target is not None else None
        rules = shardings if shardings is not None else getattr(known, "sharding", None)
        obj = cls(
            **{f: _codec.decode_value(v, classes) for f, v in obj_record["spec"].items()},
            recompute_source=tuple(obj_record["recompute_source"]),
            recompute_cost=obj_record["recompute_cost"],
            sharding=rules,
            **({f: getattr(known, f) for f in _unrecorded_fields(cls)} if known is not None else {}),
        )
        objects[name] = obj
        if obj_record["storage"] is None:
            continue
        shapes = obj.storage_shapes()
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        keys = obj_record["storage"]
        _check_table(entries, keys, leaves, f"session object {name!r}")
        if rules is not None:
            where = _placed_by(rules, obj, shapes, "shardings" if shardings is not None else "target")
        elif known is not None and known.resident:
            known_leaves = jax.tree_util.tree_leaves({f: getattr(known, f) for f in known.storage_fields()})
            where = [x.sharding for x in known_leaves]
            uncommitted.update(k for k, x in zip(keys, known_leaves) if not x.committed)
        else:
            where = [default] * len(keys)
            uncommitted.update(keys)
        destinations.update(zip(keys, where))
        storages[name] = (treedef, keys)
    attr_treedef = _codec.decode_treedef(record["attrs"]["treedef"], classes)
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


def _default_device() -> jax.Device:
    """Where ``jnp`` puts new arrays: the device ``jax.default_device`` names, else the first local device."""
    chosen = jax.config.jax_default_device
    if isinstance(chosen, str):  # a platform name
        return jax.local_devices(backend=chosen)[0]
    return chosen if chosen is not None else jax.local_devices()[0]


def _unrecorded_fields(cls: type[StateObject]) -> tuple[str, ...]:
    """The static fields a record leaves out besides the placement: how an object is managed (``demote_fn``)."""
    recorded = {*cls.spec_fields(), *_RECORDED, "sharding"}
    return tuple(
        f.name for f in dataclasses.fields(cls) if not f.metadata.get("pytree_node", True) and f.name not in recorded
    )


def _placed_by(rules: ShardingRules, obj: StateObject, shapes: Any, argument: str) -> list[jax.sharding.Sharding]:
    """The sharding of each storage leaf of ``obj`` by ``rules``, which ``restore(argument=...)`` gave."""
    try:
        return jax.tree_util.tree_leaves(rules.shardings(obj.storage_axes(), shapes, owner=obj.describe()))
    except (PayloadError, PayloadTypeError) as error:
        raise type(error)(f"restore({argument}=...): {error}") from None


def _check_table(entries: dict[str, Any], keys: list[str], leaves: list[Any], where: str) -> None:
    saved = [(tuple(entries[k]["shape"]), entries[k]["dtype"], entries[k].get("impl")) for k in keys]
    expected = [_table_layout(x) for x in leaves]
    if saved != expected:
        raise CheckpointError(f"{where}: the checkpoint's arrays {saved} do not fit its spec, which needs {expected}.")


def _table_layout(leaf: jax.ShapeDtypeStruct) -> tuple[tuple[int, ...], str, str | None]:
    """The shape, dtype name and key implementation a storage leaf of this shape has in the array table.

    A typed PRNG key is held as its key data, with its implementation.
    """
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype).name, _codec.encode_dtype(leaf.dtype)["key"]
    return tuple(leaf.shape), np.dtype(leaf.dtype).name, None


def _check_matches(record: dict[str, Any], entries: dict[str, Any], target: Session, classes: Classes) -> None:
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
                f"object {name!r} is {_describe(obj_record, classes)} in the checkpoint, "
                f"{target[name].describe()} in the target"
            )
    table = ArrayTable(keep_values=False)
    target_attrs = json.loads(json.dumps(encode_session(Session(objects={}, attrs=target.attrs), table)["attrs"]))
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


def _describe(obj_record: dict[str, Any], classes: Classes) -> str:
    spec = ", ".join(f"{k}={_codec.decode_value(v, classes)!r}" for k, v in obj_record["spec"].items())
    return f"{obj_record['kind'].rpartition(':')[2]}({spec})"
