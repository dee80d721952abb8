"""JSON records of what a checkpoint holds besides array bytes: pytree structures, specs, classes.

Records are plain JSON, readable in the manifest, and decode to values equal
to the ones encoded (a spec restored from a record compares equal to the
spec that was saved, so a restored object compiles like the original).
Decoding imports and evaluates nothing: the classes, dtypes and key
implementations a record names are looked up as ``_claims`` says.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_session_state.checkpoint._claims import Classes, dtype_named, key_impl_named
from jax_session_state.errors import CheckpointError

LEAF = "*"
"""The record of a leaf in a recorded pytree structure."""


def encode_treedef(treedef: jax.tree_util.PyTreeDef, *, where: str) -> Any:
    """A JSON record of a pytree structure made of dicts, lists, tuples, namedtuples and None.

    Raises:
      CheckpointError: a node of another type (naming ``where``).
    """
    return _encode_node(treedef.unflatten([_Leaf()] * treedef.num_leaves), where)


def decode_treedef(record: Any, classes: Classes) -> jax.tree_util.PyTreeDef:
    """The pytree structure recorded by :func:`encode_treedef`, its namedtuples resolved by ``classes``."""
    return jax.tree_util.tree_structure(_decode_node(record, classes))


class _Leaf:
    """Stands for a leaf while a structure is recorded (any non-pytree object would do)."""


def _encode_node(x: Any, where: str) -> Any:
    if isinstance(x, _Leaf):
        return LEAF
    if x is None:
        return {"none": None}
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return {"namedtuple": class_name(type(x), where), "items": [_encode_node(v, where) for v in x]}
    if type(x) in (tuple, list):
        return {type(x).__name__: [_encode_node(v, where) for v in x]}
    if type(x) is dict and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in x):
        return {"dict": [[k, _encode_node(v, where)] for k, v in x.items()]}
    raise CheckpointError(
        f"{where}: cannot record a pytree node of type {type(x).__qualname__} (or its keys); checkpoints "
        "record structures made of dicts with str/int keys, lists, tuples, namedtuples and None."
    )


def _decode_node(record: Any, classes: Classes) -> Any:
    if record == LEAF:
        return _Leaf()
    if "namedtuple" in record:
        return classes.namedtuple(record["namedtuple"])(*(_decode_node(v, classes) for v in record["items"]))
    (tag, body), = record.items()
    if tag == "none":
        return None
    if tag == "tuple":
        return tuple(_decode_node(v, classes) for v in body)
    if tag == "list":
        return [_decode_node(v, classes) for v in body]
    if tag == "dict":
        return {k: _decode_node(v, classes) for k, v in body}
    raise CheckpointError(f"unknown pytree node {tag!r} in a checkpoint record.")


def encode_value(value: Any, *, where: str) -> Any:
    """A JSON record of a static spec value.

    Numbers, strings, tuples, dtypes, pytree structures, and the shapes and
    dtypes of arrays (typed PRNG keys included).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v, where=where) for v in value]}
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return {"dtype": np.dtype(value).name}
    if isinstance(value, jax.tree_util.PyTreeDef):
        return {"treedef": encode_treedef(value, where=where)}
    if isinstance(value, jax.ShapeDtypeStruct):
        return {"shape_dtype": [list(value.shape), encode_dtype(value.dtype)]}
    raise CheckpointError(
        f"{where}: cannot record a spec value of type {type(value).__qualname__} ({value!r}) in a checkpoint."
    )


def decode_value(record: Any, classes: Classes) -> Any:
    """The spec value recorded by :func:`encode_value`, its classes resolved by ``classes``."""
    if not isinstance(record, dict):
        return record
    (tag, body), = record.items()
    if tag == "tuple":
        return tuple(decode_value(v, classes) for v in body)
    if tag == "dtype":
        return dtype_named(body)
    if tag == "treedef":
        return decode_treedef(body, classes)
    if tag == "shape_dtype":
        shape, dtype = body
        return jax.ShapeDtypeStruct(tuple(shape), decode_dtype(dtype))
    raise CheckpointError(f"unknown spec value {tag!r} in a checkpoint record.")


def encode_dtype(dtype: Any) -> str | dict[str, str]:
    """A JSON record of an array's dtype: its name, or for typed PRNG keys their implementation (``{"key": "rbg"}``)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return {"key": str(jax.random.key_impl(jnp.zeros((), dtype)))}  # a key's implementation is read off a key
    return np.dtype(dtype).name


def decode_dtype(record: str | dict[str, str]) -> Any:
    """The dtype recorded by :func:`encode_dtype`."""
    if isinstance(record, dict):
        return jax.eval_shape(functools.partial(jax.random.key, 0, impl=key_impl_named(record["key"]))).dtype
    return dtype_named(record)


def class_name(cls: type, where: str) -> str:
    """``"module:QualName"`` of a class defined at module level (what a restore can look up)."""
    if "<locals>" in cls.__qualname__:
        raise CheckpointError(
            f"{where}: {cls.__qualname__} is defined inside a function, so a restore could not find "
            "it; define it at module level."
        )
    return f"{cls.__module__}:{cls.__qualname__}"
