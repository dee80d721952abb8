"""Batch shapes: the leading axes of a kind's payloads and views, stored as one flattened axis.

A kind sized by ``batch=B`` or ``batch=(B, P)`` (an axial model's batch of
spatial positions) stores ``B * P`` rows along one axis, so every reader and
writer of one batch axis takes it as it is: a reshape of contiguous leading
axes is free in XLA.  Payloads and queries come as ``[*batch, T, ...]`` and
are flattened; a write of some rows only names them by their flat index
(``rows``), with a payload of ``[*rows.shape, T, ...]``.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array

from jax_session_state._core import _validation as v
from jax_session_state.building_blocks import refuse_now_if
from jax_session_state.errors import PayloadError, PayloadTypeError

BatchShape = int | tuple[int, ...]
"""What ``allocate(batch=...)`` takes: one size, or a tuple of sizes (leading axes, major first)."""


def checked(owner: str, name: str, batch: Any) -> BatchShape:
    """``batch`` as an int or a non-empty tuple of ints >= 1, or raises naming ``owner`` and ``name``."""
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise PayloadError(f"{owner}: {name} must be an int or a non-empty tuple of ints >= 1; got {batch!r}.")
        return tuple(v.positive_int(owner, f"{name}[{i}]", size) for i, size in enumerate(batch))
    return v.positive_int(owner, name, batch)


def shape_of(batch: BatchShape) -> tuple[int, ...]:
    """The leading axes of ``batch``: ``(B,)`` for ``B``, the tuple itself otherwise."""
    return (batch,) if isinstance(batch, int) else tuple(batch)


def size_of(batch: BatchShape) -> int:
    """Rows of storage ``batch`` takes: the product of its axes."""
    return math.prod(shape_of(batch))


def logical_name(name: str, batch: BatchShape) -> str | tuple[str, ...]:
    """The logical name(s) of the flattened batch axis: ``name`` for one axis, else one name per axis.

    The first axis keeps ``name``; axis ``i > 0`` is ``f"{name}_{i}"``
    (``("batch", "batch_1")`` for ``batch=(B, P)``), so sharding rules place
    each on its own mesh axes (:meth:`~jax_session_state.ShardingRules.partition_spec`
    shards the flattened axis over them, major first).
    """
    if isinstance(batch, int):
        return name
    return tuple(name if i == 0 else f"{name}_{i}" for i in range(len(batch)))


def flat_rows(owner: str, rows: Any, size: int) -> tuple[Array, tuple[int, ...], Array]:
    """Checks a row-subset index and flattens it.

    Args:
      owner: names the object and operation in messages.
      rows: ``Int[Array, "*n"]`` flat indices into the ``size`` rows of
        storage (``jnp.ravel_multi_index`` gives them from per-axis indices).
      size: rows of storage.

    Returns:
      ``(index, shape, bad)``: the indices flattened and clipped to range,
      ``rows``' shape (the leading shape of the payload), and whether an
      index is out of range or repeated; eagerly that raises at once, under
      ``jit`` the caller refuses the write.

    Raises:
      PayloadTypeError: ``rows`` is not an integer array.
      PayloadError: an index is out of range or named twice (eagerly).
    """
    if not hasattr(rows, "shape") or not jnp.issubdtype(getattr(rows, "dtype", None), jnp.integer):
        raise PayloadTypeError(
            f"{owner}: rows must be an integer array of flat batch-row indices in [0, {size}) "
            f"(jnp.ravel_multi_index turns per-axis indices into them); got {type(rows).__name__}"
            f"{'' if not hasattr(rows, 'dtype') else ' of dtype ' + v.dtype_name(rows.dtype)}."
        )
    index = jnp.reshape(rows, (-1,)).astype(jnp.int32)
    out_of_range = jnp.any((index < 0) | (index >= size))
    ordered = jnp.sort(index)
    repeated = jnp.any(ordered[1:] == ordered[:-1]) if index.size > 1 else jnp.zeros((), bool)
    refuse_now_if(
        out_of_range | repeated,
        lambda: PayloadError(
            f"{owner}: rows must be distinct flat batch-row indices in [0, {size}); got "
            f"{np.asarray(rows).tolist()}. Nothing was written."
        ),
    )
    return jnp.clip(index, 0, size - 1), tuple(rows.shape), out_of_range | repeated
