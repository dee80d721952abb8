"""Attention over one append-mode cache: the native kernel on CPU, the pure-JAX block loop elsewhere.

:func:`_float_append` reads a float cache (natively or in pure JAX; its VJP
the flash-attention backward, block by block up to the longest row);
:func:`_quantized_native_or_blockwise` an int8 or fp8 cache with its row
scales; :func:`_blockwise` is the loop both fall back to, with its own
batching rule under ``jax.vmap`` over a pool's caches.
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
    _absolute,
    _append_block,
    _backward_rows,
    _block,
    _block_count,
    _block_f32,
    _by_platform,
    _cache_blocks,
    _flash_block_grads,
    _flash_loop,
    _last_visible,
    _pallas_append,
    _pallas_wanted,
    _read_blocks,
    _relative_offsets,
)
from jax_session_state.attention._bucketed import _bucketed_append
from jax_session_state.attention._pooled import fold_slots
from jax_session_state.errors import PayloadError
from jax_session_state.objects.kv import KVView

_F32 = jnp.float32


def _default_positions(q: Array, lengths: Array, q_positions: Array | None) -> Array:
    batch, T = q.shape[:2]
    if q_positions is None:
        return lengths[:, None].astype(jnp.int32) - T + jnp.arange(T, dtype=jnp.int32)
    if q_positions.shape != (batch, T):
        raise PayloadError(
            f"attend(): q_positions must have shape [{batch}, {T}] (batch, T); got {list(q_positions.shape)}."
        )
    return q_positions.astype(jnp.int32)


def _quantized_native_or_blockwise(q: Array, view: KVView, causal: bool, scale: float,
                                   q_positions: Array | None) -> tuple[Array, Array]:
    """A quantized append-mode view: the native kernel on CPU (scales applied inside), the Pallas kernel on CUDA
    where a GPU is attached (:func:`_pallas_wanted`), one bucketed pass elsewhere."""
    relative = q_positions is None
    positions = _relative_offsets(q) if relative else _default_positions(q, view.lengths, q_positions)

    def native(q, k, v, k_scale, v_scale, lengths, positions):
        return _native.quantized_kernel(q, k, v, k_scale, v_scale, lengths, positions, causal=causal, scale=scale,
                                        relative=relative)

    def bucketed(q, k, v, k_scale, v_scale, lengths, positions):
        return _bucketed_append(q, k, v, lengths, _absolute(lengths, positions, relative), causal=causal,
                                scale=scale, k_scale=k_scale, v_scale=v_scale)

    def pallas(q, k, v, k_scale, v_scale, lengths, positions, *, interpret):
        return _pallas_append(q, k, v, lengths, _absolute(lengths, positions, relative), causal=causal, scale=scale,
                              interpret=interpret, k_scale=k_scale, v_scale=v_scale)

    wanted = _pallas_wanted("auto", view.k, view.k.shape[2])
    return _by_platform("auto", None, bucketed, q, view.k, view.v, view.k_scale, view.v_scale, view.lengths,
                        positions, native=native, pallas=pallas if wanted else None)


def _blockwise(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
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
    n = _append_block(k, k_scale)
    read = functools.partial(_read_blocks, causal=causal, scale=scale, n=n)
    return fold_slots(read, functools.partial(_cache_blocks, n=n))(q, q_positions, cache)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _float_append(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, causal: bool, scale: float,
                  relative: bool, reader: str) -> tuple[Array, Array]:
    """Append-mode attention over a float cache, read by ``reader``, with the VJP of :func:`_float_append_bwd`.

    ``"native"``: the native kernel on CPU (:func:`_blockwise` under a
    ``vmap`` it does not fold), the Pallas kernel on CUDA where a GPU is
    attached (:func:`_pallas_wanted`), one bucketed pass
    (:func:`_bucketed_append`) elsewhere; ``"auto"``, ``"loop"``,
    ``"bucketed"`` and ``"pallas"`` (where the Pallas kernel does not take
    the cache): the loop or buckets as :func:`_by_platform` picks them.
    Neither pure reader could be reverse-differentiated as it stands under
    ``jit`` (the loop's trip count is traced) or under ``vmap`` (buckets
    switch on a batched index), so every reader takes this one VJP, batched
    as a whole; forward-mode ``jax.jvp`` does not go through it.

    With ``relative`` the query positions are offsets from each row's length.
    """

    def blockwise(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array) -> tuple[Array, Array]:
        return _blockwise(q, k, v, lengths, _absolute(lengths, q_positions, relative), causal=causal, scale=scale)

    def pallas(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *,
               interpret: bool) -> tuple[Array, Array]:
        return _pallas_append(q, k, v, lengths, _absolute(lengths, q_positions, relative), causal=causal,
                              scale=scale, interpret=interpret)

    bucketed = functools.partial(_relative_bucketed, causal=causal, scale=scale, relative=relative)
    if reader != "native":
        return _by_platform(reader, blockwise, bucketed, q, k, v, lengths, q_positions)
    native = _native.kernel(causal, scale, relative, blockwise)
    wanted = _pallas_wanted("auto", k, k.shape[2])
    return _by_platform("auto", None, bucketed, q, k, v, lengths, q_positions, native=native,
                        pallas=pallas if wanted else None)


def _relative_bucketed(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
                       scale: float, relative: bool) -> tuple[Array, Array]:
    """:func:`_bucketed_append`, the query positions given as :func:`_float_append` takes them."""
    return _bucketed_append(q, k, v, lengths, _absolute(lengths, q_positions, relative), causal=causal, scale=scale)


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
    qh, d_rows, lse_rows, delta = _backward_rows(q, kv_heads, d_out, d_lse, out, lse)
    last = _last_visible(lengths, _absolute(lengths, q_positions, relative), causal, groups)

    def body(i: Array, grads: Any) -> Any:
        start, key_position, first = _block(k, i, n)
        keys, values = _block_f32(k, start, n), _block_f32(v, start, n)
        visible = (key_position >= first) & (key_position <= last)
        add = lambda grad, block: lax.dynamic_update_slice_in_dim(  # noqa: E731
            grad, lax.dynamic_slice_in_dim(grad, start, n, axis=2) + block, start, axis=2)
        return _flash_block_grads(grads, keys, values, visible, qh, (d_rows, lse_rows, delta), scale, add)

    return _flash_loop(q, qh, k, v, _block_count(lengths, capacity, n), body)


_float_append.defvjp(_float_append_fwd, _float_append_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _pallas_or_bucketed(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, causal: bool,
                        scale: float, reader: str) -> tuple[Array, Array]:
    """A float append-mode cache read by the Pallas split-K kernel: on GPU compiled, on CPU interpreted
    (``reader="pallas"``) or the block loop (``"auto"``, where a GPU is attached); one bucketed pass on TPU.  Its
    VJP is the bucketed pass's, recomputed (a Pallas call has none)."""
    loop = functools.partial(_blockwise, causal=causal, scale=scale)
    bucketed = functools.partial(_bucketed_append, causal=causal, scale=scale)
    pallas = functools.partial(_pallas_append, causal=causal, scale=scale)
    return _by_platform(reader, loop, bucketed, q, k, v, lengths, q_positions, pallas=pallas)


def _pallas_or_bucketed_fwd(q, k, v, lengths, q_positions, causal, scale, reader):
    out = _pallas_or_bucketed(q, k, v, lengths, q_positions, causal, scale, reader)
    return out, (q, k, v, lengths, q_positions)


def _pallas_or_bucketed_bwd(causal: bool, scale: float, reader: str, residuals: Any, cotangents: Any) -> tuple:
    return (*_bucketed_vjp(residuals, cotangents, causal=causal, scale=scale, relative=False), None, None)


_pallas_or_bucketed.defvjp(_pallas_or_bucketed_fwd, _pallas_or_bucketed_bwd)
