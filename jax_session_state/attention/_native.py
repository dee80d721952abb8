"""The native CPU kernel of decode attention, bound for ``attend``: which steps it takes, and its calls.

The kernel (``csrc/decode_attention.cc``) is loaded and registered by
:mod:`jax_session_state._core._library`, once per process; this module says
which operands it reads (:func:`supports`, :data:`DECLINED_ROWS`) and calls
it through the XLA FFI over a head-major cache (:func:`kernel`,
:func:`quantized_kernel`), a ring (:func:`ring_kernel`) or a paged pool
(:func:`paged_kernel`), with the
batching rules that fold speculative lanes into query rows.

Example:
  >>> from jax_session_state.attention import _native
  >>> import jax.numpy as jnp
  >>> q = k = v = jnp.zeros((1, 1, 2, 8))  # [batch, T, heads, dim]; k, v [batch, kv_heads, capacity, dim]
  >>> isinstance(_native.supports(q, k, v), bool)
  True
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jax_session_state._core._library import (
    ISA,
    ISAS,
    PAGED_TARGET,
    QUANTIZED_PAGED_TARGET,
    QUANTIZED_RING_TARGET,
    QUANTIZED_TARGET,
    RING_TARGET,
    TARGET,
)
from jax_session_state.errors import PayloadError

__all__ = ["DECLINED_ROWS", "DTYPES", "QUANTIZED_DTYPES", "kernel", "paged_kernel", "quantized_kernel", "ring_kernel",
           "supports"]

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
"""The stored values of a quantized cache the kernel reads (with its float32 row scales)."""

Kernel = Callable[[Array, Array, Array, Array, Array], tuple[Array, Array]]


def _cores() -> int:
    """The CPUs this process may run on; XLA's intra-op thread pool has as many threads."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity mask on this platform
        return os.cpu_count() or 1


DECLINED_ROWS = ({"baseline": 6} if _cores() > 1 else
                 {"baseline": 4, **({"avx2": 16} if ISAS.get("avx512") else {})})
"""Per ISA path, the query rows per kv head (``T * q_heads / kv_heads``) from
which it is slower than the pure loop over a float32 cache and declines
(measured: benchmarks/attention.py, 8 kv heads x 64, valid 1k and 4k).
Many rows make a step bound by its FMAs, and XLA's dots in the pure loop use
the widest vectors the CPU has, on one thread; the kernel splits a large
step's keys over XLA's thread pool.  With two cores or more the ``avx2``
path beats the loop at any row count, even on an AVX-512 CPU (16 rows: 0.6
of its time, 64 rows: 0.75), and SSE2 up to 4 rows (0.6), not from 6
(0.92-1.04) or 8 (1.03-1.15).  On one core SSE2 falls behind from 4 rows,
and ``avx2`` from 16 where the CPU has AVX-512 (1.10-1.15: its FMAs are half
as wide).  A 16-bit or quantized cache always takes the kernel: the pure
loop reads those several times slower."""


def supports(q: Array, k: Array, v: Array, *, kv_heads: int | None = None, quantized: bool = False) -> bool:
    """Whether the kernel takes these operands on the path in use.

    A float32, bfloat16 or float16 cache (one type for K and V), or with
    ``quantized`` an int8 or ``float8_e4m3fn`` one (:data:`QUANTIZED_DTYPES`),
    queries of any float type (cast to float32 for the call), and a step the
    path runs faster than the pure loop (see :data:`DECLINED_ROWS`).
    ``kv_heads``: where ``k`` is not head-major ``[B, kv_heads, C, D]`` (pages).
    """
    rows = q.shape[1] * (q.shape[2] // max(k.shape[1] if kv_heads is None else kv_heads, 1))
    fast = k.dtype != jnp.float32 or rows < DECLINED_ROWS.get(ISA or "", rows + 1)
    dtypes = QUANTIZED_DTYPES if quantized else DTYPES
    return k.dtype == v.dtype and any(k.dtype == d for d in dtypes) and jnp.issubdtype(q.dtype, jnp.floating) and fast


def _call(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
          scale: float, relative: bool) -> tuple[Array, Array]:
    result = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    call = jax.ffi.ffi_call(TARGET, result)
    out, lse = call(q.astype(jnp.float32), k, v, lengths.astype(jnp.int32), q_positions.astype(jnp.int32),
                    scale=np.float32(scale), causal=bool(causal), relative=bool(relative))
    return out.astype(q.dtype), lse


def paged_kernel(k_pages: Array, v_pages: Array, page_table: Array, q: Array, lengths: Array, q_positions: Array, *,
                 causal: bool, scale: float, relative: bool, k_scale_pages: Array | None = None,
                 v_scale_pages: Array | None = None) -> tuple[Array, Array]:
    """The native kernel over token-major pages ``[num_pages, page_size, kv_heads, head_dim]``, read in place.

    Quantized pages (int8 or ``float8_e4m3fn``) come with their row scales
    as pages ``Float32[Array, "num_pages page_size kv_heads 1"]`` (the
    trailing 1 optional), ``k_scale_pages`` and ``v_scale_pages``.

    Returns ``(out, lse)`` as :func:`kernel`: ``out`` in q's dtype, ``lse`` float32.
    """
    result = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    scales = _scales(k_scale_pages, v_scale_pages)
    call = jax.ffi.ffi_call(QUANTIZED_PAGED_TARGET if scales else PAGED_TARGET, result, vmap_method="sequential")
    out, lse = call(q.astype(jnp.float32), k_pages, v_pages, *scales, page_table.astype(jnp.int32),
                    lengths.astype(jnp.int32), q_positions.astype(jnp.int32), scale=np.float32(scale),
                    causal=bool(causal), relative=bool(relative))
    return out.astype(q.dtype), lse


def quantized_kernel(q: Array, k: Array, v: Array, k_scale: Array, v_scale: Array, lengths: Array,
                     q_positions: Array, *, causal: bool, scale: float, relative: bool) -> tuple[Array, Array]:
    """The native kernel over a quantized head-major cache, read in place.

    ``k``, ``v``: int8 or ``float8_e4m3fn`` ``[B, kv_heads, C, D]``;
    ``k_scale``, ``v_scale``: ``Float32[Array, "B kv_heads C 1"]``, applied
    to the scores and to the weights of the values inside the kernel.
    Positions as in :func:`kernel` (offsets from each row's length with
    ``relative``).  Under ``jax.vmap`` it runs once per lane.

    Returns ``(out, lse)`` as :func:`kernel`.
    """
    result = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    call = jax.ffi.ffi_call(QUANTIZED_TARGET, result, vmap_method="sequential")
    out, lse = call(q.astype(jnp.float32), k, v, *_scales(k_scale, v_scale), lengths.astype(jnp.int32),
                    q_positions.astype(jnp.int32), scale=np.float32(scale), causal=bool(causal),
                    relative=bool(relative))
    return out.astype(q.dtype), lse


def ring_kernel(q: Array, k: Array, v: Array, k_scale: Array | None, v_scale: Array | None, window_start: Array,
                lengths: Array, q_positions: Array, *, causal: bool, scale: float, relative: bool, sink: int,
                window: int) -> tuple[Array, Array]:
    """The native kernel over a ring's storage ``[B, kv_heads, slots, D]``, read by position where it lies.

    Position ``p < sink`` lies in slot ``p``, a later one in slot
    ``sink + (p - sink) % (slots - sink)``; row ``b`` shows the sinks below
    ``lengths[b]`` and the window ``window_start[b] .. lengths[b] - 1`` (a
    run of slots that may wrap).  A query at ``qp`` sees ``p`` when
    ``p <= qp`` (if ``causal``) and ``p < sink or qp - p < window``;
    positions as in :func:`kernel`.  A quantized ring (int8 or
    ``float8_e4m3fn``) comes with its row scales ``[B, kv_heads, slots, 1]``.

    Under ``jax.vmap`` over lanes sharing one ring (no ring operand batched)
    the lanes are more query rows of one call; over rings each their own
    (every ring operand batched) they fold into the batch; anything else is
    read lane by lane.

    Returns ``(out, lse)`` as :func:`kernel`.
    """
    scales = _scales(k_scale, v_scale)

    def one_call(q, ring, q_positions):
        result = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
        call = jax.ffi.ffi_call(QUANTIZED_RING_TARGET if scales else RING_TARGET, result, vmap_method="sequential")
        out, lse = call(q.astype(jnp.float32), *ring, q_positions.astype(jnp.int32), scale=np.float32(scale),
                        causal=bool(causal), relative=bool(relative), sink=np.int64(sink), window=np.int64(window))
        return out.astype(q.dtype), lse

    native = jax.custom_batching.custom_vmap(one_call)

    @native.def_vmap
    def native_vmap(lanes, batched, q, ring, q_positions):
        q_batched, ring_batched, positions_batched = batched
        q = q if q_batched else jnp.broadcast_to(q, (lanes, *q.shape))
        q_positions = q_positions if positions_batched else jnp.broadcast_to(q_positions, (lanes, *q_positions.shape))
        _, batch, T = q.shape[:3]
        if not any(ring_batched):  # one shared ring: every lane's queries are more query rows of each batch row
            rows = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, lanes * T, *x.shape[3:])  # noqa: E731
            out, lse = native(rows(q), ring, rows(q_positions))
            lanes_back = lambda x: jnp.moveaxis(x.reshape(batch, lanes, T, *x.shape[2:]), 1, 0)  # noqa: E731
            return (lanes_back(out), lanes_back(lse)), (True, True)
        if all(ring_batched):  # lanes x batch rows, each its own ring
            fold = lambda x: x.reshape(lanes * x.shape[1], *x.shape[2:])  # noqa: E731
            out, lse = native(fold(q), tuple(fold(x) for x in ring), fold(q_positions))
            return (out.reshape(q.shape), lse.reshape(q.shape[:4])), (True, True)
        axes = tuple(0 if b else None for b in ring_batched)
        return jax.vmap(one_call, in_axes=(0, axes, 0))(q, ring, q_positions), (True, True)

    return native(q, (k, v, *scales, window_start.astype(jnp.int32), lengths.astype(jnp.int32)), q_positions)


def _scales(k_scale: Array | None, v_scale: Array | None) -> tuple[Array, ...]:
    """Both row scales as float32, or none (an unquantized cache)."""
    if (k_scale is None) != (v_scale is None):
        raise PayloadError("the native kernel reads a quantized cache with both k_scale and v_scale, or neither.")
    return () if k_scale is None else (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))


def kernel(causal: bool, scale: float, relative: bool, fallback: Kernel) -> Kernel:
    """The native kernel ``(q, k, v, lengths, q_positions) -> (out, lse)``, with its batching rule.

    With ``relative`` the query positions are offsets from each row's length
    (``-T..-1`` for the last ``T`` positions, a constant), so a step need not
    compute them; ``fallback`` takes them the same way.

    Under ``jax.vmap`` over speculative lanes that share one cache (k, v and
    lengths not batched), the lanes are folded into the query rows, so the
    cache is read once for all lanes; when k, v and lengths are all batched
    the lanes are folded into the batch (reshapes, no copies).  Anything else
    runs ``fallback`` (the pure-JAX kernel) under ``vmap``.
    """

    @jax.custom_batching.custom_vmap
    def native(q, k, v, lengths, q_positions):
        return _call(q, k, v, lengths, q_positions, causal=causal, scale=scale, relative=relative)

    @native.def_vmap
    def native_vmap(lanes, batched, q, k, v, lengths, q_positions):
        q_batched, k_batched, v_batched, lengths_batched, positions_batched = batched
        if not (k_batched and v_batched and lengths_batched) and (k_batched or v_batched or lengths_batched):
            axes = [0 if b else None for b in batched]
            return jax.vmap(fallback, in_axes=axes)(q, k, v, lengths, q_positions), (True, True)
        q = q if q_batched else jnp.broadcast_to(q, (lanes, *q.shape))
        q_positions = q_positions if positions_batched else jnp.broadcast_to(q_positions, (lanes, *q_positions.shape))
        _, batch, T, heads, dim = q.shape
        if k_batched:  # lanes x batch rows, each its own cache
            out, lse = native(q.reshape(lanes * batch, T, heads, dim), k.reshape(lanes * batch, *k.shape[2:]),
                              v.reshape(lanes * batch, *v.shape[2:]), lengths.reshape(lanes * batch),
                              q_positions.reshape(lanes * batch, T))
            return (out.reshape(q.shape), lse.reshape(q.shape[:4])), (True, True)
        # One shared cache: every lane's queries are more query rows of each batch row.
        rows = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, lanes * T, *x.shape[3:])  # noqa: E731
        out, lse = native(rows(q), k, v, lengths, rows(q_positions))
        lanes_back = lambda x: jnp.moveaxis(x.reshape(batch, lanes, T, *x.shape[2:]), 1, 0)  # noqa: E731
        return (lanes_back(out), lanes_back(lse)), (True, True)

    return native
