"""Row writes that stay in place on XLA:CPU for bfloat16 and float8 buffers.

XLA:CPU computes bfloat16 and float8 arrays in float32: it rewrites every
op on them, a ``dynamic_update_slice`` or a scatter included, to convert the
whole operand to float32 and back: a donated append into a bfloat16 cache
costs what the whole cache holds (the append rows of BENCHMARKS.md), and the
contract (a write costs what it writes) breaks.  There, :func:`write_rows`
moves the rows' bytes with the native kernel's ``JssWriteRows``
(``csrc/write_rows.cc``), aliased to its buffer, so a donated write stays in
place; on GPU and TPU (``lax.platform_dependent``) and for every other dtype
the write is the caller's own XLA op.

Example:
  >>> import jax.numpy as jnp
  >>> from jax_session_state._core import _writes
  >>> buffer = jnp.zeros((2, 5, 3), jnp.bfloat16)  # [group, slot, tail]
  >>> rows = jnp.ones((2, 2, 3), jnp.bfloat16)
  >>> slots = jnp.array([[0, 5], [4, 1]])  # slot 5 is out of range: that row is dropped
  >>> out = _writes.scatter_rows(buffer, slots, rows, axis=1)
  >>> out.astype(jnp.float32).sum(axis=2).tolist()
  [[3.0, 0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0, 3.0]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from jax_session_state._core import _library

__all__ = ["converted_by_xla_cpu", "in_place_natively", "is_native_write", "scatter_rows", "write_rows"]


def converted_by_xla_cpu(dtype: jnp.dtype) -> bool:
    """Whether XLA:CPU computes ``dtype`` in float32 (bfloat16 and the 8-bit floats; float16 it keeps)."""
    if not jax.dtypes.issubdtype(dtype, jnp.floating):  # integers, bools, PRNG keys
        return False
    return jnp.dtype(dtype) != jnp.float16 and jnp.finfo(dtype).bits in (8, 16)


def in_place_natively(buffer: Array) -> bool:
    """Whether writes into ``buffer`` traced now take the native row writer on CPU.

    Its dtype is one XLA:CPU converts, and the native kernel is in use
    (:func:`jax_session_state._core._library.enabled`: built, not turned off, one
    CPU device, since the FFI call has no partitioning rule).
    """
    return converted_by_xla_cpu(buffer.dtype) and _library.enabled()


def scatter_rows(buffer: Array, slots: Array, rows: Array, *, axis: int, add: bool = False) -> Array:
    """``buffer`` with ``rows`` written (or, with ``add``, added) at ``slots`` along ``axis``, in XLA ops (a scatter).

    Args:
      buffer: ``[*lead, S, *tail]`` with ``len(lead) == axis``.
      slots: ``Int[Array, "*lead[:k] T"]`` for some ``k <= axis``: the slot of
        each row, shared by the trailing ``axis - k`` leading dims; a slot
        outside ``[0, S)`` drops its row.
      rows: ``[*lead, T, *tail]``, the buffer's dtype.
      axis: the slot axis.
      add: add the rows to what the slots hold instead.

    The leading dims of ``slots`` are vmapped (batching) dimensions of the
    scatter rather than indices, so on a mesh each device writes its own
    batch rows and heads with no communication (an index would make XLA
    gather the rows across the batch's devices first).

    Returns:
      The buffer with the rows written.
    """
    size = buffer.shape[axis]
    slots = jnp.where((slots < 0) | (slots >= size), size, slots)  # never wrapped: dropped
    shared = axis - (slots.ndim - 1)

    def write(b: Array, s: Array, r: Array) -> Array:
        at = b.at[(slice(None),) * shared + (s,)]
        return at.add(r, mode="drop") if add else at.set(r, mode="drop")

    for _ in range(slots.ndim - 1):
        write = jax.vmap(write)
    return write(buffer, slots, rows)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _native_rows(buffer: Array, slots: Array, rows: Array, axis: int) -> Array:
    return _library.write_rows(buffer, slots, rows, axis=axis)


@_native_rows.defjvp
def _native_rows_jvp(axis: int, primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    """The write is linear in the buffer and the rows: the written slots take the rows' tangents.

    They arrive by a scatter-add into zeros, which transposes for reverse
    mode where a scatter of repeated (dropped) slots would not; two rows in
    one slot add up there, where the write keeps the later.
    """
    buffer, slots, rows = primals
    buffer_dot, _, rows_dot = tangents
    written = scatter_rows(jnp.zeros(buffer.shape, bool), slots, jnp.ones(rows.shape, bool), axis=axis)
    rows_in = scatter_rows(jnp.zeros_like(buffer_dot), slots, rows_dot, axis=axis, add=True)
    return _native_rows(buffer, slots, rows, axis), jnp.where(written, 0, buffer_dot) + rows_in


def is_native_write(eqn: Any) -> bool:
    """Whether a jaxpr equation is the native write ``(buffer, slots, rows) -> buffer`` of :func:`write_rows`.

    For transformations that mask writes (a pool's step): pushing the
    equation's slots operand out of range makes it write nothing.
    """
    if eqn.primitive.name != "custom_jvp_call":
        return False
    inner = eqn.params["call_jaxpr"].jaxpr.eqns
    return len(inner) == 1 and inner[0].params.get("target_name") == _library.WRITE_TARGET


def write_rows(buffer: Array, slots: Array, rows: Array, *, axis: int,
               otherwise: Callable[[], Array] | None = None) -> Array:
    """``buffer`` with ``rows`` at ``slots`` (as :func:`scatter_rows`): in place on CPU where XLA would convert it.

    Where :func:`in_place_natively` holds, the CPU lowering calls the native
    row writer and every other platform's runs ``otherwise()``, the caller's
    own XLA write of the same rows (default: :func:`scatter_rows`);
    elsewhere it is ``otherwise()``.
    """
    if otherwise is None:
        otherwise = functools.partial(scatter_rows, buffer, slots, rows, axis=axis)
    if not in_place_natively(buffer):
        return otherwise()
    return lax.platform_dependent(cpu=lambda: _native_rows(buffer, slots, rows, axis), default=otherwise)
