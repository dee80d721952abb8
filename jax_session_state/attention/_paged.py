"""A paged view (``PagedKVCache``) read page by page through the page table where the pages lie, and its gradients.

:func:`read` is the entry.  The page loop (:func:`_paged_blockwise`), the native paged kernel on CPU,
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

from jax_session_state.attention import _native, _pallas, _pallas_tpu, _softmax as softmax
from jax_session_state.attention._backward import backward_rows, flash_block_grads, flash_loop
from jax_session_state.attention._bucketed import read_buckets
from jax_session_state.attention._choice import by_platform, pallas_wanted, tpu_kernel, use_native
from jax_session_state.attention._key_blocks import BLOCK_SIZE, QUANTIZED_BLOCK_SIZE, row_blocks
from jax_session_state.attention._operands import absolute, checked, default_positions, query_positions
from jax_session_state.attention._pooled import fold_rows, fold_slots
from jax_session_state.objects.paged import PagedView


def read(q: Array, view: PagedView, causal: bool, scale: float | None, q_positions: Array | None,
         implementation: str) -> tuple[Array, Array]:
    """A paged view read page by page where the pages lie, by the reader ``implementation`` picks here
    (``_choice``): never the whole pool, nor a dense copy.  ``(out, lse)`` as ``attend_with_lse``."""
    _, size, kv_heads, dim = view.k_pages.shape
    slots = view.page_table.shape[0]
    _, scale = checked(q, slots, kv_heads, dim, scale)
    if view.quantized:  # row scales on scores and weights: in the native paged kernel, or block by block
        if use_native(q, view.k_pages, view.v_pages, implementation, kv_heads=kv_heads, quantized=True):
            return _quantized_native(q, view, causal, float(scale), q_positions)
        takes = pallas_wanted(implementation, view.k_pages, view.page_size)
        return by_platform(implementation, functools.partial(_paged_blockwise, causal=causal, scale=scale),
                           functools.partial(_bucketed_paged, causal=causal, scale=scale), q, view,
                           default_positions(q, view.lengths, q_positions),
                           pallas=functools.partial(pallas_read, causal=causal, scale=scale) if takes else None)
    native = use_native(q, view.k_pages, view.v_pages, implementation, kv_heads=kv_heads)
    relative = native and q_positions is None
    positions = query_positions(q, view.lengths, q_positions, relative)
    return _paged_attention(q, view.k_pages, view.v_pages, view.page_table, view.lengths, positions, causal,
                            float(scale), relative, size, "native" if native else implementation)


def _quantized_native(q: Array, view: PagedView, causal: bool, scale: float,
                      q_positions: Array | None) -> tuple[Array, Array]:
    """A quantized paged view: the native paged kernel on CPU (pages and scale pages read in place), the Pallas
    kernel on CUDA where a GPU is attached (:func:`pallas_wanted`), one bucketed pass elsewhere."""
    relative = q_positions is None
    positions = query_positions(q, view.lengths, q_positions, relative)

    def kernel(q, k_pages, v_pages, k_scale, v_scale, table, lengths, positions):
        return _native.paged_kernel(k_pages, v_pages, table, q, lengths, positions, causal=causal, scale=scale,
                                    relative=relative, k_scale_pages=k_scale, v_scale_pages=v_scale)

    def bucketed(q, k_pages, v_pages, k_scale, v_scale, table, lengths, positions):
        paged = PagedView(k_pages, v_pages, table, lengths, view.page_size, k_scale, v_scale)
        return _bucketed_paged(q, paged, absolute(lengths, positions, relative), causal, scale)

    def pallas(q, k_pages, v_pages, k_scale, v_scale, table, lengths, positions, *, interpret):
        paged = PagedView(k_pages, v_pages, table, lengths, view.page_size, k_scale, v_scale)
        return pallas_read(q, paged, absolute(lengths, positions, relative), causal=causal, scale=scale,
                           interpret=interpret)

    wanted = pallas_wanted("auto", view.k_pages, view.page_size)
    return by_platform("auto", None, bucketed, q, view.k_pages, view.v_pages, view.k_scale, view.v_scale,
                       view.page_table, view.lengths, positions, native=kernel, pallas=pallas if wanted else None)


def pallas_read(q: Array, view: PagedView, q_positions: Array, *, causal: bool, scale: float,
                interpret: Any) -> tuple[Array, Array]:
    """A paged view (float, or quantized with its scale pages) read through its page table by the Pallas
    split-K kernel, or on TPU by ``_pallas_tpu``'s (raising ``Untileable`` where its tiling does not take the
    pages)."""
    kv_heads = view.k_pages.shape[2]
    reader = _pallas
    if tpu_kernel(interpret):
        if interpret is _pallas_tpu.TPU and not _pallas_tpu.fits_tpu(view.k_pages, view.page_size):
            raise _pallas_tpu.Untileable(f"pages of {view.page_size} rows of {view.k_pages.dtype}")
        reader = _pallas_tpu
    last = softmax.last_rows(q, view.lengths, q_positions, causal, kv_heads, view.page_table.shape[1] * view.page_size)
    state = reader.paged_state(softmax.to_rows(q, kv_heads), q.dtype, last, view.page_table, view.k_pages,
                               view.v_pages, page_size=view.page_size, scale=scale, interpret=interpret,
                               k_scale_pages=view.k_scale, v_scale_pages=view.v_scale)
    return softmax.finish(q, state)


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
    keys, values = (x.astype(softmax.F32) for x in _gather_pages(view, first, count))
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
        return row_blocks(cache["lengths"], cache["page_table"].shape[1] * view.page_size, block_keys)

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
    qh = softmax.to_rows(q, kv_heads)
    last = softmax.last_visible(view.lengths, q_positions, causal, groups)

    def body(i: Array, state: Any) -> Any:
        keys, values = _gather_pages(view, i * pages, pages)
        key_position = i * n + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3)
        visible = key_position <= last
        block_scores = softmax.scores(keys.astype(softmax.F32) * scale, qh)
        if not view.quantized:
            return softmax.online_update(state, block_scores, visible, values.astype(softmax.F32))
        scales = _gather_pages(view, i * pages, pages, ("k_scale", "v_scale"))
        k_scale, v_scale = (jnp.swapaxes(x, 2, 3) for x in scales)
        return softmax.online_update(state, block_scores * k_scale, visible, values.astype(softmax.F32), v_scale)

    return softmax.finish(q, lax.fori_loop(0, _paged_blocks(view, columns, n), body, softmax.empty_state(qh)))


def _paged_blocks(view: PagedView, columns: int, n: int) -> Array:
    """Blocks of ``n`` keys up to the longest slot's length (``columns`` table columns of ``page_size``)."""
    return (jnp.clip(jnp.max(view.lengths), 0, columns * view.page_size) + n - 1) // n


def _paged_bucketed(q: Array, k_pages: Array, v_pages: Array, table: Array, lengths: Array, positions: Array, *,
                    causal: bool, scale: float, relative: bool, page_size: int) -> tuple[Array, Array]:
    """:func:`_bucketed_paged` over float pages, taking :func:`_paged_attention`'s operands."""
    view = PagedView(k_pages, v_pages, table, lengths, page_size)
    return _bucketed_paged(q, view, absolute(lengths, positions, relative), causal, scale)


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
        return _paged_blockwise(q, paged, absolute(lengths, positions, relative), causal, scale)

    def kernel(q, k_pages, v_pages, table, lengths, positions):
        return _native.paged_kernel(k_pages, v_pages, table, q, lengths, positions, causal=causal, scale=scale,
                                    relative=relative)

    def pallas(q, k_pages, v_pages, table, lengths, positions, *, interpret: bool):
        paged = PagedView(k_pages, v_pages, table, lengths, page_size)
        return pallas_read(q, paged, absolute(lengths, positions, relative), causal=causal, scale=scale,
                             interpret=interpret)

    bucketed = functools.partial(_paged_bucketed, causal=causal, scale=scale, relative=relative, page_size=page_size)
    takes = pallas_wanted(reader, k_pages, page_size)
    return by_platform(reader, loop, bucketed, q, k_pages, v_pages, page_table, lengths, q_positions,
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
    """The flash-attention backward of ``_append._flash_bwd``, page block by page block: ``(dq, dk, dv)``.

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
    qh, d_rows, lse_rows, delta = backward_rows(q, kv_heads, d_out, d_lse, out, lse)
    last = softmax.last_visible(lengths, absolute(lengths, q_positions, relative), causal, q.shape[2] // kv_heads)

    def body(i: Array, grads: Any) -> Any:
        keys, values = (x.astype(softmax.F32) for x in _gather_pages(view, i * pages, pages))
        visible = i * n + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3) <= last
        ids = lax.dynamic_slice_in_dim(view.page_table, i * pages, pages, axis=1)
        ids = jnp.where(ids >= 0, ids, num_pages)  # out of range: dropped

        def add(grad: Array, block: Array) -> Array:  # head-major [slots, kv_heads, n, dim] -> its pages
            rows = block.transpose(0, 2, 1, 3).reshape(slots, pages, page_size, kv_heads, dim)
            return grad.at[ids].add(rows, mode="drop")

        return flash_block_grads(grads, keys, values, visible, qh, (d_rows, lse_rows, delta), scale, add)

    return flash_loop(q, qh, k_pages, v_pages, _paged_blocks(view, columns, n), body)


_paged_attention.defvjp(_paged_attention_fwd, _paged_attention_bwd)


def _bucketed_paged(q: Array, view: PagedView, q_positions: Array, causal: bool, scale: float) -> tuple[Array, Array]:
    """:func:`read_buckets` over a paged view: each bucket's (or chunk's) pages gathered, never the pool.

    Float pages are gathered as stored, quantized ones dequantized.  Under
    ``jax.vmap`` over independent paged caches the pools fold into one, as
    in :func:`_paged_blockwise`.
    """
    gather = _gather_dequantized if view.quantized else _gather_pages

    def read(q: Array, paged: PagedView, q_positions: Array) -> tuple[Array, Array]:
        return read_buckets(q, paged.lengths, q_positions, causal, scale,
                            lambda first, count: gather(paged, first, count), kv_heads=view.k_pages.shape[2],
                            units=view.page_table.shape[1], unit=view.page_size)

    return _paged_slots(q, view, q_positions, read, BLOCK_SIZE)
