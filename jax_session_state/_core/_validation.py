"""Trace-time checks of payloads and allocate arguments, with clear messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_session_state.errors import PayloadError, PayloadTypeError

ShapePattern = Sequence["int | str"]


def shape_str(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def check_array(
    x: Any,
    *,
    owner: str,
    what: str,
    shape: ShapePattern,
    dtype: Any,
    sizes: dict[str, int] | None = None,
) -> None:
    """Checks ``x`` against a shape pattern and an exact dtype.

    Args:
      x: the array given.
      owner: names the object and operation, e.g. ``"KVCache(...).stage"``.
      what: names the argument, e.g. ``"k"``.
      shape: ints are fixed sizes; strings name free sizes, bound in ``sizes``
        on first use so two arrays can be required to agree (``"T"``).
      dtype: the dtype required exactly (no silent casts, so no retrace).
      sizes: bindings of the free sizes, shared across calls; updated here.

    Raises:
      PayloadTypeError: not an array, or the wrong dtype.
      PayloadError: the wrong rank or shape.
    """
    sizes = {} if sizes is None else sizes
    expected = f"shape {shape_str(shape)} and dtype {dtype_name(dtype)}"
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise PayloadTypeError(f"{owner}: {what} must be an array of {expected}; got {type(x).__name__}.")
    got = f"shape {shape_str(x.shape)} and dtype {dtype_name(x.dtype)}"
    mismatch = len(x.shape) != len(shape)
    for want, have in zip(shape, x.shape):
        if isinstance(want, str):
            if sizes.setdefault(want, have) != have:
                mismatch = True
        elif want != have:
            mismatch = True
    if mismatch:
        bound = ", ".join(f"{k}={v}" for k, v in sizes.items())
        hint = f" (with {bound})" if bound else ""
        raise PayloadError(f"{owner}: {what} must have {expected}{hint}; got {got}.")
    if x.dtype != dtype:
        raise PayloadTypeError(f"{owner}: {what} must have {expected}; got {got}. Cast it first.")


def check_tree(
    x: Any,
    *,
    owner: str,
    what: str,
    treedef: jax.tree_util.PyTreeDef,
    leaves: Sequence[jax.ShapeDtypeStruct],
    leading: ShapePattern = (),
    sizes: dict[str, int] | None = None,
) -> list[Any]:
    """Checks a pytree's structure, and every leaf's shape and dtype exactly.

    Args:
      x: the pytree given.
      owner: names the object and operation.
      what: names the argument.
      treedef: the structure required.
      leaves: the shape and dtype required of each leaf, in flatten order.
      leading: a shape pattern each leaf must start with (e.g. ``("n",)`` for
        a batch of values), before the leaf's own shape.
      sizes: bindings of free sizes, as in :func:`check_array`.

    Returns:
      The leaves of ``x``, in flatten order.
    """
    x_leaves, x_treedef = jax.tree_util.tree_flatten(x)
    if x_treedef != treedef:
        raise PayloadTypeError(
            f"{owner}: {what} must have the pytree structure {treedef}; got {x_treedef}."
        )
    sizes = {} if sizes is None else sizes
    for i, (leaf, spec) in enumerate(zip(x_leaves, leaves)):
        check_array(
            leaf,
            owner=owner,
            what=f"{what} leaf {i}",
            shape=(*leading, *spec.shape),
            dtype=spec.dtype,
            sizes=sizes,
        )
    return x_leaves


def is_integer_scalar(value: Any) -> bool:
    """Whether ``value`` is an integer scalar: a Python, numpy or jax int, or a 0-d integer array (traced or not).

    A bool is not one (an index of True adds an axis), nor is anything that is not array-like (a str, None).
    """
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        return bool(np.issubdtype(jax.numpy.result_type(value), np.integer)) and np.ndim(value) == 0
    except TypeError:  # not array-like at all
        return False


def positive_int(owner: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """Returns ``value`` as an int, or raises naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PayloadTypeError(f"{owner}: {name} must be an int >= {minimum}; got {value!r}.")
    if value < minimum:
        raise PayloadError(f"{owner}: {name} must be >= {minimum}; got {value}.")
    return int(value)


def positive_ints(owner: str, **sizes: Any) -> dict[str, int]:
    """Every size given by name as an int >= 1 (:func:`positive_int`), in the order given."""
    return {name: positive_int(owner, name, value) for name, value in sizes.items()}


def source_names(owner: str, recompute_source: Any) -> tuple[str, ...]:
    """Normalises a recompute source (a name or names) to a tuple of names.

    Raises:
      PayloadTypeError: it is not a str or an iterable of them.
      PayloadError: a name is the empty string.
    """
    message = f"{owner}: recompute_source must be object names; got {recompute_source!r}."
    try:
        names = (recompute_source,) if isinstance(recompute_source, str) else tuple(recompute_source)
    except TypeError:  # not iterable
        raise PayloadTypeError(message) from None
    if not all(isinstance(name, str) for name in names):
        raise PayloadTypeError(message)
    if not all(names):
        raise PayloadError(message)
    return names


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x)


def leaf_specs(
    owner: str, shapes: Any, dtype: Any
) -> tuple[jax.tree_util.PyTreeDef, tuple[jax.ShapeDtypeStruct, ...]]:
    """The structure and leaf specs of a pytree spec.

    Args:
      owner: names the caller, for messages.
      shapes: a pytree whose leaves are shape tuples (of ``dtype``),
        :class:`jax.ShapeDtypeStruct` or arrays (their shape and dtype); a bare
        shape tuple is a single leaf.
      dtype: the dtype of leaves given as shape tuples.
    """
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=_is_shape)
    if not leaves:
        raise PayloadError(f"{owner}: the spec holds no arrays; got {shapes!r}.")
    specs = []
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            specs.append(jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype))
        elif _is_shape(leaf):
            specs.append(jax.ShapeDtypeStruct(tuple(int(d) for d in leaf), dtype))
        else:
            raise PayloadTypeError(f"{owner}: spec leaves must be shapes, ShapeDtypeStructs or arrays; got {leaf!r}.")
    return treedef, tuple(specs)


def axis_names(owner: str, what: str, names: Any, rank: int) -> tuple[str | None, ...]:
    """Normalises the logical axis names of one array (None: all unnamed).

    Raises:
      PayloadTypeError: ``names`` is not a sequence, or a name is neither a
        str nor None.
      PayloadError: it names another number of axes than ``rank``, or a name
        is the empty string.
    """
    if names is None:
        return (None,) * rank
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise PayloadTypeError(f"{owner}: {what} must be a tuple of axis names (str or None); got {names!r}.")
    names = tuple(names)
    message = f"{owner}: {what} must name each of the {rank} axes (a str, or None for unnamed); got {names!r}."
    if not all(n is None or isinstance(n, str) for n in names):
        raise PayloadTypeError(message)
    if len(names) != rank or not all(n is None or n for n in names):
        raise PayloadError(message)
    return names


def tree_axis_names(
    owner: str, what: str, names: Any, treedef: jax.tree_util.PyTreeDef, specs: Sequence[jax.ShapeDtypeStruct]
) -> tuple[tuple[str | None, ...], ...]:
    """Normalises per-leaf axis names given as a pytree like the spec (None: all unnamed)."""
    if names is None:
        per_leaf: list[Any] = [None] * len(specs)
    else:
        try:
            per_leaf = treedef.flatten_up_to(names)
        except (TypeError, ValueError) as error:
            raise PayloadTypeError(
                f"{owner}: {what} must have the structure of the spec {treedef}, with a tuple of axis "
                f"names per array; got {names!r} ({error})."
            ) from None
    return tuple(
        axis_names(owner, f"{what} of leaf {i}", leaf, len(spec.shape))
        for i, (leaf, spec) in enumerate(zip(per_leaf, specs))
    )


def optional_callable(owner: str, name: str, value: Any) -> Any:
    """``value`` when it is callable or None, else a TypeError naming the argument."""
    if value is not None and not callable(value):
        raise PayloadTypeError(f"{owner}: {name} must be a function or None; got {type(value).__name__}.")
    return value


def required(owner: str, name: str, value: Any) -> Any:
    """``value``, or a TypeError naming the missing keyword when it is None."""
    if value is None:
        raise PayloadTypeError(f"{owner}() missing required keyword argument: {name}=")
    return value


def is_number(value: Any) -> bool:
    """Whether ``value`` compares with 0 as a number (Python, numpy or 0-d jax scalar); duck-typed: no jax here."""
    try:
        bool(value >= 0)
    except (TypeError, ValueError):  # not comparable (a str, None), or not a scalar (an array of several)
        return False
    return True


def non_negative(owner: str, name: str, value: Any) -> Any:
    """``value`` when it is a number >= 0 (NaN is not), else raises naming the argument.

    Raises:
      PayloadTypeError: ``value`` is not a number.
      PayloadError: ``value`` is below 0, or NaN.
    """
    if not is_number(value):
        raise PayloadTypeError(f"{owner}: {name} must be a number >= 0; got {value!r}.")
    if not value >= 0:
        raise PayloadError(f"{owner}: {name} must be >= 0; got {value!r}.")
    return value
