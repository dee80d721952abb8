"""Attention over state views: reads cost what is valid, never what is allocated.

``attend(q, view)`` dispatches on the view:

- :class:`KVView` in append mode: blockwise over K/V blocks up to the longest
  row's length with an online softmax (flash-decoding style) in a
  ``lax.fori_loop`` whose trip count is computed at run time, so a
  32k-capacity cache holding 1k tokens attends like a 1k cache;
  ``positions`` is not read.  On a single CPU device, float32, where the
  native kernel was built (``jax_session_state._native``), the same
  algorithm runs as one XLA FFI call that reads the cache in place, fused,
  on every core; other platforms, and several CPU devices, run the pure
  loop (``lax.platform_dependent``).
- :class:`KVView` in ring mode (``window=W, sink=S``): the cache is small, so
  one dense, masked pass over its slots using ``positions``.
- :class:`BranchKVView` (a speculative lane): cascade attention — the shared
  prefix and the lane's own rows separately, merged by log-sum-exp.  Under
  ``jax.vmap`` over lanes the prefix is not batched, so its blocks are read
  once for every lane.
- :class:`PagedView`: the pages gathered into a dense view (reference path).

A query at position ``qp`` sees a key at position ``p`` when
``0 <= p < lengths``, ``p <= qp`` (if ``causal``) and, with a window,
``p < sink or qp - p < window``.  A query that sees nothing returns exact
zeros (and ``lse = -inf``), never NaN.  Accumulation is float32 whatever the
cache dtype.

Why no ``jax.nn.dot_product_attention`` here: it wants token-major K/V (a
transposed copy of the whole cache), its ``local_window_size`` counts slots,
not positions, so it is wrong once a ring wraps, it cannot express sinks,
returns no log-sum-exp to merge, and with ``key_value_seq_lengths`` it still
computes over the whole capacity (measured: 263 ms at 32k capacity against
3.3 ms here for 1k valid tokens).

The native kernel (``csrc/decode_attention.cc``): under ``jax.vmap`` over
lanes sharing a cache its batching rule folds the lanes into query rows (one
call reads the prefix once for every lane), and a ``jax.custom_vjp`` gives
it a flash-attention backward in pure JAX, blockwise like the forward; so
with the native kernel ``jax.grad`` also works under ``jit`` with traced
lengths (the pure loop's own autodiff needs concrete lengths, which make it
a scan), while forward-mode ``jax.jvp`` of append-mode attention does not.

The pure loop, measured on XLA:CPU (notes for whoever tunes this next;
``benchmarks/attention.py`` prints where a step's time goes): XLA copies
every K/V block out of the cache before a dot, and a bare slice copy
compiles to scalar code; fusing a multiply into the copy vectorises it, so
the softmax scale is applied to the K block and V is multiplied by a
run-time 1.0 hidden behind ``optimization_barrier``.  XLA runs the loop on
one core (process CPU time = wall time) while PyTorch uses two threads; per
64-key block the K/V copies (half of a T=1 step), about a dozen small
fusions (mask, max, exp, sums, rescale) and the loop itself cost more than
the two dots.  At T=1 and 4k tokens a step takes about 1.7x PyTorch's
one-thread time and 2.5x its two-thread time.

Tried and not kept (A/B in one run, jax 0.10, 4k tokens, T=1 and 16):
32/128/256/512-key blocks (on jax 0.11 128 won at T=16, lost at T=1),
``K @ q`` for T=1, the softmax sum taken by the P@V dot through a column of
ones, K and V read in one slice of a stacked buffer, K stored or copied
transposed, two independent chains of blocks, the heads split over two
loops, the body unrolled 2x/4x by hand (``fori_loop`` cannot unroll a
run-time trip count), larger blocks for the many-row prefix of branch
lanes, XLA's YNNPACK fusions turned off, and reductions in place of dots
(10x slower): each was within noise or slower.  Under ``vmap`` over lanes
the online-softmax state is lane-major while the dots are head-major, so
XLA adds about four transposing copies of the state per block; a batching
rule folding lanes into query rows would avoid them, but
``jax.custom_batching.custom_vmap`` cannot be differentiated, so the pure
loop does without (the native kernel has one, under its custom VJP).
``KVView.positions`` (whole capacity) is never computed in append mode:
nothing reads it and XLA drops it (a test checks the compiled step).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=1024)
  >>> rows = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
  >>> kv = kv.append((rows, rows))
  >>> q = jax.random.normal(jax.random.key(1), (1, 16, 4, 8))  # 4 query heads over 2 kv heads
  >>> jss.attend(q, kv.view()).shape
  (1, 16, 4, 8)
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

from jax_session_state import _native
from jax_session_state.objects.kv import BranchKVView, KVView
from jax_session_state.objects.paged import PagedView

__all__ = ["BLOCK_SIZE", "attend", "attend_with_lse", "merge_attention", "native_status"]

BLOCK_SIZE = 64
"""Keys per block in append mode (chosen by measurement on XLA:CPU)."""

_F32 = jnp.float32


def native_status() -> str:
    """Whether append-mode float32 attention on CPU runs the native kernel here, and why (not).

    The kernel is compiled at install when a C++17 compiler is present; it is
    used on a single CPU device unless ``JSS_NATIVE_ATTENTION=0`` is set.

    Example:
      >>> import jax_session_state as jss
      >>> jss.attention.native_status().startswith(("native kernel", "pure JAX"))
      True
    """
    return _native.status()


def attend(
    q: Array,
    view: KVView | BranchKVView | PagedView,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_positions: Array | None = None,
) -> Array:
    """Attention of ``q`` over a view.

    Args:
      q: ``Float[Array, "batch T q_heads head_dim"]``, token-major;
        ``q_heads`` a multiple of the view's ``kv_heads`` (GQA: query head
        ``h`` reads kv head ``h // (q_heads // kv_heads)``).
      view: a :class:`KVView`, :class:`BranchKVView` or :class:`PagedView`.
      causal: mask keys after each query's position.
      scale: score scale, default ``1 / sqrt(head_dim)``.
      q_positions: ``Int[Array, "batch T"]`` absolute query positions;
        default the view's last ``T`` positions (the rows just written).

    Returns:
      ``Float[Array, "batch T q_heads head_dim"]`` in ``q``'s dtype.
    """
    return attend_with_lse(q, view, causal=causal, scale=scale, q_positions=q_positions)[0]


def attend_with_lse(
    q: Array,
    view: KVView | BranchKVView | PagedView,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_positions: Array | None = None,
) -> tuple[Array, Array]:
    """:func:`attend`, plus the log-sum-exp of each query's visible scores.

    Returns:
      ``out`` as :func:`attend`, and ``lse``: ``Float32[Array, "batch T
      q_heads"]``, ``-inf`` where a query sees nothing.  Two results over
      disjoint keys merge exactly with :func:`merge_attention`.
    """
    if q.ndim != 4:
        raise ValueError(f"attend(): q must be [batch, T, q_heads, head_dim]; got shape {list(q.shape)}.")
    if isinstance(view, BranchKVView):
        q_positions = _default_positions(q, view.window.lengths, q_positions)
        prefix = _kv_with_lse(q, view.prefix, causal, scale, q_positions)
        lane = _dense_with_lse(q, view.window, causal, scale, q_positions)
        return merge_attention(*prefix, *lane)
    if isinstance(view, PagedView):
        view = view.to_dense()
    if not isinstance(view, KVView):
        raise TypeError(f"attend() reads a KVView, BranchKVView or PagedView; got {type(view).__name__}.")
    if view.quantized:
        raise TypeError("attend() reads quantized K/V through its block loop, which is being wired in; "
                        "materialize() the view to read it meanwhile.")
    return _kv_with_lse(q, view, causal, scale, q_positions)


def merge_attention(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Exact merge of two attentions over disjoint key sets (cascade attention).

    Args:
      out_a: ``Float[Array, "batch T heads head_dim"]`` one side's output
        (zeros where it saw nothing, as :func:`attend_with_lse` returns).
      lse_a: ``Float32[Array, "batch T heads"]`` its log-sum-exp (-inf: empty).
      out_b: the other side's output.
      lse_b: the other side's log-sum-exp.

    Returns:
      ``(out, lse)`` equal to attention over the union of the keys; zeros and
      ``-inf`` where both sides are empty, never NaN.
    """
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = (weight_a[..., None] * out_a.astype(_F32) + weight_b[..., None] * out_b.astype(_F32)) / total[..., None]
    return out.astype(out_a.dtype), jnp.where(seen, top + jnp.log(total), -jnp.inf)


# ---------------------------------------------------------------- internals
def _default_positions(q: Array, lengths: Array, q_positions: Array | None) -> Array:
    batch, T = q.shape[:2]
    if q_positions is None:
        return lengths[:, None].astype(jnp.int32) - T + jnp.arange(T, dtype=jnp.int32)
    if q_positions.shape != (batch, T):
        raise ValueError(f"attend(): q_positions must have shape [{batch}, {T}] (batch, T); got {list(q_positions.shape)}.")
    return q_positions.astype(jnp.int32)


def _checked_scale(q: Array, k: Array, scale: float | None) -> tuple[int, float]:
    """Checks q against the view's ``k``; returns the query heads per kv head and the scale."""
    B, T, q_heads, D = q.shape
    view_batch, kv_heads, _, view_dim = k.shape
    if B != view_batch:
        raise ValueError(f"attend(): q has batch {B} but the view has batch {view_batch}.")
    if D != view_dim:
        raise ValueError(f"attend(): q has head_dim {D} but the view has head_dim {view_dim}.")
    if q_heads % kv_heads:
        raise ValueError(f"attend(): q_heads={q_heads} is not a multiple of the view's kv_heads={kv_heads}.")
    return q_heads // kv_heads, 1.0 / math.sqrt(D) if scale is None else scale


def _grouped(q: Array, k: Array, scale: float | None) -> tuple[Array, int, float]:
    """:func:`_checked_scale`, and q as ``[B, kv_heads, T*G, D]`` float32."""
    groups, scale = _checked_scale(q, k, scale)
    return _to_rows(q, k.shape[1]), groups, scale


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


def _online_update(state: Any, scores: Array, visible: Array, values: Array) -> tuple[Array, Array, Array]:
    """One online-softmax step over a block of ``[B, Hk, M, n]`` scores."""
    top, total, acc = state
    scores = jnp.where(visible, scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(-1))
    # Rows that have seen nothing keep top = -inf; subtract 0 there (exp(-inf) = 0, not NaN).
    safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)
    weights = jnp.exp(scores - safe_top[..., None])
    decay = jnp.exp(top - safe_top)
    block = jnp.einsum("bhmn,bhnd->bhmd", weights, values, preferred_element_type=_F32)
    return new_top, decay * total + weights.sum(-1), decay[..., None] * acc + block


def _scores(keys: Array, qh: Array) -> Array:
    return jnp.einsum("bhmd,bhnd->bhmn", qh, keys, preferred_element_type=_F32)


def _kv_with_lse(q: Array, view: KVView, causal: bool, scale: float | None,
                 q_positions: Array | None) -> tuple[Array, Array]:
    if view.window is not None:
        return _dense_with_lse(q, view, causal, scale, _default_positions(q, view.lengths, q_positions))
    _, scale = _checked_scale(q, view.k, scale)
    if _native.enabled() and _native.supports(q, view.k, view.v) and isinstance(scale, numbers.Real):
        if q_positions is None:
            # The last T positions, as offsets from each row's length: a constant,
            # so a step computes no positions (the kernel adds the lengths).
            B, T = q.shape[:2]
            offsets = jnp.asarray(np.broadcast_to(np.arange(-T, 0, dtype=np.int32), (B, T)))
            return _native_or_blockwise(q, view.k, view.v, view.lengths, offsets, causal, float(scale), True)
        q_positions = _default_positions(q, view.lengths, q_positions)
        return _native_or_blockwise(q, view.k, view.v, view.lengths, q_positions, causal, float(scale), False)
    return _blockwise(q, view.k, view.v, view.lengths, _default_positions(q, view.lengths, q_positions),
                      causal=causal, scale=scale)


def _last_visible(lengths: Array, q_positions: Array, causal: bool, groups: int) -> Array:
    """The last key each query row sees, ``[B, 1, T*G, 1]`` (rows ordered (t, g))."""
    last = jnp.broadcast_to(lengths[:, None] - 1, q_positions.shape)
    if causal:
        last = jnp.minimum(last, q_positions)
    return jnp.repeat(last, groups, axis=1)[:, None, :, None]


def _block_count(lengths: Array, capacity: int, n: int) -> Array:
    # The trip count depends on lengths only (not on queries), so under vmap over
    # lanes sharing one prefix the loop, and every block read, stays unbatched.
    return (jnp.clip(jnp.max(lengths), 0, capacity) + n - 1) // n


def _block(cache: Array, i: Array, n: int) -> tuple[Array, Array, Array]:
    """Block ``i`` of ``n`` keys: its start, key positions and first new position.

    The last block is shifted back to stay inside the cache; the keys it
    repeats are masked by ``position >= first``.
    """
    first = i * n
    start = jnp.minimum(first, cache.shape[2] - n)
    return start, start + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3), first


def _blockwise(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
               scale: float) -> tuple[Array, Array]:
    """The pure-JAX append-mode kernel: blocks up to the longest row, online softmax."""
    qh, groups, scale = _grouped(q, k, scale)
    n = min(BLOCK_SIZE, k.shape[2])
    last = _last_visible(lengths, q_positions, causal, groups)
    one = lax.optimization_barrier(jnp.ones((), _F32))  # see the module notes

    def body(i: Array, state: Any) -> Any:
        start, key_position, first = _block(k, i, n)
        keys = lax.dynamic_slice_in_dim(k, start, n, axis=2).astype(_F32) * scale
        values = lax.dynamic_slice_in_dim(v, start, n, axis=2).astype(_F32) * one
        visible = (key_position >= first) & (key_position <= last)
        return _online_update(state, _scores(keys, qh), visible, values)

    return _finish(q, lax.fori_loop(0, _block_count(lengths, k.shape[2], n), body, _empty_state(qh)))


def _absolute(lengths: Array, q_positions: Array, relative: bool) -> Array:
    """Query positions, given as they are or (``relative``) as offsets from each row's length."""
    return lengths[:, None] + q_positions if relative else q_positions


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _native_or_blockwise(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, causal: bool,
                         scale: float, relative: bool) -> tuple[Array, Array]:
    """Append-mode attention: the native kernel on CPU, :func:`_blockwise` elsewhere.

    With ``relative`` the query positions are offsets from each row's length.
    """

    def blockwise(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array) -> tuple[Array, Array]:
        return _blockwise(q, k, v, lengths, _absolute(lengths, q_positions, relative), causal=causal, scale=scale)

    native = _native.kernel(causal, scale, relative, blockwise)
    return lax.platform_dependent(q, k, v, lengths, q_positions, cpu=native, default=blockwise)


def _native_or_blockwise_fwd(q, k, v, lengths, q_positions, causal, scale, relative):
    out, lse = _native_or_blockwise(q, k, v, lengths, q_positions, causal, scale, relative)
    return (out, lse), (q, k, v, lengths, q_positions, out, lse)


def _native_or_blockwise_bwd(causal: bool, scale: float, relative: bool, residuals: Any, cotangents: Any) -> tuple:
    """Flash-attention backward, blockwise up to the longest row like the forward.

    With ``P = exp(S - lse)`` over the visible keys: ``dV = P^T dO``,
    ``dS = P * (dO V^T - rowsum(dO * O) + dlse)``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``.  Works under ``jit`` with traced lengths (no
    reverse-mode through a loop of traced length is needed).
    """
    q, k, v, lengths, q_positions, out, lse = residuals
    d_out, d_lse = cotangents
    kv_heads, capacity = k.shape[1], k.shape[2]
    groups, n = q.shape[2] // kv_heads, min(BLOCK_SIZE, capacity)
    qh, d_rows = _to_rows(q, kv_heads), _to_rows(d_out, kv_heads)
    lse_rows = _to_rows(lse, kv_heads)
    lse_rows = jnp.where(jnp.isneginf(lse_rows), jnp.inf, lse_rows)[..., None]  # sees nothing: P = 0
    delta = (jnp.sum(d_rows * _to_rows(out, kv_heads), -1) - _to_rows(d_lse, kv_heads))[..., None]
    last = _last_visible(lengths, _absolute(lengths, q_positions, relative), causal, groups)

    def body(i: Array, grads: Any) -> Any:
        dq, dk, dv = grads
        start, key_position, first = _block(k, i, n)
        keys = lax.dynamic_slice_in_dim(k, start, n, axis=2).astype(_F32)
        values = lax.dynamic_slice_in_dim(v, start, n, axis=2).astype(_F32)
        visible = (key_position >= first) & (key_position <= last)
        p = jnp.where(visible, jnp.exp(_scores(keys, qh) * scale - lse_rows), 0.0)
        ds = p * (jnp.einsum("bhmd,bhnd->bhmn", d_rows, values) - delta) * scale
        add = lambda grad, block: lax.dynamic_update_slice_in_dim(  # noqa: E731
            grad, lax.dynamic_slice_in_dim(grad, start, n, axis=2) + block, start, axis=2)
        dk = add(dk, jnp.einsum("bhmn,bhmd->bhnd", ds, qh))
        dv = add(dv, jnp.einsum("bhmn,bhmd->bhnd", p, d_rows))
        return dq + jnp.einsum("bhmn,bhnd->bhmd", ds, keys), dk, dv

    zeros = (jnp.zeros_like(qh), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dq, dk, dv = lax.fori_loop(0, _block_count(lengths, capacity, n), body, zeros)
    return _from_rows(dq, q.shape[1]).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_native_or_blockwise.defvjp(_native_or_blockwise_fwd, _native_or_blockwise_bwd)


def _dense_with_lse(q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array) -> tuple[Array, Array]:
    """One masked pass over every slot of a small view, using ``positions``."""
    qh, groups, scale = _grouped(q, view.k, scale)
    key_position = view.positions[:, None, None, :]  # [B, 1, 1, C]
    query_position = jnp.repeat(q_positions, groups, axis=1)[:, None, :, None]  # [B, 1, M, 1]
    visible = (key_position >= 0) & (key_position < view.lengths[:, None, None, None])
    if causal:
        visible &= key_position <= query_position
    if view.window is not None:
        visible &= (key_position < view.sink) | (query_position - key_position < view.window)
    scores = _scores(view.k.astype(_F32) * scale, qh)
    return _finish(q, _online_update(_empty_state(qh), scores, visible, view.v.astype(_F32)))
