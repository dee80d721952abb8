"""Attention over state views: reads cost what is valid, never what is allocated.

``attend(q, view)`` dispatches on the view:

- :class:`KVView` in append mode: blockwise over the keys up to the longest
  row's length with an online softmax (flash-decoding style), so a
  32k-capacity cache holding 1k tokens attends like a 1k cache;
  ``positions`` is not read.  On a single CPU device, where the native
  kernel was built (``jax_session_state._native``: float32, bfloat16 and
  float16 caches, and int8 / fp8 ones whose row scales it applies to the
  scores and weights; one build per instruction set), it runs as one XLA FFI
  call that reads the cache in place on every core; elsewhere a
  ``lax.fori_loop`` over 64-key blocks whose trip count is computed at run
  time (``lax.platform_dependent``).
- :class:`KVView` in ring mode (``window=W, sink=S``): the cache is small, so
  one dense, masked pass over its slots using ``positions``.
- Under ``jax.vmap`` over independent caches (a ``SessionPool``'s slots,
  each with its own length), the pure readers have a batching rule
  (``_attention_pooled``): the slots fold into the batch, or are read one
  by one to each slot's own length when the lengths are ragged, or (rings)
  in one dense pass when full -- picked at run time, never a gather.
- :class:`BranchKVView` (a speculative lane): cascade attention -- the shared
  prefix and the lane's own rows separately, merged by log-sum-exp.  Under
  ``jax.vmap`` over lanes the prefix is not batched, so its blocks are read
  once for every lane.
- :class:`PagedView`: read page by page through the page table where the
  pages lie (the native kernel, or a loop over blocks of whole pages), never
  gathered into a dense copy.  A quantized view (int8 / fp8 pages and
  their scale pages) is read the same way: the native kernel or the loop
  applies each row's scales to its scores and weights.

``implementation=`` picks how append-mode and paged views are read:
``"auto"`` (above on CPU; ``"pallas"`` on CUDA where a GPU is attached;
``"bucketed"`` on TPU and elsewhere), ``"native"``,
``"loop"``, ``"bucketed"`` (one fused dense pass over the valid prefix
rounded up to a power of two, picked by ``lax.switch``: a handful of
kernels, O(valid) work; its dots sum in float32 and read a bfloat16 or
float16 cache's values as stored, and its keys too where the queries have
the cache's dtype, instead of a float32 copy of the bucket; a bucket whose
float32 scores would pass :data:`BUCKET_SCORE_BYTES` is read in chunks
that fit, a loop of static length) or ``"pallas"`` (split-K flash
decoding in one Pallas kernel: each program reads one kv head of one row
over its share of the blocks up to that row's valid length, through the
page table for a paged view, and the shares merge by log-sum-exp; compiled
through Triton on GPU, run in Pallas' interpreter on CPU, for tests; float,
int8 and fp8 caches with a power-of-two head dim of at least 16 and a
capacity or page size a multiple of 16, and a static scale; other views,
and TPU, read buckets; a float32 cache's dots are three TF32 products on a
GPU, about float32's accuracy); :data:`IMPLEMENTATIONS` lists them.
:data:`BLOCK_SIZE` is the keys per block of the loop,
:data:`SMALLEST_BUCKET` the smallest prefix ``"bucketed"`` compiles a pass
for.  Off CPU the loop, a dozen small kernels per block of 64 keys, is
latency-bound by construction.  On an H200 the Pallas kernel read faster
than buckets in every row of ``benchmarks/device.py`` (batch 1 to 32, 4k to
128k valid, T = 1 and 16; BENCHMARKS.md), so ``"auto"`` reads it on CUDA
where this process has a GPU; a CUDA lowering made without one
(``jax.export`` on a CPU host: compiling the kernel takes the GPU's
plugin), TPU and ROCm read buckets.

A query at position ``qp`` sees a key at position ``p`` when
``0 <= p < lengths``, ``p <= qp`` (if ``causal``) and, with a window,
``p < sink or qp - p < window``.  A query that sees nothing returns exact
zeros (and ``lse = -inf``), never NaN.  Accumulation is float32 whatever the
cache dtype.

Why no ``jax.nn.dot_product_attention`` here: it wants token-major K/V (a
transposed copy of the whole cache), its ``local_window_size`` counts slots,
not positions, so it is wrong once a ring wraps, it cannot express sinks,
returns no log-sum-exp to merge, and with ``key_value_seq_lengths`` it still
computes over the whole capacity.

Gradients: append-mode attention through the native kernel or the Pallas
kernel and float paged attention (native paged kernel, page loop or Pallas
kernel) have a ``jax.custom_vjp`` (on CPU a flash-attention backward in pure
JAX, blockwise like the forward; a paged one scatter-adds into the pages; on
GPU and TPU, and for the dense Pallas kernel everywhere, the VJP of the
bucketed pass, recomputed), so ``jax.grad`` works under ``jit`` with traced
lengths; forward-mode ``jax.jvp`` of them does not, nor do quantized views
have gradients.  ``"bucketed"`` itself is differentiable as it stands (its
chunks recompute their scores rather than keep them).  Measurements and what
was tried are in ``benchmarks/NOTES.md``.

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
from jax import Array, lax

from jax_session_state import _native
from jax_session_state._attention_blocks import (
    BLOCK_SIZE,
    BUCKET_SCORE_BYTES,
    SMALLEST_BUCKET,
    _absolute,
    _append_block,
    _bucketed_append,
    _bucketed_paged,
    _by_platform,
    _cache_blocks,
    _empty_state,
    _finish,
    _online_update,
    _paged_attention,
    _paged_blockwise,
    _pallas_append,
    _pallas_paged,
    _pallas_wanted,
    _read_blocks,
    _relative_offsets,
    _scores,
    _to_rows,
)
from jax_session_state._attention_dense import (
    _blockwise,
    _default_positions,
    _native_or_blockwise,
    _pallas_or_bucketed,
    _quantized_native_or_blockwise,
)
from jax_session_state._attention_pooled import fold_slots
from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.objects.kv import BranchKVView, KVView
from jax_session_state.objects.paged import PagedView

__all__ = [
    "BLOCK_SIZE",
    "BUCKET_SCORE_BYTES",
    "IMPLEMENTATIONS",
    "SMALLEST_BUCKET",
    "attend",
    "attend_with_lse",
    "merge_attention",
    "native_status",
]

IMPLEMENTATIONS = ("auto", "native", "loop", "bucketed", "pallas")
"""The ways :func:`attend` reads append-mode and paged views."""

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
    implementation: str = "auto",
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
      implementation: how append-mode and paged views are read (ring views
        and a branch's own rows are always one dense pass):
        ``"auto"``: on CPU the native kernel on a single device where
        built, else ``"loop"``; on CUDA, where this process has a GPU,
        ``"pallas"``; on TPU, and elsewhere, ``"bucketed"``;
        ``"native"``: the native kernel (an error where it is not
        available; CPU only); ``"loop"``: the pure-JAX blockwise loop;
        ``"bucketed"``: one fused dense pass over the valid prefix rounded
        up to a power of two, picked by ``lax.switch`` (a handful of
        kernels; in chunks past :data:`BUCKET_SCORE_BYTES` of scores);
        ``"pallas"``: the split-K Pallas kernel (GPU; interpreted on CPU;
        buckets on TPU and for views it does not take, as above).

    Returns:
      ``Float[Array, "batch T q_heads head_dim"]`` in ``q``'s dtype.

    Example:
      Causal attention of the 3 rows just written, against a dense numpy reference:

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_session_state as jss
      >>> k, v, q = jax.random.normal(jax.random.key(0), (3, 1, 3, 1, 4))  # [batch, T, heads, dim]
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=16).append((k, v))
      >>> causal = np.triu(np.full((3, 3), -np.inf), 1)  # a key after the query is hidden
      >>> scores = np.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0]) / np.sqrt(4) + causal
      >>> weights = np.exp(scores - scores.max(-1, keepdims=True))
      >>> reference = (weights / weights.sum(-1, keepdims=True)) @ v[0, :, 0]
      >>> bool(np.allclose(jss.attend(q, kv.view())[0, :, 0], reference, atol=1e-5))
      True
    """
    return attend_with_lse(q, view, causal=causal, scale=scale, q_positions=q_positions,
                           implementation=implementation)[0]


def attend_with_lse(
    q: Array,
    view: KVView | BranchKVView | PagedView,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_positions: Array | None = None,
    implementation: str = "auto",
) -> tuple[Array, Array]:
    """:func:`attend`, plus the log-sum-exp of each query's visible scores.

    Args:
      q: ``Float[Array, "batch T q_heads head_dim"]``, token-major;
        ``q_heads`` a multiple of the view's ``kv_heads``.
      view: a :class:`KVView`, :class:`BranchKVView` or :class:`PagedView`.
      causal: mask keys after each query's position.
      scale: score scale, default ``1 / sqrt(head_dim)``.
      q_positions: ``Int[Array, "batch T"]`` absolute query positions;
        default the view's last ``T`` positions.
      implementation: ``"auto"``, ``"native"``, ``"loop"``,
        ``"bucketed"`` or ``"pallas"``, as for :func:`attend`.

    Returns:
      ``(out, lse)``: ``out`` is ``Float[Array, "batch T q_heads head_dim"]``
      in ``q``'s dtype, as :func:`attend` returns it (zeros where a query
      sees nothing); ``lse`` is ``Float32[Array, "batch T q_heads"]``,
      ``-inf`` where a query sees nothing.  Two results over disjoint keys
      merge exactly with :func:`merge_attention`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> k = jax.random.normal(jax.random.key(0), (1, 4, 1, 8))
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=8, capacity=16).append((k, k))
      >>> out, lse = jss.attend_with_lse(k, kv.view())
      >>> out.shape, lse.shape, lse.dtype
      ((1, 4, 1, 8), (1, 4, 1), dtype('float32'))
      >>> _, nothing = jss.attend_with_lse(k, kv.view(), q_positions=jnp.full((1, 4), -1))  # sees no key
      >>> bool(jnp.isneginf(nothing).all())
      True
    """
    if q.ndim != 4:
        raise PayloadError(f"attend(): q must be [batch, T, q_heads, head_dim]; got shape {list(q.shape)}.")
    if implementation not in IMPLEMENTATIONS:
        raise PayloadError(f"attend(): implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}.")
    if implementation == "native" and not _native.enabled():
        raise RuntimeError(f"attend(implementation='native'): the native kernel is not in use: {_native.status()}")
    if not isinstance(view, (KVView, BranchKVView, PagedView)):
        raise PayloadTypeError(f"attend() reads a KVView, BranchKVView or PagedView; got {type(view).__name__}.")
    if _eager(q, view, q_positions, scale):  # one compiled program per signature, not one per call
        return _compiled_attend(q, view, q_positions, causal=causal, scale=scale, implementation=implementation)
    return _attend(q, view, q_positions, causal=causal, scale=scale, implementation=implementation)


def _eager(q: Array, view: Any, q_positions: Array | None, scale: Any) -> bool:
    """Whether a call runs outside any transformation (no tracers), with a static scale."""
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((q, view, q_positions)))
    return not traced and (scale is None or isinstance(scale, numbers.Real))


def _attend(q: Array, view: KVView | BranchKVView | PagedView, q_positions: Array | None, *, causal: bool,
            scale: float | None, implementation: str) -> tuple[Array, Array]:
    """:func:`attend_with_lse` once its arguments are checked."""
    if isinstance(view, BranchKVView):
        q_positions = _default_positions(q, view.window.lengths, q_positions)
        prefix = _kv_with_lse(q, view.prefix, causal, scale, q_positions, implementation)
        lane = _dense_with_lse(q, view.window, causal, scale, q_positions)
        return merge_attention(*prefix, *lane)
    if isinstance(view, PagedView):
        return _paged_with_lse(q, view, causal, scale, q_positions, implementation)
    return _kv_with_lse(q, view, causal, scale, q_positions, implementation)


# An eager call's loops would be traced and compiled again on every call: run them as one cached program.
_compiled_attend = jax.jit(_attend, static_argnames=("causal", "scale", "implementation"))


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

    Example:
      Attention over 8 keys is the merge of attention over the first 5 and over the last 3:

      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 8, 2, 4))
      >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 4))
      >>> def cache(rows):
      ...     kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
      ...     return kv.append((k[:, rows], v[:, rows])).view()
      >>> merged, _ = jss.merge_attention(*jss.attend_with_lse(q, cache(slice(0, 5)), causal=False),
      ...                                 *jss.attend_with_lse(q, cache(slice(5, 8)), causal=False))
      >>> bool(jnp.allclose(merged, jss.attend(q, cache(slice(0, 8)), causal=False), atol=1e-5))
      True
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


def _kv_with_lse(q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array | None,
                 implementation: str) -> tuple[Array, Array]:
    if view.window is not None:
        return _ring_with_lse(q, view, causal, scale, _default_positions(q, view.lengths, q_positions))
    _, scale = _checked_scale(q, view.k, scale)
    if _use_native(q, view.k, view.v, scale, implementation, quantized=view.quantized):
        if view.quantized:  # row scales applied to scores and weights in the kernel
            return _quantized_native_or_blockwise(q, view, causal, float(scale), q_positions)
        if q_positions is None:
            # The last T positions, as offsets from each row's length: a constant,
            # so a step computes no positions (the kernel adds the lengths).
            offsets = _relative_offsets(q)
            return _native_or_blockwise(q, view.k, view.v, view.lengths, offsets, causal, float(scale), True)
        q_positions = _default_positions(q, view.lengths, q_positions)
        return _native_or_blockwise(q, view.k, view.v, view.lengths, q_positions, causal, float(scale), False)
    # A quantized cache's row scales go to its scores and weights, block by block or bucket by bucket.
    scales = {"k_scale": view.k_scale, "v_scale": view.v_scale} if view.quantized else {}

    def loop(q: Array, k: Array, v: Array, lengths: Array, positions: Array, scales: dict) -> tuple[Array, Array]:
        return _blockwise(q, k, v, lengths, positions, causal=causal, scale=scale, **scales)

    def bucketed(q: Array, k: Array, v: Array, lengths: Array, positions: Array, scales: dict) -> tuple[Array, Array]:
        return _bucketed_append(q, k, v, lengths, positions, causal=causal, scale=scale, **scales)

    def pallas(q: Array, k: Array, v: Array, lengths: Array, positions: Array, scales: dict, *,
               interpret: bool) -> tuple[Array, Array]:
        return _pallas_append(q, k, v, lengths, positions, causal=causal, scale=scale, interpret=interpret, **scales)

    positions = _default_positions(q, view.lengths, q_positions)
    takes = _pallas_wanted(implementation, view.k, view.k.shape[2], scale)
    if takes and not view.quantized:  # float caches have gradients: through a VJP the kernel lacks
        return _pallas_or_bucketed(q, view.k, view.v, view.lengths, positions, causal, scale, implementation)
    return _by_platform(implementation, loop, bucketed, q, view.k, view.v, view.lengths, positions, scales,
                        pallas=pallas if takes else None)


def _use_native(q: Array, k: Array, v: Array, scale: Any, implementation: str, kv_heads: int | None = None,
                quantized: bool = False) -> bool:
    """Whether this call runs the native kernel ("auto" where it takes the operands, or "native")."""
    if implementation not in ("auto", "native") or not isinstance(scale, numbers.Real):
        return False
    takes = _native.enabled() and _native.supports(q, k, v, kv_heads=kv_heads, quantized=quantized)
    if implementation == "native" and not takes:
        raise PayloadError(f"attend(implementation='native'): the kernel on its {_native.ISA} path does not take a "
                         f"{k.dtype} cache with q of shape {list(q.shape)} (see _native.supports).")
    return takes


def _paged_with_lse(q: Array, view: PagedView, causal: bool, scale: float | None, q_positions: Array | None,
                    implementation: str) -> tuple[Array, Array]:
    """A paged view, read page by page where the pages lie: never the whole pool, nor a dense copy."""
    _, size, kv_heads, dim = view.k_pages.shape
    slots = view.page_table.shape[0]
    _, scale = _checked(q, slots, kv_heads, dim, scale)
    if view.quantized:  # row scales on scores and weights: in the native paged kernel, or block by block
        if _use_native(q, view.k_pages, view.v_pages, scale, implementation, kv_heads=kv_heads, quantized=True):
            return _quantized_paged_native(q, view, causal, float(scale), q_positions)
        takes = _pallas_wanted(implementation, view.k_pages, view.page_size, scale)
        return _by_platform(implementation, functools.partial(_paged_blockwise, causal=causal, scale=scale),
                            functools.partial(_bucketed_paged, causal=causal, scale=scale), q, view,
                            _default_positions(q, view.lengths, q_positions),
                            pallas=functools.partial(_pallas_paged, causal=causal, scale=scale) if takes else None)
    native = _use_native(q, view.k_pages, view.v_pages, scale, implementation, kv_heads=kv_heads)
    relative = native and q_positions is None
    positions = _relative_offsets(q) if relative else _default_positions(q, view.lengths, q_positions)
    return _paged_attention(q, view.k_pages, view.v_pages, view.page_table, view.lengths, positions, causal,
                            float(scale), relative, size, "native" if native else implementation)


def _quantized_paged_native(q: Array, view: PagedView, causal: bool, scale: float,
                            q_positions: Array | None) -> tuple[Array, Array]:
    """A quantized paged view: the native paged kernel on CPU (pages and scale pages read in place), the Pallas
    kernel on CUDA where a GPU is attached (:func:`_pallas_wanted`), one bucketed pass elsewhere."""
    relative = q_positions is None
    positions = _relative_offsets(q) if relative else _default_positions(q, view.lengths, q_positions)

    def kernel(q, k_pages, v_pages, k_scale, v_scale, table, lengths, positions):
        return _native.paged_kernel(k_pages, v_pages, table, q, lengths, positions, causal=causal, scale=scale,
                                    relative=relative, k_scale_pages=k_scale, v_scale_pages=v_scale)

    def bucketed(q, k_pages, v_pages, k_scale, v_scale, table, lengths, positions):
        paged = PagedView(k_pages, v_pages, table, lengths, view.page_size, k_scale, v_scale)
        return _bucketed_paged(q, paged, _absolute(lengths, positions, relative), causal, scale)

    def pallas(q, k_pages, v_pages, k_scale, v_scale, table, lengths, positions, *, interpret):
        paged = PagedView(k_pages, v_pages, table, lengths, view.page_size, k_scale, v_scale)
        return _pallas_paged(q, paged, _absolute(lengths, positions, relative), causal=causal, scale=scale,
                             interpret=interpret)

    wanted = _pallas_wanted("auto", view.k_pages, view.page_size, scale)
    return _by_platform("auto", None, bucketed, q, view.k_pages, view.v_pages, view.k_scale, view.v_scale,
                        view.page_table, view.lengths, positions, native=kernel, pallas=pallas if wanted else None)


def _ring_with_lse(
    q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array
) -> tuple[Array, Array]:
    """A ring view: one dense pass over its slots.

    Under ``jax.vmap`` over a pool's rings, on CPU, a loop over blocks up to
    each slot's filled slots where that is cheaper (a ring never holds a
    position below its slot index, so the slots past its length are empty);
    on GPU and TPU still one dense pass.
    """
    _, scale = _checked_scale(q, view.k, scale)
    cache = {"k": view.k, "v": view.v, "lengths": view.lengths, "positions": view.positions}
    if view.quantized:
        cache.update(k_scale=view.k_scale, v_scale=view.v_scale)
    n = _append_block(view.k, view.k_scale)

    def dense(q: Array, q_positions: Array, cache: dict[str, Array], row: None) -> tuple[Array, Array]:
        ring = KVView(k=cache["k"], v=cache["v"], lengths=cache["lengths"], positions=cache["positions"],
                      window=view.window, sink=view.sink, k_scale=cache.get("k_scale"), v_scale=cache.get("v_scale"))
        return _dense_with_lse(q, ring, causal, scale, q_positions)

    read = functools.partial(_read_blocks, causal=causal, scale=scale, n=n, window=view.window, sink=view.sink)
    dense_blocks = -(-view.k.shape[2] // n)
    pooled = fold_slots(read, functools.partial(_cache_blocks, n=n), dense=(dense, dense_blocks))
    # Off CPU a ring is one dense pass under vmap too (its slots are its window; a block loop there is a dozen
    # small kernels per block).
    return lax.platform_dependent(q, q_positions, cache, cpu=pooled,
                                  default=lambda q, q_positions, cache: dense(q, q_positions, cache, None))


def _dense_with_lse(
    q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array
) -> tuple[Array, Array]:
    """One masked pass over every slot of a small view, using ``positions``."""
    qh, groups, scale = _grouped(q, view.k, scale)
    key_position = view.positions[:, None, None, :]  # [B, 1, 1, C]
    query_position = jnp.repeat(q_positions, groups, axis=1)[:, None, :, None]  # [B, 1, M, 1]
    visible = (key_position >= 0) & (key_position < view.lengths[:, None, None, None])
    if causal:
        visible &= key_position <= query_position
    if view.window is not None:
        visible &= (key_position < view.sink) | (query_position - key_position < view.window)
    keys = _dequantize(view.k, view.k_scale, view.k.shape[2])
    values = _dequantize(view.v, view.v_scale, view.v.shape[2])
    return _finish(q, _online_update(_empty_state(qh), _scores(keys * scale, qh), visible, values))


def _dequantize(values: Array, scale: Array | None, n: int) -> Array:
    """The first ``n`` slots' values as float32, times their row scales where quantized (fused into the reader)."""
    return values.astype(_F32) if scale is None else values.astype(_F32) * scale[:, :, :n]
