"""The pieces of blockwise attention that every implementation shares, and the paged and bucketed readers.

Queries are grouped per kv head as rows ``[B, kv_heads, T*G, D]`` (rows
ordered (t, g)); an online-softmax state ``(top, total, acc)`` is updated
block by block and normalised at the end (:func:`finish`).  Used by
``jax_session_state.attention``.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jax_session_state import _attention_pallas, _native
from jax_session_state._attention_pallas import _SIXTEEN_BIT
from jax_session_state._attention_pooled import fold_rows, fold_slots
from jax_session_state.objects.paged import PagedView

BLOCK_SIZE = 64
"""Keys per block in append mode (chosen by measurement on XLA:CPU)."""

QUANTIZED_BLOCK_SIZE = 1024
"""Keys per block of an int8 / fp8 cache in append mode (chosen by measurement on XLA:CPU)."""

SMALLEST_BUCKET = 256
"""The ``"bucketed"`` implementation's smallest static prefix (keys)."""

BUCKET_SCORE_BYTES = 1 << 28
"""The most bytes of float32 scores ``[B, Hk, T*G, n]`` one ``"bucketed"`` pass holds: a longer bucket is read in
chunks of a power-of-two number of keys that fit (batch 32, 8 kv heads, 64 query rows each: 4096 keys)."""

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
    every call to slice a block of it (measured: 84 ms against 0.2 ms for a
    32k bfloat16 cache holding 4k tokens).
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


def _gather_pages(view: PagedView, first: Any, count: int, pools: tuple[str, ...] = ("k_pages", "v_pages")
                  ) -> tuple[Array, ...]:
    """Table columns ``[first, first + count)`` of every slot as head-major ``[slots, kv_heads, count * S, last]``.

    One result per named pool of the view (the values, or a quantized
    view's scales: ``last`` is then 1).  Only those pages are read (a
    gather of ``slots * count`` pages).
    """
    table = lax.dynamic_slice_in_dim(view.page_table, first, count, axis=1)
    ids = jnp.clip(table, 0, view.k_pages.shape[0] - 1)
    slots = table.shape[0]

    def rows(pool: Array) -> Array:
        block = pool[ids].reshape(slots, count * view.page_size, *pool.shape[2:])
        return block.transpose(0, 2, 1, 3)

    return tuple(rows(getattr(view, name)) for name in pools)


def _gather_dequantized(view: PagedView, first: Any, count: int) -> tuple[Array, Array]:
    """:func:`_gather_pages` of keys and values as float32, times their row scales where quantized."""
    keys, values = (x.astype(_F32) for x in _gather_pages(view, first, count))
    if not view.quantized:
        return keys, values
    k_scale, v_scale = _gather_pages(view, first, count, ("k_scale", "v_scale"))
    return keys * k_scale, values * v_scale


def _paged_block_pages(view: PagedView) -> int:
    """Table columns per block of the paged loop: about :data:`BLOCK_SIZE` keys (a quantized view's:
    :data:`QUANTIZED_BLOCK_SIZE`), whole pages."""
    return max(1, (QUANTIZED_BLOCK_SIZE if view.quantized else BLOCK_SIZE) // view.page_size)


def _padded_table(view: PagedView, pages: int) -> PagedView:
    """The view with its (small) page table padded with -1 to whole blocks of ``pages`` columns; never the pool."""
    columns = view.page_table.shape[1]
    padded = -(-columns // pages) * pages
    if padded == columns:
        return view
    return view.replace(page_table=jnp.pad(view.page_table, ((0, 0), (0, padded - columns)), constant_values=-1))


def _paged_blockwise(q: Array, view: PagedView, q_positions: Array, causal: bool, scale: float) -> tuple[Array, Array]:
    """The pure-JAX loop over a paged view: blocks of whole pages up to the longest slot, online softmax.

    A quantized view's pages are gathered narrow and widened block by block;
    the row scales (gathered alongside, ``[slots, kv_heads, 1, n]``)
    multiply the block's scores and softmax weights, so no dequantized copy
    of a page, let alone of the pool, is made.

    Under ``jax.vmap`` over independent paged caches (a pool of them) the
    pools fold into one (page ids offset) and the loop runs once, or slot
    by slot where that is cheaper (``_attention_pooled``).
    """
    pages = _paged_block_pages(view)

    def read(q: Array, paged: PagedView, q_positions: Array) -> tuple[Array, Array]:
        return _read_pages(q, paged, q_positions, causal, scale, pages)

    return _paged_slots(q, view, q_positions, read, pages * view.page_size)


def _paged_slots(q: Array, view: PagedView, q_positions: Array, read: Any, block_keys: int) -> tuple[Array, Array]:
    """``read(q, paged_view, q_positions)`` with :func:`fold_slots`' batching rule: under ``jax.vmap`` over
    independent paged caches their pools fold into one (page ids offset), or slots are read one by one
    (``block_keys``: the keys of one unit of work in its cost model)."""
    pools = ("k_pages", "v_pages", "k_scale", "v_scale") if view.quantized else ("k_pages", "v_pages")
    cache = {name: getattr(view, name) for name in pools} | {"page_table": view.page_table, "lengths": view.lengths}

    def rows(q: Array, q_positions: Array, cache: dict[str, Array], row: Array | None) -> tuple[Array, Array]:
        table, lengths = cache["page_table"], cache["lengths"]
        if row is not None:
            table = lax.dynamic_slice_in_dim(table, row, q.shape[0], axis=0)
            lengths = lax.dynamic_slice_in_dim(lengths, row, q.shape[0], axis=0)
        return read(q, view.replace(**{name: cache[name] for name in pools}, page_table=table, lengths=lengths),
                    q_positions)

    def blocks(cache: dict[str, Array]) -> Array:
        return _row_blocks(cache["lengths"], cache["page_table"].shape[1] * view.page_size, block_keys)

    return fold_slots(rows, blocks, fold=_fold_paged)(q, q_positions, cache)


def _fold_paged(cache: dict[str, Array], slots: int) -> dict[str, Array]:
    """Stacked paged caches as one: the pools (and scales) end to end, each table's page ids offset to its pool."""
    num_pages = cache["k_pages"].shape[1]
    table = cache["page_table"]
    offset = (jnp.arange(slots, dtype=table.dtype) * num_pages)[:, None, None]
    folded = {name: fold_rows(x) for name, x in cache.items() if name != "page_table"}
    return {**folded, "page_table": fold_rows(jnp.where(table >= 0, table + offset, -1))}


def _read_pages(q: Array, view: PagedView, q_positions: Array, causal: bool, scale: float,
                pages: int) -> tuple[Array, Array]:
    """Blocks of ``pages`` table columns of every slot of ``view``, up to its longest slot."""
    size, kv_heads = view.page_size, view.k_pages.shape[2]
    groups = q.shape[2] // kv_heads
    columns = view.page_table.shape[1]
    view = _padded_table(view, pages)
    n = pages * size
    qh = _to_rows(q, kv_heads)
    last = _last_visible(view.lengths, q_positions, causal, groups)

    def body(i: Array, state: Any) -> Any:
        keys, values = _gather_pages(view, i * pages, pages)
        key_position = i * n + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3)
        visible = key_position <= last
        scores = _scores(keys.astype(_F32) * scale, qh)
        if not view.quantized:
            return _online_update(state, scores, visible, values.astype(_F32))
        scales = _gather_pages(view, i * pages, pages, ("k_scale", "v_scale"))
        k_scale, v_scale = (jnp.swapaxes(x, 2, 3) for x in scales)
        return _online_update(state, scores * k_scale, visible, values.astype(_F32), v_scale)

    return _finish(q, lax.fori_loop(0, _paged_blocks(view, columns, n), body, _empty_state(qh)))


def _paged_blocks(view: PagedView, columns: int, n: int) -> Array:
    """Blocks of ``n`` keys up to the longest slot's length (``columns`` table columns of ``page_size``)."""
    return (jnp.clip(jnp.max(view.lengths), 0, columns * view.page_size) + n - 1) // n


def _absolute(lengths: Array, q_positions: Array, relative: bool) -> Array:
    """Query positions, given as they are or (``relative``) as offsets from each row's length."""
    return lengths[:, None] + q_positions if relative else q_positions


def _by_platform(implementation: str, loop: Any, bucketed: Any, *operands: Any, native: Any = None,
                 pallas: Any = None) -> tuple[Array, Array]:
    """``"loop"`` and ``"bucketed"`` run everywhere; ``"pallas"`` runs ``pallas(*operands, interpret=...)`` where
    given (compiled on GPU, interpreted on CPU; else, and on TPU, ``bucketed``); otherwise (``"auto"``,
    ``"native"``) ``native`` where given (else ``loop``) runs on CPU, ``pallas`` compiled where given on CUDA
    (see :func:`_pallas_wanted`), and ``bucketed`` (a handful of fused kernels) elsewhere."""
    if implementation in ("loop", "bucketed"):
        return (loop if implementation == "loop" else bucketed)(*operands)
    branches = {"cpu": loop if native is None else native}
    if pallas is not None:
        compiled = functools.partial(pallas, interpret=False)
        branches["cuda"] = compiled
        if implementation == "pallas":
            branches.update(cpu=functools.partial(pallas, interpret=True), rocm=compiled)
    elif implementation == "pallas":
        return bucketed(*operands)
    return lax.platform_dependent(*operands, default=bucketed, **branches)


def _pallas_wanted(implementation: str, k: Array, extent: int, scale: Any) -> bool:
    """Whether ``implementation`` reads a cache of ``k``'s keys in runs of ``extent`` through the Pallas kernel:
    ``"pallas"`` asked for, or ``"auto"`` (and ``"native"``, off CPU) where a CUDA GPU is attached (measured
    faster than buckets there, see BENCHMARKS.md); a static scale (the kernel's constant) and a cache it reads
    (``_attention_pallas.takes``).  Otherwise buckets off CPU."""
    wanted = implementation == "pallas" or (implementation in ("auto", "native") and _attention_pallas.gpu_attached())
    return wanted and isinstance(scale, numbers.Real) and _attention_pallas.takes(k, extent)


def _paged_bucketed(q: Array, k_pages: Array, v_pages: Array, table: Array, lengths: Array, positions: Array, *,
                    causal: bool, scale: float, relative: bool, page_size: int) -> tuple[Array, Array]:
    """:func:`_bucketed_paged` over float pages, taking :func:`_paged_attention`'s operands."""
    view = PagedView(k_pages, v_pages, table, lengths, page_size)
    return _bucketed_paged(q, view, _absolute(lengths, positions, relative), causal, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _paged_attention(q: Array, k_pages: Array, v_pages: Array, page_table: Array, lengths: Array, q_positions: Array,
                     causal: bool, scale: float, relative: bool, page_size: int, reader: str) -> tuple[Array, Array]:
    """Float paged attention, by ``reader``: ``"native"`` the native paged kernel on CPU, ``"auto"`` the page loop
    (:func:`_paged_blockwise`) on CPU, both one bucketed pass (:func:`_bucketed_paged`) elsewhere; ``"loop"`` and
    ``"bucketed"`` those everywhere.

    With ``relative`` the query positions are offsets from each row's length.
    Its VJP is :func:`_paged_attention_bwd`, so ``jax.grad`` works through
    any of them (under ``jit``, lengths traced).
    """

    def loop(q, k_pages, v_pages, table, lengths, positions):
        paged = PagedView(k_pages, v_pages, table, lengths, page_size)
        return _paged_blockwise(q, paged, _absolute(lengths, positions, relative), causal, scale)

    def kernel(q, k_pages, v_pages, table, lengths, positions):
        return _native.paged_kernel(k_pages, v_pages, table, q, lengths, positions, causal=causal, scale=scale,
                                    relative=relative)

    def pallas(q, k_pages, v_pages, table, lengths, positions, *, interpret: bool):
        paged = PagedView(k_pages, v_pages, table, lengths, page_size)
        return _pallas_paged(q, paged, _absolute(lengths, positions, relative), causal=causal, scale=scale,
                             interpret=interpret)

    bucketed = functools.partial(_paged_bucketed, causal=causal, scale=scale, relative=relative, page_size=page_size)
    takes = _pallas_wanted(reader, k_pages, page_size, scale)
    return _by_platform(reader, loop, bucketed, q, k_pages, v_pages, page_table, lengths, q_positions,
                        native=kernel if reader == "native" else None, pallas=pallas if takes else None)


def _paged_attention_fwd(q, k_pages, v_pages, page_table, lengths, q_positions, causal, scale, relative, page_size,
                         reader):
    out, lse = _paged_attention(q, k_pages, v_pages, page_table, lengths, q_positions, causal, scale, relative,
                                page_size, reader)
    return (out, lse), (q, k_pages, v_pages, page_table, lengths, q_positions, out, lse)


def _paged_attention_bwd(causal: bool, scale: float, relative: bool, page_size: int, reader: str, residuals: Any,
                         cotangents: Any) -> tuple:
    """On CPU :func:`_paged_flash_bwd`; on GPU and TPU the VJP of the bucketed pass, recomputed (its gathers
    transpose to scatter-adds into the pools)."""
    q, k_pages, v_pages, page_table, lengths, q_positions, _, _ = residuals

    def bucketed() -> tuple[Array, Array, Array]:
        def forward(q: Array, k_pages: Array, v_pages: Array) -> tuple[Array, Array]:
            return _paged_bucketed(q, k_pages, v_pages, page_table, lengths, q_positions, causal=causal, scale=scale,
                                   relative=relative, page_size=page_size)

        return jax.vjp(forward, q, k_pages, v_pages)[1](cotangents)

    dq, dk, dv = lax.platform_dependent(
        cpu=lambda: _paged_flash_bwd(causal, scale, relative, page_size, residuals, cotangents), default=bucketed)
    return dq, dk, dv, None, None, None


def _paged_flash_bwd(causal: bool, scale: float, relative: bool, page_size: int, residuals: Any,
                     cotangents: Any) -> tuple:
    """The flash-attention backward of ``_attention_dense._flash_bwd``, page block by page block: ``(dq, dk, dv)``.

    Each block's key and value gradients are scatter-added into the pools
    at the block's page ids, so a page shared by forked slots sums the
    gradients of every slot that reads it.
    """
    q, k_pages, v_pages, page_table, lengths, q_positions, out, lse = residuals
    d_out, d_lse = cotangents
    num_pages, _, kv_heads, dim = k_pages.shape
    view = PagedView(k_pages, v_pages, page_table, lengths, page_size)
    pages, columns = _paged_block_pages(view), page_table.shape[1]
    view, n, slots = _padded_table(view, pages), pages * page_size, page_table.shape[0]
    qh, d_rows, lse_rows, delta = _backward_rows(q, kv_heads, d_out, d_lse, out, lse)
    last = _last_visible(lengths, _absolute(lengths, q_positions, relative), causal, q.shape[2] // kv_heads)

    def body(i: Array, grads: Any) -> Any:
        dq, dk, dv = grads
        keys, values = (x.astype(_F32) for x in _gather_pages(view, i * pages, pages))
        visible = i * n + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3) <= last
        p = jnp.where(visible, jnp.exp(_scores(keys, qh) * scale - lse_rows), 0.0)
        ds = p * (jnp.einsum("bhmd,bhnd->bhmn", d_rows, values) - delta) * scale
        ids = lax.dynamic_slice_in_dim(view.page_table, i * pages, pages, axis=1)
        ids = jnp.where(ids >= 0, ids, num_pages)  # out of range: dropped

        def add(grad: Array, block: Array) -> Array:  # head-major [slots, kv_heads, n, dim] -> its pages
            rows = block.transpose(0, 2, 1, 3).reshape(slots, pages, page_size, kv_heads, dim)
            return grad.at[ids].add(rows, mode="drop")

        dk = add(dk, jnp.einsum("bhmn,bhmd->bhnd", ds, qh))
        dv = add(dv, jnp.einsum("bhmn,bhmd->bhnd", p, d_rows))
        return dq + jnp.einsum("bhmn,bhnd->bhmd", ds, keys), dk, dv

    zeros = (jnp.zeros_like(qh), jnp.zeros(k_pages.shape, _F32), jnp.zeros(v_pages.shape, _F32))
    dq, dk, dv = lax.fori_loop(0, _paged_blocks(view, columns, n), body, zeros)
    return _from_rows(dq, q.shape[1]).astype(q.dtype), dk.astype(k_pages.dtype), dv.astype(v_pages.dtype)


_paged_attention.defvjp(_paged_attention_fwd, _paged_attention_bwd)


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


def _buckets(capacity: int) -> list[int]:
    """Static prefix lengths: powers of two from :data:`SMALLEST_BUCKET`, the last one the capacity."""
    sizes, n = [], min(SMALLEST_BUCKET, capacity)
    while n < capacity:
        sizes.append(n)
        n *= 2
    return [*sizes, capacity]


def _bucket_scores(q_dtype: Any, qh: Array, keys: Array) -> Array:
    """A bucket's unscaled float32 scores: keys of a 16-bit float cache meet queries of their own dtype as they
    are stored (the products are exact, summed in float32); any other mix is widened to float32 first."""
    if keys.dtype in _SIXTEEN_BIT and keys.dtype == q_dtype:
        return jnp.einsum("bhmd,bhnd->bhmn", qh.astype(keys.dtype), keys, preferred_element_type=_F32)
    return _scores(keys.astype(_F32), qh)


def _chunk_units(score_rows: int, unit: int) -> int:
    """Units (of ``unit`` keys) per chunk of a long bucket: the most keys, a power of two from
    :data:`SMALLEST_BUCKET` on, whose float32 scores for ``score_rows`` query rows fit
    :data:`BUCKET_SCORE_BYTES`; at least one unit."""
    keys = SMALLEST_BUCKET
    while 2 * keys * score_rows * 4 <= BUCKET_SCORE_BYTES:
        keys *= 2
    return max(1, keys // unit)


def _bucketed(q: Array, lengths: Array, q_positions: Array, causal: bool, scale: float, prefix: Any, *,
              kv_heads: int, units: int, unit: int = 1) -> tuple[Array, Array]:
    """Dense masked passes over the smallest static bucket holding every row's valid keys.

    ``prefix(first, count)`` gives keys and values ``[first * unit,
    (first + count) * unit)`` head-major (``first`` may be traced; a
    bfloat16 or float16 cache's as stored: :func:`_weighted_sum` reads the
    values unwidened, :func:`_bucket_scores` the keys where the queries
    share their dtype); the cache holds ``units * unit`` keys (``unit``: 1
    dense, the page size paged).  The bucket is picked at run time by
    ``lax.switch``, so the work is at most twice the valid length (and at
    least :data:`SMALLEST_BUCKET`).  A bucket whose ``[B, Hk, T*G, n]``
    float32 scores would pass :data:`BUCKET_SCORE_BYTES` is read in chunks
    that fit, a loop of static length merged by online softmax (so
    ``jax.grad`` works through it, recomputing each chunk's scores rather
    than keeping them).  The scale multiplies the scores, not the keys.
    """
    sizes = _buckets(units * unit)
    qh = _to_rows(q, kv_heads)
    last = _last_visible(lengths, q_positions, causal, q.shape[2] // kv_heads)
    chunk = _chunk_units(math.prod(qh.shape[:3]), unit)

    def read(state: Any, first: Any, count: int, seen: Any, n: int) -> Any:
        """Keys ``[first * unit, first * unit + n)`` of the ``count`` units from ``first``; those below ``seen``
        were read before (the last chunk moves back to end inside the cache)."""
        keys, values = (x[:, :, :n] for x in prefix(first, count))
        position = first * unit + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3)
        visible = (position >= seen) & (position <= last)
        return _online_update(state, _bucket_scores(q.dtype, qh, keys) * scale, visible, values)

    def branch(n: int) -> Any:
        count = -(-n // unit)

        def attend_prefix() -> tuple[Array, Array, Array]:
            if count <= chunk:
                return read(_empty_state(qh), 0, count, 0, n)

            @jax.checkpoint  # a VJP keeps each chunk's state, not its scores
            def step(i: Array, state: Any) -> Any:
                return read(state, jnp.minimum(i * chunk, count - chunk), chunk, i * chunk * unit, chunk * unit)

            return lax.fori_loop(0, -(-count // chunk), step, _empty_state(qh))

        return attend_prefix

    needed = jnp.clip(jnp.max(lengths), 0, units * unit)
    index = jnp.sum(needed > jnp.asarray(sizes[:-1], jnp.int32))  # the first bucket that holds them all
    return _finish(q, lax.switch(index, [branch(n) for n in sizes]))


def _bucketed_append(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
                     scale: float, k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, Array]:
    """:func:`_bucketed` over a head-major cache ``[B, kv_heads, C, D]`` (its first ``lengths`` slots).

    A quantized cache's bucket is dequantized (its row scales applied) as
    it is read.  Under ``jax.vmap`` over independent caches the slots fold
    into the batch, one bucket for all, or are read slot by slot, each in
    its own bucket, where that is cheaper (``_attention_pooled``).
    """
    cache = {"k": k, "v": v, "lengths": lengths}
    if k_scale is not None:
        cache.update(k_scale=k_scale, v_scale=v_scale)
    kv_heads, capacity = k.shape[1], k.shape[2]

    def read(q: Array, q_positions: Array, cache: dict[str, Array], row: Array | None) -> tuple[Array, Array]:
        rows = None if row is None else (row, q.shape[0])
        lengths = cache["lengths"] if row is None else lax.dynamic_slice_in_dim(cache["lengths"], row, q.shape[0])

        def prefix(first: Any, count: int) -> tuple[Array, Array]:
            keys, values = (_key_slice(cache[name], first, count, rows) for name in ("k", "v"))
            if "k_scale" not in cache:
                return keys, values
            k_scale, v_scale = (_key_slice(cache[name], first, count, rows) for name in ("k_scale", "v_scale"))
            return keys.astype(_F32) * k_scale, values.astype(_F32) * v_scale

        return _bucketed(q, lengths, q_positions, causal, scale, prefix, kv_heads=kv_heads, units=capacity)

    return fold_slots(read, functools.partial(_cache_blocks, n=BLOCK_SIZE))(q, q_positions, cache)


def _bucketed_paged(q: Array, view: PagedView, q_positions: Array, causal: bool, scale: float) -> tuple[Array, Array]:
    """:func:`_bucketed` over a paged view: each bucket's (or chunk's) pages gathered, never the pool.

    Float pages are gathered as stored, quantized ones dequantized.  Under
    ``jax.vmap`` over independent paged caches the pools fold into one, as
    in :func:`_paged_blockwise`.
    """
    gather = _gather_dequantized if view.quantized else _gather_pages

    def read(q: Array, paged: PagedView, q_positions: Array) -> tuple[Array, Array]:
        return _bucketed(q, paged.lengths, q_positions, causal, scale, lambda first, count: gather(paged, first, count),
                         kv_heads=view.k_pages.shape[2], units=view.page_table.shape[1], unit=view.page_size)

    return _paged_slots(q, view, q_positions, read, BLOCK_SIZE)


def _last_rows(q: Array, lengths: Array, q_positions: Array, causal: bool, kv_heads: int, keys: int) -> Array:
    """:func:`_last_visible` as ``Int[Array, "B T*G"]``, of a cache holding ``keys`` keys (the Pallas kernel's
    input)."""
    return _last_visible(jnp.minimum(lengths, keys), q_positions, causal, q.shape[2] // kv_heads)[:, 0, :, 0]


def _pallas_append(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool, scale: float,
                   interpret: bool, k_scale: Array | None = None, v_scale: Array | None = None
                   ) -> tuple[Array, Array]:
    """A head-major cache ``[B, kv_heads, C, D]`` (and a quantized one's row scales) read by the Pallas split-K
    kernel (``_attention_pallas``; compiled for GPU, or ``interpret``-ed)."""
    kv_heads, capacity = k.shape[1], k.shape[2]
    last = _last_rows(q, lengths, q_positions, causal, kv_heads, capacity)
    state = _attention_pallas.append_state(_to_rows(q, kv_heads), q.dtype, last, k, v, scale=scale,
                                           interpret=interpret, k_scale=k_scale, v_scale=v_scale)
    return _finish(q, state)


def _pallas_paged(q: Array, view: PagedView, q_positions: Array, *, causal: bool, scale: float,
                  interpret: bool) -> tuple[Array, Array]:
    """A paged view (float, or quantized with its scale pages) read through its page table by the Pallas
    split-K kernel."""
    kv_heads = view.k_pages.shape[2]
    last = _last_rows(q, view.lengths, q_positions, causal, kv_heads, view.page_table.shape[1] * view.page_size)
    state = _attention_pallas.paged_state(_to_rows(q, kv_heads), q.dtype, last, view.page_table, view.k_pages,
                                          view.v_pages, page_size=view.page_size, scale=scale, interpret=interpret,
                                          k_scale_pages=view.k_scale, v_scale_pages=view.v_scale)
    return _finish(q, state)
