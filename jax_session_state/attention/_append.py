"""An append-mode view (a ``KVCache`` without a window): slot ``j`` holds position ``j``, read up to each row's length.

:func:`read` is the entry: the native kernel on CPU, the Pallas kernel on
CUDA where a GPU is attached, the pure-JAX block loop or buckets as
``implementation`` and the platform pick (``_choice``).
:func:`_float_append` reads a float cache (its VJP the flash-attention
backward, block by block up to the longest row);
:func:`_quantized_native` an int8 or fp8 cache with its row scales;
:func:`blockwise` is the loop both fall back to (:func:`read_blocks`), with
its own batching rule under ``jax.vmap`` over a pool's caches;
:func:`pallas_read` the Pallas kernels (GPU, TPU) over the cache.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from jax_session_state.attention import _native, _pallas, _pallas_tpu
from jax_session_state.attention._backward import backward_rows, flash_block_grads, flash_loop
from jax_session_state.attention._bucketed import bucketed_append
from jax_session_state.attention._choice import by_platform, native_or, pallas_wanted, tpu_kernel
from jax_session_state.attention._key_blocks import (
    BLOCK_SIZE,
    append_block,
    block,
    block_count,
    block_f32,
    block_scales,
    cache_blocks,
)
from jax_session_state.attention._operands import absolute, checked_scale, default_positions, query_positions
from jax_session_state.attention._pooled import fold_slots
from jax_session_state.attention._softmax import (
    F32,
    empty_state,
    finish,
    last_rows,
    last_visible,
    online_update,
    scores,
    to_rows,
)
from jax_session_state.objects.kv import KVView


def read(q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array | None,
         implementation: str) -> tuple[Array, Array]:
    """An append-mode view read by the reader ``implementation`` picks here; ``(out, lse)`` as ``attend_with_lse``.

    ``q_positions`` None means the last ``T`` positions.
    """
    _, scale = checked_scale(q, view.k, scale)
    reader = native_or(q, view.k, view.v, implementation, quantized=view.quantized)
    if view.quantized:  # row scales applied to scores and weights
        if reader == "native":
            return _quantized_native(q, view, causal, float(scale), q_positions)
        return _quantized_pure(q, view, causal, scale, default_positions(q, view.lengths, q_positions),
                               implementation)
    relative = reader == "native" and q_positions is None
    positions = query_positions(q, view.lengths, q_positions, relative)
    if reader != "native" and pallas_wanted(implementation, view.k, view.k.shape[2]):
        return _pallas_or_bucketed(q, view.k, view.v, view.lengths, positions, causal, float(scale), implementation)
    return _float_append(q, view.k, view.v, view.lengths, positions, causal, float(scale), relative, reader)


def _quantized_pure(q: Array, view: KVView, causal: bool, scale: float, positions: Array,
                    implementation: str) -> tuple[Array, Array]:
    """A quantized append-mode view read by ``implementation`` in pure JAX (or the Pallas kernel): its row
    scales go to its scores and weights, block by block or bucket by bucket."""
    scales = {"k_scale": view.k_scale, "v_scale": view.v_scale}

    def loop(q: Array, k: Array, v: Array, lengths: Array, positions: Array, scales: dict) -> tuple[Array, Array]:
        return blockwise(q, k, v, lengths, positions, causal=causal, scale=scale, **scales)

    def bucketed(q: Array, k: Array, v: Array, lengths: Array, positions: Array, scales: dict) -> tuple[Array, Array]:
        return bucketed_append(q, k, v, lengths, positions, causal=causal, scale=scale, **scales)

    def pallas(q: Array, k: Array, v: Array, lengths: Array, positions: Array, scales: dict, *,
               interpret: bool) -> tuple[Array, Array]:
        return pallas_read(q, k, v, lengths, positions, causal=causal, scale=scale, interpret=interpret, **scales)

    takes = pallas_wanted(implementation, view.k, view.k.shape[2])
    return by_platform(implementation, loop, bucketed, q, view.k, view.v, view.lengths, positions, scales,
                       pallas=pallas if takes else None)


def _quantized_native(q: Array, view: KVView, causal: bool, scale: float,
                      q_positions: Array | None) -> tuple[Array, Array]:
    """A quantized append-mode view: the native kernel on CPU (scales applied inside), the Pallas kernel on CUDA
    where a GPU is attached (:func:`pallas_wanted`), one bucketed pass elsewhere."""
    relative = q_positions is None
    positions = query_positions(q, view.lengths, q_positions, relative)

    def native(q, k, v, k_scale, v_scale, lengths, positions):
        return _native.quantized_kernel(q, k, v, k_scale, v_scale, lengths, positions, causal=causal, scale=scale,
                                        relative=relative)

    def bucketed(q, k, v, k_scale, v_scale, lengths, positions):
        return bucketed_append(q, k, v, lengths, absolute(lengths, positions, relative), causal=causal,
                               scale=scale, k_scale=k_scale, v_scale=v_scale)

    def pallas(q, k, v, k_scale, v_scale, lengths, positions, *, interpret):
        return pallas_read(q, k, v, lengths, absolute(lengths, positions, relative), causal=causal, scale=scale,
                           interpret=interpret, k_scale=k_scale, v_scale=v_scale)

    wanted = pallas_wanted("auto", view.k, view.k.shape[2])
    return by_platform("auto", None, bucketed, q, view.k, view.v, view.k_scale, view.v_scale, view.lengths,
                       positions, native=native, pallas=pallas if wanted else None)


def read_blocks(q: Array, q_positions: Array, cache: dict[str, Array], row: Array | None, *, causal: bool,
                scale: float, n: int) -> tuple[Array, Array]:
    """Blocks of ``n`` slots of a head-major cache up to the longest row, online softmax.

    ``cache``: ``k``, ``v``, ``lengths``, and ``k_scale`` / ``v_scale``
    where quantized; slot ``j`` holds position ``j``.  With ``row`` only
    the ``q.shape[0]`` cache rows from ``row`` on are read (one slot of a
    pool).  The caller has checked the shapes; ``scale`` is the score scale.
    """
    rows = None if row is None else (row, q.shape[0])
    lengths = cache["lengths"] if row is None else lax.dynamic_slice_in_dim(cache["lengths"], row, q.shape[0])
    k, v = cache["k"], cache["v"]
    k_scale, v_scale = cache.get("k_scale"), cache.get("v_scale")
    qh = to_rows(q, k.shape[1])
    last = last_visible(lengths, q_positions, causal, q.shape[2] // k.shape[1])
    one = lax.optimization_barrier(jnp.ones((), F32))  # fuses V's copy into a vectorised multiply (NOTES.md)

    def body(i: Array, state: Any) -> Any:
        start, slot, first = block(k, i, n)
        keys = block_f32(k, start, n, rows) * scale
        values = block_f32(v, start, n, rows) * one
        visible = (slot >= first) & (slot <= last)
        block_scores = scores(keys, qh)
        if k_scale is None:
            return online_update(state, block_scores, visible, values)
        # Row scales multiply the [M, n] scores and weights, not the [n, head_dim] blocks.
        block_scores = block_scores * block_scales(k_scale, start, n, rows)
        return online_update(state, block_scores, visible, values, block_scales(v_scale, start, n, rows))

    return finish(q, lax.fori_loop(0, block_count(lengths, k.shape[2], n), body, empty_state(qh)))


def pallas_read(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool, scale: float,
                interpret: Any, k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, Array]:
    """A head-major cache ``[B, kv_heads, C, D]`` (and a quantized one's row scales) read by the Pallas split-K
    kernel (``_pallas``; compiled for GPU, or ``interpret``-ed) or on TPU by ``_pallas_tpu``'s (raising
    ``Untileable`` where its tiling does not take the cache: ``_choice`` reads buckets then)."""
    kv_heads, capacity = k.shape[1], k.shape[2]
    reader = _pallas
    if tpu_kernel(interpret):
        block_keys = _pallas_tpu.append_block(k)
        if block_keys is None or (interpret is _pallas_tpu.TPU and not _pallas_tpu.fits_tpu(k, block_keys)):
            raise _pallas_tpu.Untileable(f"keys of {k.dtype} [.., {capacity}, {k.shape[-1]}]")
        reader = _pallas_tpu
    last = last_rows(q, lengths, q_positions, causal, kv_heads, capacity)
    state = reader.append_state(to_rows(q, kv_heads), q.dtype, last, k, v, scale=scale,
                                interpret=interpret, k_scale=k_scale, v_scale=v_scale)
    return finish(q, state)


def blockwise(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
              scale: float, k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, Array]:
    """The pure-JAX append-mode kernel: blocks up to the longest row, online softmax.

    A quantized cache (``k_scale``, ``v_scale``: ``[B, kv_heads, C, 1]``) is
    read in larger blocks of its narrow values, widened block by block; the
    row scales multiply the block's scores and softmax weights (``M`` per
    key, not ``head_dim``), so no dequantized copy is ever made.  Under
    ``jax.vmap`` over independent caches the slots fold into the batch, or
    are read one by one where that is cheaper (``_pooled``).
    """
    cache = {"k": k, "v": v, "lengths": lengths}
    if k_scale is not None:
        cache.update(k_scale=k_scale, v_scale=v_scale)
    n = append_block(k, k_scale)
    read = functools.partial(read_blocks, causal=causal, scale=scale, n=n)
    return fold_slots(read, functools.partial(cache_blocks, n=n))(q, q_positions, cache)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _float_append(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, causal: bool, scale: float,
                  relative: bool, reader: str) -> tuple[Array, Array]:
    """Append-mode attention over a float cache, read by ``reader``, with the VJP of :func:`_float_append_bwd`.

    ``"native"``: the native kernel on CPU (:func:`blockwise` under a
    ``vmap`` it does not fold), the Pallas kernel on CUDA where a GPU is
    attached (:func:`pallas_wanted`), one bucketed pass
    (:func:`bucketed_append`) elsewhere; ``"auto"``, ``"loop"``,
    ``"bucketed"`` and ``"pallas"`` (where the Pallas kernel does not take
    the cache): the loop or buckets as :func:`by_platform` picks them.
    Neither pure reader could be reverse-differentiated as it stands under
    ``jit`` (the loop's trip count is traced) or under ``vmap`` (buckets
    switch on a batched index), so every reader takes this one VJP, batched
    as a whole; forward-mode ``jax.jvp`` does not go through it.

    With ``relative`` the query positions are offsets from each row's length.
    """

    def loop(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array) -> tuple[Array, Array]:
        return blockwise(q, k, v, lengths, absolute(lengths, q_positions, relative), causal=causal, scale=scale)

    def pallas(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *,
               interpret: bool) -> tuple[Array, Array]:
        return pallas_read(q, k, v, lengths, absolute(lengths, q_positions, relative), causal=causal,
                           scale=scale, interpret=interpret)

    bucketed = functools.partial(_relative_bucketed, causal=causal, scale=scale, relative=relative)
    if reader != "native":
        return by_platform(reader, loop, bucketed, q, k, v, lengths, q_positions)
    native = _native.kernel(causal, scale, relative, loop)
    wanted = pallas_wanted("auto", k, k.shape[2])
    return by_platform("auto", None, bucketed, q, k, v, lengths, q_positions, native=native,
                       pallas=pallas if wanted else None)


def _relative_bucketed(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
                       scale: float, relative: bool) -> tuple[Array, Array]:
    """:func:`bucketed_append`, the query positions given as :func:`_float_append` takes them."""
    return bucketed_append(q, k, v, lengths, absolute(lengths, q_positions, relative), causal=causal, scale=scale)


def _float_append_fwd(q, k, v, lengths, q_positions, causal, scale, relative, reader):
    out, lse = _float_append(q, k, v, lengths, q_positions, causal, scale, relative, reader)
    return (out, lse), (q, k, v, lengths, q_positions, out, lse)


def _float_append_bwd(causal: bool, scale: float, relative: bool, reader: str, residuals: Any,
                      cotangents: Any) -> tuple:
    """On CPU :func:`_flash_bwd`; on GPU and TPU the VJP of the bucketed pass, recomputed (a few fused kernels per
    chunk of keys, not a dozen per block of 64)."""
    dq, dk, dv = lax.platform_dependent(
        cpu=lambda: _flash_bwd(causal, scale, relative, residuals, cotangents),
        default=lambda: _bucketed_vjp(residuals[:5], cotangents, causal=causal, scale=scale, relative=relative))
    return dq, dk, dv, None, None


def _bucketed_vjp(operands: tuple, cotangents: Any, *, causal: bool, scale: float, relative: bool
                  ) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)``: the VJP of the bucketed pass over ``(q, k, v, lengths, q_positions)``, recomputed."""
    q, k, v, lengths, q_positions = operands

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        return _relative_bucketed(q, k, v, lengths, q_positions, causal=causal, scale=scale, relative=relative)

    return jax.vjp(forward, q, k, v)[1](cotangents)


def _flash_bwd(causal: bool, scale: float, relative: bool, residuals: Any, cotangents: Any) -> tuple:
    """Flash-attention backward, blockwise up to the longest row like the forward: ``(dq, dk, dv)``.

    With ``P = exp(S - lse)`` over the visible keys: ``dV = P^T dO``,
    ``dS = P * (dO V^T - rowsum(dO * O) + dlse)``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``.  Works under ``jit`` with traced lengths (no
    reverse-mode through a loop of traced length is needed).
    """
    q, k, v, lengths, q_positions, out, lse = residuals
    d_out, d_lse = cotangents
    kv_heads, capacity = k.shape[1], k.shape[2]
    groups, n = q.shape[2] // kv_heads, min(BLOCK_SIZE, capacity)
    qh, d_rows, lse_rows, delta = backward_rows(q, kv_heads, d_out, d_lse, out, lse)
    last = last_visible(lengths, absolute(lengths, q_positions, relative), causal, groups)

    def body(i: Array, grads: Any) -> Any:
        start, key_position, first = block(k, i, n)
        keys, values = block_f32(k, start, n), block_f32(v, start, n)
        visible = (key_position >= first) & (key_position <= last)
        add = lambda grad, part: lax.dynamic_update_slice_in_dim(  # noqa: E731
            grad, lax.dynamic_slice_in_dim(grad, start, n, axis=2) + part, start, axis=2)
        return flash_block_grads(grads, keys, values, visible, qh, (d_rows, lse_rows, delta), scale, add)

    return flash_loop(q, qh, k, v, block_count(lengths, capacity, n), body)


_float_append.defvjp(_float_append_fwd, _float_append_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _pallas_or_bucketed(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, causal: bool,
                        scale: float, reader: str) -> tuple[Array, Array]:
    """A float append-mode cache read by the Pallas split-K kernel: on GPU compiled, on CPU interpreted
    (``reader="pallas"``) or the block loop (``"auto"``, where a GPU is attached); one bucketed pass on TPU.  Its
    VJP is the bucketed pass's, recomputed (a Pallas call has none)."""
    loop = functools.partial(blockwise, causal=causal, scale=scale)
    bucketed = functools.partial(bucketed_append, causal=causal, scale=scale)
    pallas = functools.partial(pallas_read, causal=causal, scale=scale)
    return by_platform(reader, loop, bucketed, q, k, v, lengths, q_positions, pallas=pallas)


def _pallas_or_bucketed_fwd(q, k, v, lengths, q_positions, causal, scale, reader):
    out = _pallas_or_bucketed(q, k, v, lengths, q_positions, causal, scale, reader)
    return out, (q, k, v, lengths, q_positions)


def _pallas_or_bucketed_bwd(causal: bool, scale: float, reader: str, residuals: Any, cotangents: Any) -> tuple:
    return (*_bucketed_vjp(residuals, cotangents, causal=causal, scale=scale, relative=False), None, None)


_pallas_or_bucketed.defvjp(_pallas_or_bucketed_fwd, _pallas_or_bucketed_bwd)
