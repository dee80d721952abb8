"""Decode attention as a Pallas TPU (Mosaic) kernel: ``attend(..., implementation="pallas")`` on TPU.

The layout TPU kernels use (as tpu-inference's ragged paged attention):
each row's count of key blocks to read (from its lengths, query positions
and ``causal``) and, for a paged view, its page table are scalar-prefetched
into SMEM (``pltpu.PrefetchScalarGridSpec``).  The grid is (batch row, kv
head, key block); the key block's ``index_map`` is clamped to the row's
last block to read, so the steps past it fetch nothing new (the pipeline
skips a block whose index does not change) and compute nothing: the work
and the reads follow the valid length, never the capacity.  A program holds
all query rows of one kv head (``T * G``: the GQA group) and carries an
online softmax in VMEM scratch (``pltpu.VMEM``), summed in float32; the
state goes out at the last step and ``_softmax.finish`` normalises it as
for the GPU kernel (zeros and ``lse = -inf`` where a query sees nothing).
A paged view is read one page per step through the page table, all kv heads
of a page at once (a page's ``[page_size, kv_heads, D]`` is one tile-aligned
block; a block of one head would split the ``(8, 128)`` tiles of its last two
dims), so its grid is (slot, 1, page).  An int8 or fp8 cache is widened and
multiplied by its row scales (``[keys, 1]`` float32, fetched beside it)
inside the kernel; no dequantized copy exists outside VMEM.

On CPU the same kernel runs in Pallas' interpreter (:data:`INTERPRET`),
which is how the tests check it against the float64 reference
(with :data:`ON_CPU` set).  Compiled for a real
TPU it takes only what its tiling does (:func:`fits_tpu`); other views read
buckets.  It has not yet run on a TPU, so ``"auto"`` on TPU stays
``"bucketed"`` (DESIGN.md: a kernel never run on its accelerator is opt-in).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_session_state.attention._pallas import _product, _split_product
from jax_session_state.attention._softmax import SIXTEEN_BIT

_F32 = jnp.float32

BLOCK_KEYS = 256
"""The most keys of an append-mode cache one grid step reads (the largest power of two up to it that divides the
capacity; at least :data:`_SMALLEST_BLOCK`).  Not yet measured on a TPU."""

_SMALLEST_BLOCK = 8  # a float32 sublane tile
_LANES = 128  # a vreg's lanes: a compiled kernel's head dim is a multiple of it
_ROWS = 8  # query rows are padded to a multiple of a float32 sublane tile

TPU = "tpu"
"""The ``interpret=`` value the platform dispatch (``_choice.by_platform``) gives a Pallas reader on TPU: this
kernel, compiled by Mosaic (``True`` and ``False`` stay the GPU kernel's interpreted and compiled modes)."""

ON_CPU = False
"""Whether ``implementation="pallas"`` on CPU runs this kernel interpreted instead of the GPU one (a test switch;
programs traced before it changed must be cleared, ``jax.clear_caches()``)."""


INTERPRET: Any = True
"""``pallas_call``'s ``interpret=`` on CPU: ``True``, Pallas' HLO interpreter (the grid as an XLA loop, SMEM and
VMEM as arrays: pure XLA, so it runs under ``vmap``); ``pltpu.InterpretParams()`` simulates the TPU's memories
and DMAs more closely through host callbacks (several times slower; no ``vmap`` of the ``lax.platform_dependent``
around it).  Either runs this kernel."""


class Untileable(Exception):
    """Raised by a Pallas reader, before it traces anything, where Mosaic cannot tile the cache on a TPU; the
    TPU branch of the dispatch then reads buckets.  Never reaches a caller of ``attend``."""


def _packing(dtype: Any) -> int:
    """Rows of ``dtype`` one sublane tile holds (8 of 32 bits, 16 of 16, 32 of 8)."""
    return _SMALLEST_BLOCK * 4 // jnp.dtype(dtype).itemsize


def _block_keys(extent: int) -> int | None:
    """The keys a step of an append-mode read takes: the largest power of two up to :data:`BLOCK_KEYS` dividing
    the capacity ``extent`` (None where none of at least :data:`_SMALLEST_BLOCK` does)."""
    block = BLOCK_KEYS
    while block >= _SMALLEST_BLOCK and extent % block:
        block //= 2
    return block if block >= _SMALLEST_BLOCK else None


def fits_tpu(k: Array, block: int | None) -> bool:
    """Whether Mosaic tiles blocks of ``block`` keys of a cache of ``k``'s dtype and head dim: a head dim a
    multiple of 128 lanes and blocks a multiple of the dtype's sublane tile (8 float32 rows, 16 of 16 bits, 32 of
    int8 or fp8).  The kernel itself takes any sizes (interpreted, the tests use small ones)."""
    return block is not None and k.shape[-1] % _LANES == 0 and block % _packing(k.dtype) == 0


def append_block(k: Array) -> int | None:
    """The keys per step over a head-major cache ``k`` ``[B, kv_heads, C, D]`` (see :func:`_block_keys`)."""
    return _block_keys(k.shape[2])


def _widen(block: Array, scales: Array | None) -> Array:
    """A block of keys or values as the dots read it: a float cache's own dtype, an int8 or fp8 one's in float32
    times its row scales ``[keys, 1]`` (dequantized here, in VMEM)."""
    if scales is None:
        return block
    return block.astype(_F32) * scales


def _dot(a: Array, b: Array, contract_b: int) -> Array:
    """``a @ b`` (``contract_b=0``) or ``a @ b.T`` (``1``) of float32 ``a``, summed in float32: a 16-bit ``b`` read
    as stored (``a`` as two parts of its dtype, every product exact), a float32 ``b`` at full precision."""
    if b.dtype in SIXTEEN_BIT:
        return _split_product(a, b, contract_b)
    return _product(a, b.astype(_F32), contract_b, lax.Precision.HIGHEST)


def _kernel(blocks_ref: Any, *refs: Any, prefetched: int, block: int, heads: int, scale: float,
            quantized: bool, head_of: Any) -> None:
    """One grid step: batch row ``program_id(0)``, kv heads ``program_id(1) * heads`` on, key block
    ``program_id(2)``; ``head_of(ref, i)`` reads head ``i`` of a block as ``[keys, ...]``."""
    refs = refs[prefetched - 1:]  # past the page table, where there is one
    q_ref, last_ref, k_ref, v_ref, *rest = refs
    scale_refs, rest = (rest[:2], rest[2:]) if quantized else ((None, None), rest)
    top_out, total_out, acc_out, top_ref, total_ref, acc_ref = rest
    row, step = pl.program_id(0), pl.program_id(2)

    @pl.when(step == 0)
    def _start() -> None:
        top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, _F32)
        total_ref[...] = jnp.zeros(total_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when(step < blocks_ref[row])
    def _read() -> None:
        last = last_ref[...]  # [rows, 1] the last key each query row sees (-1: none)
        first = step * block
        visible = first + lax.broadcasted_iota(jnp.int32, (1, block), 1) <= last
        # Keys past every row's last are never weighted: zero their values (a page past a row's end may hold
        # anything, and 0 * NaN is NaN).
        wanted = first + lax.broadcasted_iota(jnp.int32, (block, 1), 0) <= jnp.max(last)
        for i in range(heads):
            k_scale, v_scale = (None, None) if not quantized else (head_of(scale_refs[0], i), head_of(scale_refs[1], i))
            keys = _widen(head_of(k_ref, i), k_scale)
            values = _widen(head_of(v_ref, i), v_scale)
            values = jnp.where(wanted, values, jnp.zeros((), values.dtype))
            scores = jnp.where(visible, _dot(q_ref[i], keys, 1) * scale, -jnp.inf)
            top = top_ref[i]
            new_top = jnp.maximum(top, jnp.max(scores, axis=1, keepdims=True))
            # Rows that have seen nothing keep top = -inf; subtract 0 there (exp(-inf) = 0, not NaN).
            safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)
            weights = jnp.exp(scores - safe_top)
            decay = jnp.exp(top - safe_top)
            top_ref[i] = new_top
            total_ref[i] = decay * total_ref[i] + jnp.sum(weights, axis=1, keepdims=True)
            acc_ref[i] = decay * acc_ref[i] + _dot(weights, values, 0)

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish() -> None:
        top_out[...] = top_ref[...]
        total_out[...] = total_ref[...]
        acc_out[...] = acc_ref[...]


def _interpret(interpret: Any) -> Any:
    """``pallas_call``'s ``interpret=``: Pallas' TPU interpreter on CPU, none compiled for a TPU."""
    return INTERPRET if interpret is True else False


def _row_blocks(last: Array, block: int, most: int) -> Array:
    """``Int32[Array, "B"]`` the key blocks each batch row reads: up to its query rows' last visible key."""
    keys = jnp.max(last, axis=1) + 1
    return jnp.clip((keys + block - 1) // block, 0, most).astype(jnp.int32)


def _decode(qh: Array, last: Array, prefetch: tuple[Array, ...], caches: tuple[Array, ...], cache_spec: Any,
            *, block: int, steps: int, heads: int, scale: float, head_of: Any, interpret: Any
            ) -> tuple[Array, Array, Array]:
    """Runs the kernel: ``heads`` kv heads a program, ``steps`` key blocks of ``block`` keys, ``caches`` read
    through ``cache_spec(*trailing)``; the online-softmax state ``(top, total, acc)`` of ``qh``'s rows."""
    B, kv_heads, M, D = qh.shape
    rows = -(-M // _ROWS) * _ROWS
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, rows - M), (0, 0)))
    last = jnp.pad(last, ((0, 0), (0, rows - M)), constant_values=-1)  # padding rows see nothing
    blocks = _row_blocks(last, block, steps)
    quantized = len(caches) == 4
    kernel = functools.partial(_kernel, prefetched=1 + len(prefetch), block=block, heads=heads, scale=scale,
                               quantized=quantized, head_of=head_of)

    def per_head(*trailing: int) -> pl.BlockSpec:
        return pl.BlockSpec((None, heads, rows, *trailing), lambda b, h, j, *_: (b, h, 0, 0))

    state_shapes = [jax.ShapeDtypeStruct((B, kv_heads, rows, 1), _F32)] * 2 + [
        jax.ShapeDtypeStruct((B, kv_heads, rows, D), _F32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1 + len(prefetch),
        grid=(B, kv_heads // heads, steps),
        in_specs=[per_head(D), pl.BlockSpec((None, rows, 1), lambda b, h, j, *_: (b, 0, 0)),
                  cache_spec(D), cache_spec(D), *[cache_spec(1)] * (len(caches) - 2)],
        out_specs=[per_head(1), per_head(1), per_head(D)],
        scratch_shapes=[pltpu.VMEM((heads, rows, 1), _F32), pltpu.VMEM((heads, rows, 1), _F32),
                        pltpu.VMEM((heads, rows, D), _F32)],
    )
    top, total, acc = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=state_shapes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="jss_decode_attention_tpu",
    )(blocks, *prefetch, qh, last[..., None], *caches)
    return top[:, :, :M, 0], total[:, :, :M, 0], acc[:, :, :M]


def _clamped(j: Array, blocks: Array) -> Array:
    """Key block ``j`` of a row reading ``blocks``, or its last (a step past it fetches nothing new)."""
    return jnp.maximum(jnp.minimum(j, blocks - 1), 0)


def append_state(qh: Array, q_dtype: Any, last: Array, k: Array, v: Array, *, scale: float, interpret: Any,
                 k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, Array, Array]:
    """``_pallas.append_state`` through this kernel: query rows ``qh`` ``[B, kv_heads, M, D]`` float32 over a
    head-major cache ``[B, kv_heads, C, D]`` (a quantized one's row scales ``[B, kv_heads, C, 1]``); ``last``
    ``[B, M]`` the last key each row sees.  Grid (row, kv head, block)."""
    del q_dtype  # the dots read the queries in float32 (split into two 16-bit parts against a 16-bit cache)
    block = append_block(k)

    def cache_spec(trailing: int) -> pl.BlockSpec:
        return pl.BlockSpec((None, 1, block, trailing),
                            lambda b, h, j, blocks: (b, h, _clamped(j, blocks[b]), 0))

    scales = () if k_scale is None else (k_scale, v_scale)
    return _decode(qh, last, (), (k, v, *scales), cache_spec, block=block, steps=k.shape[2] // block, heads=1,
                   scale=scale, head_of=lambda ref, i: ref[i], interpret=interpret)


def paged_state(qh: Array, q_dtype: Any, last: Array, table: Array, k_pages: Array, v_pages: Array, *,
                page_size: int, scale: float, interpret: Any, k_scale_pages: Array | None = None,
                v_scale_pages: Array | None = None) -> tuple[Array, Array, Array]:
    """:func:`append_state` over pages ``[pages, page_size, kv_heads, D]`` (scale pages ``[..., 1]``) through the
    scalar-prefetched page table ``[B, pages per row]``: one page a step, every kv head of it (grid (row, 1,
    page))."""
    del q_dtype
    kv_heads = k_pages.shape[2]

    def cache_spec(trailing: int) -> pl.BlockSpec:
        def page(b: Array, h: Array, j: Array, blocks: Array, table: Array) -> tuple[Array, ...]:
            return jnp.maximum(table[b, _clamped(j, blocks[b])], 0), 0, 0, 0  # -1 (no page): any page, unread

        return pl.BlockSpec((None, page_size, kv_heads, trailing), page)

    scales = () if k_scale_pages is None else (k_scale_pages, v_scale_pages)
    return _decode(qh, last, (table.astype(jnp.int32),), (k_pages, v_pages, *scales), cache_spec, block=page_size,
                   steps=table.shape[1], heads=kv_heads, scale=scale, head_of=lambda ref, i: ref[:, i, :],
                   interpret=interpret)
