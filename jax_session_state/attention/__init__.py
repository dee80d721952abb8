"""Attention over state views: reads cost what is valid, never what is allocated.

``attend(q, view)`` dispatches on the view:

- :class:`KVView` in append mode: blockwise over the keys up to the longest
  row's length with an online softmax (flash-decoding style), so a
  32k-capacity cache holding 1k tokens attends like a 1k cache;
  ``positions`` is not read.  On a single CPU device, where the native
  kernel was built (``jax_session_state._core._library``: float32, bfloat16 and
  float16 caches, and int8 / fp8 ones whose row scales it applies to the
  scores and weights; one build per instruction set), it runs as one XLA FFI
  call that reads the cache in place on every core; elsewhere a
  ``lax.fori_loop`` over 64-key blocks whose trip count is computed at run
  time (``lax.platform_dependent``).
- :class:`KVView` in ring mode (``window=W, sink=S``): read where it lies.
  Its visible keys are at most three contiguous runs of its storage: the
  sinks, and a window of consecutive positions that may wrap around the
  ring (``_ring``).  On CPU the native kernel reads the sinks and the
  window by position in one call (its ring entry point); ``"loop"`` reads
  each run block by block from its first slot and ``"bucketed"`` in one
  static bucket of slots per run (what ``"pallas"`` and other platforms
  read too).  No dense pass over the slots, no rolled copy; the masks are
  by position as below, staged rows included where the view shows them.
- Under ``jax.vmap`` over independent caches (a ``SessionPool``'s slots,
  each with its own length), the pure readers of append-mode views have a
  batching rule (``_pooled``): the slots fold into the batch, or are read
  one by one to each slot's own length when the lengths are ragged --
  picked at run time, never a gather.  The native kernel folds a pool's
  rings into its batch; the pure ring readers run under plain ``vmap``.
- :class:`BranchKVView` (a speculative lane): cascade attention -- the shared
  prefix and the lane's own rows separately, merged by log-sum-exp.  Under
  ``jax.vmap`` over lanes the prefix is not batched, so its blocks are read
  once for every lane.
- :class:`PagedView`: read page by page through the page table where the
  pages lie (the native kernel, or a loop over blocks of whole pages), never
  gathered into a dense copy.  A quantized view (int8 / fp8 pages and
  their scale pages) is read the same way: the native kernel or the loop
  applies each row's scales to its scores and weights.

``implementation=`` picks how append-mode, ring and paged views are read:
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
capacity or page size a multiple of 16; other views read buckets; a
float32 cache's dots are three TF32 products on a GPU,
about float32's accuracy; on TPU the Mosaic kernel of ``_pallas_tpu``,
opt-in until measured there); :data:`IMPLEMENTATIONS` lists them.
:data:`BLOCK_SIZE` is the keys per block of the loop over an append-mode
view, :data:`PAGED_BLOCK_SIZE` over a paged one (whole pages),
:data:`SMALLEST_BUCKET` the smallest prefix ``"bucketed"`` compiles a pass
for.  Off CPU the loop, a dozen small kernels per block of 64 keys, is
latency-bound by construction.  On a GPU the Pallas kernel read faster
than buckets in every case ``benchmarks/device.py`` measures (the device
rows of BENCHMARKS.md), so ``"auto"`` reads it on CUDA
where this process has a GPU; a CUDA lowering made without one
(``jax.export`` on a CPU host: compiling the kernel takes the GPU's
plugin), TPU and ROCm read buckets.

A query at position ``qp`` sees a key at position ``p`` when
``0 <= p < lengths``, ``p <= qp`` (if ``causal``) and, with a window,
``p < sink or qp - p < window``.  A query that sees nothing returns exact
zeros (and ``lse = -inf``), never NaN; a call without query rows (``T``
or batch 0) returns empty results.  Accumulation is float32 whatever the
cache dtype.  A scale traced under ``jit`` is folded into the queries (in
float32), so every reader takes it, the kernels too (their scale is a
constant).

Why no ``jax.nn.dot_product_attention`` here: it wants token-major K/V (a
transposed copy of the whole cache), its ``local_window_size`` counts slots,
not positions, so it is wrong once a ring wraps, it cannot express sinks,
returns no log-sum-exp to merge, and with ``key_value_seq_lengths`` it still
computes over the whole capacity.

Gradients: attention over a float append-mode view, whichever reader reads
it (native kernel, Pallas kernel, loop or buckets), over a float ring (the
VJP of its bucketed reader, recomputed), and over a float paged
view (native paged kernel, page loop, buckets or Pallas kernel) has a
``jax.custom_vjp`` (on CPU a flash-attention backward in pure JAX, blockwise
like the forward; a paged one scatter-adds into the pages; on GPU and TPU,
and for the dense Pallas kernel everywhere, the VJP of the bucketed pass,
recomputed: its chunks recompute their scores rather than keep them), so
``jax.grad`` works under ``jit`` with traced lengths and through
``jax.vmap`` over independent caches, where neither the loop (a traced trip
count) nor buckets (switched by a batched index) could be differentiated
as they stand; forward-mode ``jax.jvp`` of them does not, nor do quantized
views have gradients.  Measurements and what was tried are in
``benchmarks/NOTES.md``.

Layout: ``_attend`` checks the operands and dispatches by view to one
module per view layout: ``_append`` (an append-mode view: the native
kernel, the block loop and its flash VJP), ``_ring`` (a ring's runs, read
where they lie, and their VJP), ``_paged`` (page by page through the page
table, and its VJP) and ``_branch`` (a lane's own rows; its prefix is read
by its own layout and merged).  ``_choice`` is the one place that turns
``implementation=`` and the platform into a reader: a layout offers its
readers and ``_choice.by_platform`` runs the one picked, so a new reader
is one module and one more reader offered to it.  Modules of one concern
each serve the layouts: ``_softmax`` (query rows and the online softmax),
``_key_blocks`` (blocks of keys sliced where they lie), ``_operands``
(operand checks and query positions), ``_backward`` (the flash backward
pass), ``_bucketed`` (one fused pass over a power-of-two bucket of the
valid prefix), ``_pooled`` (batching rules under ``jax.vmap`` over pool
slots), and the kernels: ``_native`` (the binding of the native CPU
kernel), ``_pallas`` (the split-K Pallas kernel for GPUs) and
``_pallas_tpu`` (the Pallas TPU kernel).  It may import ``errors``,
``objects`` (the views it reads) and ``_core`` (the native library);
sessions, pools and the manager import it, never the reverse.

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

from jax_session_state.attention._attend import (
    IMPLEMENTATIONS,
    attend,
    attend_with_lse,
    merge_attention,
    native_status,
)
from jax_session_state.attention._bucketed import BUCKET_SCORE_BYTES, SMALLEST_BUCKET
from jax_session_state.attention._key_blocks import BLOCK_SIZE
from jax_session_state.attention._paged import PAGED_BLOCK_SIZE

__all__ = [
    "BLOCK_SIZE",
    "BUCKET_SCORE_BYTES",
    "IMPLEMENTATIONS",
    "PAGED_BLOCK_SIZE",
    "SMALLEST_BUCKET",
    "attend",
    "attend_with_lse",
    "merge_attention",
    "native_status",
]
