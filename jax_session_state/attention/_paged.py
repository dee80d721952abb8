"""The paged readers: page by page through the page table where the pages lie, and their gradients.

The page loop (:func:`_paged_blockwise`), the native paged kernel on CPU,
the bucketed pass over gathered buckets (:func:`_bucketed_paged`) and the
Pallas kernel, behind one ``jax.custom_vjp`` (:func:`_paged_attention`)
whose backward scatter-adds into the pools.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from jax_session_state.attention import _native
from jax_session_state.attention._blocks import (
    BLOCK_SIZE,
    QUANTIZED_BLOCK_SIZE,
    _absolute,
    _backward_rows,
    _by_platform,
    _empty_state,
    _finish,
    _flash_block_grads,
    _flash_loop,
    _last_visible,
    _online_update,
    _pallas_paged,
    _pallas_wanted,
    _row_blocks,
    _scores,
    _to_rows,
)
from jax_session_state.attention._bucketed import _bucketed
from jax_session_state.attention._pooled import fold_rows, fold_slots
from jax_session_state.objects.paged import PagedView

_F32 = jnp.float32


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


PAGED_BLOCK_SIZE = 4 * BLOCK_SIZE
"""Keys per block of the page loop over a float view.  Each block's pages
are gathered and laid head-major before its dots, a cost per block the
dense loop (blocks of :data:`BLOCK_SIZE`, sliced in place) does not pay:
measured, blocks of 64 keys read slower than the dense loop, blocks of 128
and 256 about as fast."""


def _paged_block_pages(view: PagedView) -> int:
    """Table columns per block of the paged loop: about :data:`PAGED_BLOCK_SIZE` keys (a quantized view's:
    :data:`QUANTIZED_BLOCK_SIZE`), whole pages, at most the table's columns."""
    keys = QUANTIZED_BLOCK_SIZE if view.quantized else PAGED_BLOCK_SIZE
    return max(1, min(keys // view.page_size, view.page_table.shape[1]))


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
    by slot where that is cheaper (``_pooled``).
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
    takes = _pallas_wanted(reader, k_pages, page_size)
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
    """The flash-attention backward of ``_dense._flash_bwd``, page block by page block: ``(dq, dk, dv)``.

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
        keys, values = (x.astype(_F32) for x in _gather_pages(view, i * pages, pages))
        visible = i * n + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3) <= last
        ids = lax.dynamic_slice_in_dim(view.page_table, i * pages, pages, axis=1)
        ids = jnp.where(ids >= 0, ids, num_pages)  # out of range: dropped

        def add(grad: Array, block: Array) -> Array:  # head-major [slots, kv_heads, n, dim] -> its pages
            rows = block.transpose(0, 2, 1, 3).reshape(slots, pages, page_size, kv_heads, dim)
            return grad.at[ids].add(rows, mode="drop")

        return _flash_block_grads(grads, keys, values, visible, qh, (d_rows, lse_rows, delta), scale, add)

    return _flash_loop(q, qh, k_pages, v_pages, _paged_blocks(view, columns, n), body)


_paged_attention.defvjp(_paged_attention_fwd, _paged_attention_bwd)


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
