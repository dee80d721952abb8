"""The pieces of blockwise attention that every reader shares, and the dispatch between readers.

Queries are grouped per kv head as rows ``[B, kv_heads, T*G, D]`` (rows
ordered (t, g)); an online-softmax state ``(top, total, acc)`` is updated
block by block and normalised at the end (:func:`_finish`).  The paged readers are in
``_paged``, the bucketed pass in ``_bucketed``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jax_session_state.attention import _pallas as _attention_pallas, _pallas_tpu
from jax_session_state.attention._pallas import _SIXTEEN_BIT
from jax_session_state.errors import PayloadError
from jax_session_state.objects.paged import PagedView

BLOCK_SIZE = 64
"""Keys per block in append mode (chosen by measurement on XLA:CPU)."""

QUANTIZED_BLOCK_SIZE = 1024
"""Keys per block of an int8 / fp8 cache in append mode (chosen by measurement on XLA:CPU)."""

_F32 = jnp.float32

Rows = tuple[Array, int] | None
"""``(first, count)``: a block read takes only batch rows ``[first, first + count)`` (None: every row)."""


def _to_rows(x: Array, kv_heads: int) -> Array:
    """``[B, T, q_heads, ...]`` -> float32 ``[B, kv_heads, T*G, ...]``, rows ordered (t, g).

    Only per-query arrays (small) are transposed, never the cache.
    """
    B, T, q_heads = x.shape[:3]
    groups = q_heads // kv_heads
    rows = x.astype(_F32).reshape(B, T, kv_heads, groups, *x.shape[3:])
    return jnp.moveaxis(rows, 2, 1).reshape(B, kv_heads, T * groups, *x.shape[3:])


def _from_rows(x: Array, T: int) -> Array:
    """The inverse of :func:`_to_rows` (float32 kept)."""
    B, kv_heads, M = x.shape[:3]
    rows = x.reshape(B, kv_heads, T, M // T, *x.shape[3:])
    return jnp.moveaxis(rows, 1, 2).reshape(B, T, kv_heads * (M // T), *x.shape[3:])


def _finish(q: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array]:
    """Normalises the online-softmax state into ``(out, lse)`` in q's layout."""
    top, total, acc = state
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(seen, top + jnp.log(safe), -jnp.inf)
    T = q.shape[1]
    return _from_rows(out, T).astype(q.dtype), _from_rows(lse, T)


def _empty_state(qh: Array) -> tuple[Array, Array, Array]:
    return jnp.full(qh.shape[:3], -jnp.inf, _F32), jnp.zeros(qh.shape[:3], _F32), jnp.zeros(qh.shape, _F32)


def _online_update(state: Any, scores: Array, visible: Array, values: Array,
                   value_scale: Array | None = None) -> tuple[Array, Array, Array]:
    """One online-softmax step over a block of ``[B, Hk, M, n]`` scores.

    ``value_scale``: ``[B, Hk, 1, n]`` the row scales of quantized ``values``,
    applied to the weights (``M`` per key) rather than to the values
    (``head_dim`` per key).
    """
    top, total, acc = state
    scores = jnp.where(visible, scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(-1))
    # Rows that have seen nothing keep top = -inf; subtract 0 there (exp(-inf) = 0, not NaN).
    safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)
    weights = jnp.exp(scores - safe_top[..., None])
    decay = jnp.exp(top - safe_top)
    scaled = weights if value_scale is None else weights * value_scale
    return new_top, decay * total + weights.sum(-1), decay[..., None] * acc + _weighted_sum(scaled, values)


def _weighted_sum(weights: Array, values: Array) -> Array:
    """``weights @ values`` in float32: ``[B, Hk, M, n] x [B, Hk, n, D] -> [B, Hk, M, D]``.

    16-bit float ``values`` (a bucket of a bfloat16 or float16 cache) are
    read as they are stored, never widened into a float32 copy: the float32
    ``weights`` (softmax weights, at most 1) go in as two parts of the
    values' dtype, the nearest one and the rest, stacked on the rows' axis,
    so one dot reads the values once, its products are exact and summed in
    float32, and the two halves' sum carries each weight to 2^-17 of itself
    (bfloat16; float16: 2^-22).
    """
    if values.dtype not in _SIXTEEN_BIT:
        return jnp.einsum("bhmn,bhnd->bhmd", weights, values, preferred_element_type=_F32)
    high = weights.astype(values.dtype)
    low = (weights - high.astype(_F32)).astype(values.dtype)
    both = jnp.einsum("bhmn,bhnd->bhmd", jnp.concatenate([high, low], axis=2), values, preferred_element_type=_F32)
    rows = weights.shape[2]
    return both[:, :, :rows] + both[:, :, rows:]


def _scores(keys: Array, qh: Array) -> Array:
    return jnp.einsum("bhmd,bhnd->bhmn", qh, keys, preferred_element_type=_F32)


def _last_visible(lengths: Array, q_positions: Array, causal: bool, groups: int) -> Array:
    """The last key each query row sees, ``[B, 1, T*G, 1]`` (rows ordered (t, g))."""
    last = jnp.broadcast_to(lengths[:, None] - 1, q_positions.shape)
    if causal:
        last = jnp.minimum(last, q_positions)
    return jnp.repeat(last, groups, axis=1)[:, None, :, None]


def _block_count(lengths: Array, capacity: int, n: int) -> Array:
    # The trip count depends on lengths only (not on queries), so under vmap over
    # lanes sharing one prefix the loop, and every block read, stays unbatched.
    return jnp.max(_row_blocks(lengths, capacity, n))


def _row_blocks(lengths: Array, capacity: int, n: int) -> Array:
    """The blocks of ``n`` slots each row reads: its valid length (at most the capacity), rounded up."""
    return (jnp.clip(lengths, 0, capacity) + n - 1) // n


def _block(cache: Array, i: Array, n: int) -> tuple[Array, Array, Array]:
    """Block ``i`` of ``n`` keys: its start, key positions and first new position.

    The last block is shifted back to stay inside the cache; the keys it
    repeats are masked by ``position >= first``.
    """
    first = i * n
    start = jnp.minimum(first, cache.shape[2] - n)
    return start, start + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3), first


def _key_slice(cache: Array, start: Array, n: int, rows: Rows) -> Array:
    """Slots ``[start, start + n)`` of a head-major ``[B, kv_heads, C, ...]`` array, of every row or of ``rows``."""
    if rows is None:
        return lax.dynamic_slice_in_dim(cache, start, n, axis=2)
    first, count = rows
    return lax.dynamic_slice(cache, (first, 0, start, 0), (count, cache.shape[1], n, cache.shape[3]))


def _block_f32(cache: Array, start: Array, n: int, rows: Rows = None) -> Array:
    """Keys ``[start, start + n)`` of a head-major cache as float32 (of ``rows`` only, where given).

    A 16-bit cache is sliced as 16-bit integers: XLA:CPU widens bfloat16 and
    float16 operations to float32, and would widen the whole capacity on
    every call to slice a block of it (BENCHMARKS.md, the attention rows).
    """
    if cache.dtype.itemsize != 2:  # float32 as it is; int8 and fp8 values widened block by block
        return _key_slice(cache, start, n, rows).astype(_F32)
    bits = lax.bitcast_convert_type(cache, jnp.uint16)
    return lax.bitcast_convert_type(_key_slice(bits, start, n, rows), cache.dtype).astype(_F32)


def _block_scales(scale: Array, start: Array, n: int, rows: Rows = None) -> Array:
    """The row scales of keys ``[start, start + n)`` of a quantized cache, laid out as scores: ``[B, Hk, 1, n]``."""
    return jnp.swapaxes(_key_slice(scale, start, n, rows), 2, 3)


def _append_block(k: Array, k_scale: Array | None) -> int:
    return min(BLOCK_SIZE if k_scale is None else QUANTIZED_BLOCK_SIZE, k.shape[2])


def _cache_blocks(cache: dict[str, Array], *, n: int) -> Array:
    """The blocks each row of a head-major cache reads (slot ``j`` holds a position ``>= j``)."""
    return _row_blocks(cache["lengths"], cache["k"].shape[2], n)


def _read_blocks(q: Array, q_positions: Array, cache: dict[str, Array], row: Array | None, *, causal: bool,
                 scale: float, n: int, window: int | None = None, sink: int = 0) -> tuple[Array, Array]:
    """Blocks of ``n`` slots of a head-major cache up to the longest row, online softmax.

    ``cache``: ``k``, ``v``, ``lengths``, and ``k_scale`` / ``v_scale``
    where quantized; with ``positions`` (a ring, ``[B, C]``, -1 where not
    shown) a slot's key position is read there and ``window`` / ``sink``
    apply, else slot ``j`` holds position ``j``.  With ``row`` only the
    ``q.shape[0]`` cache rows from ``row`` on are read (one slot of a pool).
    The caller has checked the shapes; ``scale`` is the score scale.
    """
    rows = None if row is None else (row, q.shape[0])
    cut = (lambda x: x) if row is None else (lambda x: lax.dynamic_slice_in_dim(x, row, q.shape[0], axis=0))
    k, v, lengths = cache["k"], cache["v"], cut(cache["lengths"])
    k_scale, v_scale = cache.get("k_scale"), cache.get("v_scale")
    key_positions = cache.get("positions")
    groups = q.shape[2] // k.shape[1]
    qh = _to_rows(q, k.shape[1])
    last = _last_visible(lengths, q_positions, causal, groups)
    if key_positions is not None:
        key_positions = cut(key_positions)
        query_position = jnp.repeat(q_positions, groups, axis=1)[:, None, :, None]  # [B, 1, M, 1]
    one = lax.optimization_barrier(jnp.ones((), _F32))  # fuses V's copy into a vectorised multiply (NOTES.md)

    def body(i: Array, state: Any) -> Any:
        start, slot, first = _block(k, i, n)
        keys = _block_f32(k, start, n, rows) * scale
        values = _block_f32(v, start, n, rows) * one
        if key_positions is None:
            visible = (slot >= first) & (slot <= last)
        else:
            key_position = lax.dynamic_slice_in_dim(key_positions, start, n, axis=1)[:, None, None, :]
            visible = (slot >= first) & (key_position >= 0) & (key_position <= last)
            if window is not None:
                visible &= (key_position < sink) | (query_position - key_position < window)
        scores = _scores(keys, qh)
        if k_scale is None:
            return _online_update(state, scores, visible, values)
        # Row scales multiply the [M, n] scores and weights, not the [n, head_dim] blocks.
        scores = scores * _block_scales(k_scale, start, n, rows)
        return _online_update(state, scores, visible, values, _block_scales(v_scale, start, n, rows))

    return _finish(q, lax.fori_loop(0, _block_count(lengths, k.shape[2], n), body, _empty_state(qh)))


def _relative_offsets(q: Array) -> Array:
    """The last T positions as offsets from each row's length: a constant (the kernel adds the lengths)."""
    B, T = q.shape[:2]
    return jnp.asarray(np.broadcast_to(np.arange(-T, 0, dtype=np.int32), (B, T)))


def _absolute(lengths: Array, q_positions: Array, relative: bool) -> Array:
    """Query positions, given as they are or (``relative``) as offsets from each row's length."""
    return lengths[:, None] + q_positions if relative else q_positions


def _by_platform(implementation: str, loop: Any, bucketed: Any, *operands: Any, native: Any = None,
                 pallas: Any = None) -> tuple[Array, Array]:
    """``"loop"`` and ``"bucketed"`` run everywhere; ``"pallas"`` runs ``pallas(*operands, interpret=...)`` where
    given (compiled on GPU, interpreted on CPU, on TPU with ``interpret=_pallas_tpu.TPU``: the Mosaic kernel;
    else ``bucketed``); otherwise (``"auto"``,
    ``"native"``) ``native`` where given (else ``loop``) runs on CPU, ``pallas`` compiled where given on CUDA
    (see :func:`_pallas_wanted`), and ``bucketed`` (a handful of fused kernels) elsewhere."""
    if implementation in ("loop", "bucketed"):
        return (loop if implementation == "loop" else bucketed)(*operands)
    branches = {"cpu": loop if native is None else native}
    if pallas is not None:
        compiled = functools.partial(pallas, interpret=False)
        branches["cuda"] = compiled
        if implementation == "pallas":
            branches.update(cpu=functools.partial(pallas, interpret=True), rocm=compiled,
                            tpu=functools.partial(_tpu_or_bucketed, pallas, bucketed))
    elif implementation == "pallas":
        return bucketed(*operands)
    return lax.platform_dependent(*operands, default=bucketed, **branches)


def _pallas_wanted(implementation: str, k: Array, extent: int) -> bool:
    """Whether ``implementation`` reads a cache of ``k``'s keys in runs of ``extent`` through the Pallas kernel:
    ``"pallas"`` asked for, or ``"auto"`` (and ``"native"``, off CPU) where a CUDA GPU is attached (measured
    faster than buckets there, see BENCHMARKS.md), and a cache it reads (``_attention_pallas.takes``).
    Otherwise buckets off CPU."""
    wanted = implementation == "pallas" or (implementation in ("auto", "native") and _attention_pallas.gpu_attached())
    return wanted and _attention_pallas.takes(k, extent)



def _backward_rows(q: Array, kv_heads: int, d_out: Array, d_lse: Array, out: Array, lse: Array) -> tuple[Array, ...]:
    """What every flash backward starts from, in rows ``[B, kv_heads, T*G, ...]``: q, dO, lse and delta.

    ``lse`` is ``+inf`` where a query saw nothing (so ``P = 0`` there);
    ``delta = rowsum(dO * O) - dlse``, both ``[..., 1]``.
    """
    qh, d_rows = _to_rows(q, kv_heads), _to_rows(d_out, kv_heads)
    lse_rows = _to_rows(lse, kv_heads)
    lse_rows = jnp.where(jnp.isneginf(lse_rows), jnp.inf, lse_rows)[..., None]
    delta = (jnp.sum(d_rows * _to_rows(out, kv_heads), -1) - _to_rows(d_lse, kv_heads))[..., None]
    return qh, d_rows, lse_rows, delta



def _flash_block_grads(grads: tuple[Array, Array, Array], keys: Array, values: Array, visible: Array, qh: Array,
                       rows: tuple[Array, Array, Array], scale: float, add: Any) -> tuple[Array, Array, Array]:
    """One key block's step of a flash backward: ``P`` and ``dS`` of the block, ``dQ`` summed, and ``dK``,
    ``dV`` added into their gradients by ``add(grad, block)`` (where the block's keys lie).

    ``rows`` is ``(dO, lse, delta)`` from :func:`_backward_rows`.
    """
    dq, dk, dv = grads
    d_rows, lse_rows, delta = rows
    p = jnp.where(visible, jnp.exp(_scores(keys, qh) * scale - lse_rows), 0.0)
    ds = p * (jnp.einsum("bhmd,bhnd->bhmn", d_rows, values) - delta) * scale
    return (dq + jnp.einsum("bhmn,bhnd->bhmd", ds, keys), add(dk, jnp.einsum("bhmn,bhmd->bhnd", ds, qh)),
            add(dv, jnp.einsum("bhmn,bhmd->bhnd", p, d_rows)))


def _flash_loop(q: Array, qh: Array, k: Array, v: Array, blocks: Array, body: Any) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)``: ``body(i, grads)`` over ``blocks`` key blocks from zeros, cast to the operands' dtypes."""
    zeros = (jnp.zeros_like(qh), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dq, dk, dv = lax.fori_loop(0, blocks, body, zeros)
    return _from_rows(dq, q.shape[1]).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _last_rows(q: Array, lengths: Array, q_positions: Array, causal: bool, kv_heads: int, keys: int) -> Array:
    """:func:`_last_visible` as ``Int[Array, "B T*G"]``, of a cache holding ``keys`` keys (the Pallas kernel's
    input)."""
    return _last_visible(jnp.minimum(lengths, keys), q_positions, causal, q.shape[2] // kv_heads)[:, 0, :, 0]


def _tpu_or_bucketed(pallas: Any, bucketed: Any, *operands: Any) -> tuple[Array, Array]:
    """On TPU: ``pallas`` with the Mosaic kernel (``_pallas_tpu``), or ``bucketed`` where its tiling does not take
    the cache (the reader raises :class:`_pallas_tpu.Untileable` before tracing anything)."""
    try:
        return pallas(*operands, interpret=_pallas_tpu.TPU)
    except _pallas_tpu.Untileable:
        return bucketed(*operands)


def _tpu_kernel(interpret: Any) -> bool:
    """Whether a Pallas reader given ``interpret`` runs the TPU kernel (``_pallas_tpu``): compiled on TPU, or
    interpreted on CPU where the tests ask for it (``_pallas_tpu.ON_CPU``)."""
    return interpret is _pallas_tpu.TPU or (interpret is True and _pallas_tpu.ON_CPU)


def _pallas_append(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool, scale: float,
                   interpret: Any, k_scale: Array | None = None, v_scale: Array | None = None
                   ) -> tuple[Array, Array]:
    """A head-major cache ``[B, kv_heads, C, D]`` (and a quantized one's row scales) read by the Pallas split-K
    kernel (``_pallas``; compiled for GPU, or ``interpret``-ed) or on TPU by ``_pallas_tpu``'s (raising
    ``Untileable`` where its tiling does not take the cache: :func:`_tpu_or_bucketed` reads buckets then)."""
    kv_heads, capacity = k.shape[1], k.shape[2]
    reader = _attention_pallas
    if _tpu_kernel(interpret):
        block = _pallas_tpu.append_block(k)
        if block is None or (interpret is _pallas_tpu.TPU and not _pallas_tpu.fits_tpu(k, block)):
            raise _pallas_tpu.Untileable(f"keys of {k.dtype} [.., {capacity}, {k.shape[-1]}]")
        reader = _pallas_tpu
    last = _last_rows(q, lengths, q_positions, causal, kv_heads, capacity)
    state = reader.append_state(_to_rows(q, kv_heads), q.dtype, last, k, v, scale=scale,
                                interpret=interpret, k_scale=k_scale, v_scale=v_scale)
    return _finish(q, state)


def _pallas_paged(q: Array, view: PagedView, q_positions: Array, *, causal: bool, scale: float,
                  interpret: Any) -> tuple[Array, Array]:
    """A paged view (float, or quantized with its scale pages) read through its page table by the Pallas
    split-K kernel, or on TPU by ``_pallas_tpu``'s (raising ``Untileable`` where its tiling does not take the
    pages)."""
    kv_heads = view.k_pages.shape[2]
    reader = _attention_pallas
    if _tpu_kernel(interpret):
        if interpret is _pallas_tpu.TPU and not _pallas_tpu.fits_tpu(view.k_pages, view.page_size):
            raise _pallas_tpu.Untileable(f"pages of {view.page_size} rows of {view.k_pages.dtype}")
        reader = _pallas_tpu
    last = _last_rows(q, view.lengths, q_positions, causal, kv_heads, view.page_table.shape[1] * view.page_size)
    state = reader.paged_state(_to_rows(q, kv_heads), q.dtype, last, view.page_table, view.k_pages,
                               view.v_pages, page_size=view.page_size, scale=scale, interpret=interpret,
                               k_scale_pages=view.k_scale, v_scale_pages=view.v_scale)
    return _finish(q, state)


def _checked_scale(q: Array, k: Array, scale: float | None) -> tuple[int, float]:
    """Checks q against the view's head-major ``k``; returns the query heads per kv head and the scale."""
    view_batch, kv_heads, _, view_dim = k.shape
    return _checked(q, view_batch, kv_heads, view_dim, scale)


def _checked(q: Array, view_batch: int, kv_heads: int, view_dim: int, scale: float | None) -> tuple[int, float]:
    B, _, q_heads, D = q.shape
    if B != view_batch:
        raise PayloadError(f"attend(): q has batch {B} but the view has batch {view_batch}.")
    if D != view_dim:
        raise PayloadError(f"attend(): q has head_dim {D} but the view has head_dim {view_dim}.")
    if q_heads % kv_heads:
        raise PayloadError(f"attend(): q_heads={q_heads} is not a multiple of the view's kv_heads={kv_heads}.")
    return q_heads // kv_heads, 1.0 / math.sqrt(D) if scale is None else scale


def _grouped(q: Array, k: Array, scale: float | None) -> tuple[Array, int, float]:
    """:func:`_checked_scale`, and q as ``[B, kv_heads, T*G, D]`` float32."""
    groups, scale = _checked_scale(q, k, scale)
    return _to_rows(q, k.shape[1]), groups, scale
