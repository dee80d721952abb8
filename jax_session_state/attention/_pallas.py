"""Split-K flash decoding in Pallas: ``attend(..., implementation="pallas")``.

One kernel reads an append-mode cache ``[B, kv_heads, C, D]`` or a paged
pool ``[pages, page_size, kv_heads, D]`` (through its page table) where it
lies.  Each program takes one batch row, one kv head, a tile of query rows
and one of ``splits`` equal shares of the blocks up to its rows' last
visible key, so the work follows the valid length, never the capacity, and
a short row still fills the device.  A program walks its blocks with an
online softmax; the shares merge by log-sum-exp afterwards (one small fused
XLA pass).  On GPU it lowers through Triton; on CPU it runs in Pallas'
interpreter (slow: for tests); TPU reads buckets instead.

Dots sum in float32.  A 16-bit float cache's keys and values meet float32
operands (queries of another dtype, softmax weights) as two parts of the
cache's dtype, the nearest one and the rest, so every product is exact as
in the bucketed pass; a float32 cache's dots are three TF32 products on a
GPU (about float32's accuracy; Triton's default is one), IEEE float32 in the
interpreter.
An int8 or fp8 cache's blocks are widened to bfloat16 (exactly) and read
the same way, its row scales multiplying the scores and the weights; on a
GPU with no float8 conversion (compute capability below 8.9, e.g. A100) an
fp8 cache is read as its bytes and decoded by integer arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_session_state.attention._softmax import SIXTEEN_BIT

_F32 = jnp.float32

# The kernel's settings below are the fastest of ``python -m benchmarks.device --sweep`` at the bars' case
# on a GPU; the device rows of BENCHMARKS.md give the case and the figures.

BLOCK_KEYS = 128
"""The most keys a program reads per step: from a 16-bit cache into a tile of up to 32 query rows (fewer where
the capacity or page size asks, or :func:`block_bytes`; see :func:`_most_keys`)."""

WIDE_BLOCK_KEYS = 64
"""The most keys per step into a tile of more than 32 query rows, or from an int8 or fp8 cache (its blocks
widened in registers): more spill registers on sm_80 and sm_90."""

ROW_TILE = 64
"""The most query rows (``T * G`` per kv head) one program holds."""

PROGRAMS = 256
"""Programs a call aims for, about two per streaming multiprocessor of a large GPU: short rows split into more
shares."""

FLOAT32_TILE = 32
"""The most keys per step, and query rows per program, of a float32 cache: its dots are three TF32 products
(:func:`_float32_dots`), whose operands' parts take registers that larger blocks or tiles spill (sm_80, sm_90)."""

WARPS = 4
"""Triton's warps per program holding up to 32 query rows; a tile of 64 rows takes twice as many (with four, its
float32 accumulator and blocks spill registers when Triton compiles it for sm_90)."""

STAGES = 2
"""Software-pipeline stages of the block loop."""

_SMALLEST = 16  # Triton's smallest dot side
_FIRST = np.int32(0)  # a row scale's one column (an index Pallas' interpreter takes beside dynamic ones)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_bytes() -> int:
    """The most bytes one block of keys (or values) may take: 32 KiB where a program has the shared memory of a
    data-centre GPU (compute capability 8.0 or 9.0 and later: 164 KiB and more, for two blocks in each of
    :data:`STAGES` stages), else 16 KiB."""
    capability = compute_capability()
    return 32 * 1024 if capability in (8.0, 8.7) or capability >= 9.0 else 16 * 1024


def _tile(rows: int, cache_dtype: Any) -> int:
    """The query rows one program holds, of ``rows`` per kv head: a power of two from 16 to :data:`ROW_TILE`
    (:data:`FLOAT32_TILE` for a float32 cache)."""
    most = min(ROW_TILE, FLOAT32_TILE) if jnp.dtype(cache_dtype) == _F32 else ROW_TILE
    return min(most, max(_SMALLEST, _power_of_two_at_least(rows)))


def _most_keys(cache_dtype: Any, dim: int, tile: int) -> int:
    """The most keys one step reads from a cache of ``cache_dtype`` and head dim ``dim`` into a tile of ``tile``
    query rows: :data:`BLOCK_KEYS` (16-bit, up to 32 rows), :data:`WIDE_BLOCK_KEYS` (more rows, or int8 and fp8)
    or :data:`FLOAT32_TILE` (float32), within :func:`block_bytes` (at least 16)."""
    dtype = jnp.dtype(cache_dtype)
    if dtype == _F32:
        return min(BLOCK_KEYS, FLOAT32_TILE)
    keys = BLOCK_KEYS if dtype.itemsize == 2 and tile <= 32 else min(BLOCK_KEYS, WIDE_BLOCK_KEYS)
    while keys > _SMALLEST and keys * dim * dtype.itemsize > block_bytes():
        keys //= 2
    return keys


def _block_keys(runs: int, most: int) -> int:
    """The largest power of two up to ``most`` dividing ``runs`` (the capacity or page size, a multiple of 16)."""
    block = most
    while block > _SMALLEST and runs % block:
        block //= 2
    return block


def takes(k: Array, extent: int) -> bool:
    """Whether the kernel reads a cache or pool of ``k``'s head dim with keys in runs of ``extent`` (the capacity,
    or the page size): a power-of-two head dim of at least 16, runs a multiple of 16 (any float, int8 or fp8
    cache)."""
    dim = k.shape[-1]
    return dim >= _SMALLEST and dim == _power_of_two_at_least(dim) and extent % _SMALLEST == 0


@functools.cache
def gpu_attached() -> bool:
    """Whether this process has a CUDA GPU, where ``attend(implementation="auto")`` reads through the kernel.

    A CUDA lowering made without one (``jax.export`` on a CPU host) reads
    buckets instead: compiling the kernel takes the GPU's plugin.
    """
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _read_dtype(dtype: Any) -> Any:
    """The dtype the dots read a cache's values in: a float cache's own, bfloat16 for int8 and fp8 (exactly)."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize > 1 else jnp.dtype(jnp.bfloat16)


def compute_capability() -> float:
    """The compute capability Triton compiles for: the first GPU's, or 9.0 where none is attached (as Pallas
    assumes)."""
    try:
        device, *_ = jax.local_devices(backend="gpu")
    except RuntimeError:
        return 9.0
    return float(device.compute_capability)


def _fp8_as_bits(cache: Array) -> Array:
    """A ``float8_e4m3fn`` cache as its bytes (``uint8``, a free bitcast) where the GPU has no float8 conversion
    (compute capability below 8.9, e.g. A100); any other cache as it is."""
    if cache.dtype == jnp.float8_e4m3fn and compute_capability() < 8.9:
        return lax.bitcast_convert_type(cache, jnp.uint8)
    return cache


def _bfloat16_of_e4m3_bits(bits: Array) -> Array:
    """``float8_e4m3fn`` values given as their bytes, in bfloat16 (exactly) by integer and float32 arithmetic."""
    word = bits.astype(jnp.int32)
    exponent, mantissa = (word >> 3) & 15, word & 7
    power = lax.bitcast_convert_type((exponent + 117) << 23, _F32)  # 2^(exponent - 10)
    magnitude = jnp.where(exponent == 0, mantissa.astype(_F32) * 2.0**-9, (mantissa + 8).astype(_F32) * power)
    value = jnp.where(word >= 128, -magnitude, magnitude)
    return jnp.where((word & 127) == 127, jnp.nan, value).astype(jnp.bfloat16)


def _widen(block: Array) -> Array:
    """A block of keys or values in the dtype the dots read (see :func:`_read_dtype`); ``uint8``: a
    ``float8_e4m3fn`` block as its bytes (:func:`_fp8_as_bits`)."""
    if block.dtype == jnp.uint8:
        return _bfloat16_of_e4m3_bits(block)
    return block.astype(_read_dtype(block.dtype))


def _float32_dots(interpret: bool) -> Any:
    """How the kernel multiplies float32 operands: compiled, as three TF32 tensor-core products (about float32's
    accuracy; Triton's default is one, 10 bits of mantissa, and IEEE float32 dots on the CUDA cores spill
    registers); interpreted, in IEEE float32."""
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _product(a: Array, b: Array, contract_b: int, float32_dots: Any = None) -> Array:
    """``a @ b`` (``contract_b=0``) or ``a @ b.T`` (``contract_b=1``), summed in float32; float32 operands
    multiplied as ``float32_dots`` says (:func:`_float32_dots`)."""
    precision = float32_dots if a.dtype == _F32 else None
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=_F32)


def _split_product(a: Array, b: Array, contract_b: int) -> Array:
    """:func:`_product` of float32 ``a`` and 16-bit ``b`` as two exact dots of ``b``'s dtype (nearest + rest)."""
    high = a.astype(b.dtype)
    low = (a - high.astype(_F32)).astype(b.dtype)
    return _product(high, b, contract_b) + _product(low, b, contract_b)


def _kernel(q_ref: Any, last_ref: Any, *refs: Any, block: int, splits: int, tiles: int, scale: float,
            load: Callable[..., tuple[Array, ...]], wide_queries: bool, float32_dots: Any) -> None:
    """One program: batch row ``program_id(0)``, kv head ``program_id(1)``, share and row tile ``program_id(2)``."""
    *inputs, acc_ref, top_ref, total_ref = refs
    row, head, share = pl.program_id(0), pl.program_id(1), pl.program_id(2) // tiles
    last = last_ref[...]  # [rows] the last key each query row sees (-1: none)
    keys = jnp.maximum(jnp.max(last) + 1, 0)
    blocks = (keys + block - 1) // block
    per_share = (blocks + splits - 1) // splits
    first = share * per_share
    queries = q_ref[...]
    offsets = lax.broadcasted_iota(jnp.int32, (block,), 0)

    def step(i: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        top, total, acc = state
        start = i * block
        position = start + offsets
        k, v, *row_scales = load(inputs, row, head, start, position < keys)
        k, v = _widen(k), _widen(v)
        sixteen = k.dtype in SIXTEEN_BIT
        product = _split_product if sixteen and wide_queries else functools.partial(_product,
                                                                                      float32_dots=float32_dots)
        scores = product(queries.astype(k.dtype) if not wide_queries else queries, k, 1) * scale
        if row_scales:  # a quantized cache's row scales, on the scores and the weights (not on head_dim values)
            scores = scores * row_scales[0][None, :]
        scores = jnp.where(position[None, :] <= last[:, None], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        # Rows that have seen nothing keep top = -inf; subtract 0 there (exp(-inf) = 0, not NaN).
        safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)
        weights = jnp.exp(scores - safe_top[:, None])
        decay = jnp.exp(top - safe_top)
        scaled = weights * row_scales[1][None, :] if row_scales else weights
        summed = _split_product(scaled, v, 0) if sixteen else _product(scaled, v, 0, float32_dots)
        return new_top, decay * total + jnp.sum(weights, axis=1), decay[:, None] * acc + summed

    rows, dim = queries.shape
    empty = (jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32), jnp.zeros((rows, dim), _F32))
    top, total, acc = lax.fori_loop(first, jnp.minimum(first + per_share, blocks), step, empty)
    acc_ref[...] = acc
    top_ref[...] = top
    total_ref[...] = total


def _zero(ref: Any) -> float | int:
    """What a masked load gives: 0 of the ref's kind (Triton casts a float 0 to fp8, not an integer one)."""
    return 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0


def _load_append(inputs: Any, row: Array, head: Array, start: Array, inside: Array, *, block: int
                 ) -> tuple[Array, ...]:
    """Keys and values ``[start, start + block)`` of one row and head of a head-major cache, and a quantized
    cache's row scales ``[block]`` (zeros past the keys read, never loaded)."""
    k_ref, v_ref, *scale_refs = inputs
    values = [plgpu.load(ref.at[row, head, pl.ds(start, block), :], mask=inside[:, None], other=_zero(ref))
              for ref in (k_ref, v_ref)]
    return (*values, *(plgpu.load(ref.at[row, head, pl.ds(start, block), _FIRST], mask=inside, other=0)
                       for ref in scale_refs))


def _load_paged(inputs: Any, row: Array, head: Array, start: Array, inside: Array, *, block: int,
                page_size: int) -> tuple[Array, ...]:
    """The same through the page table: a block lies inside one page (``block`` divides the page size)."""
    table_ref, k_ref, v_ref, *scale_refs = inputs
    page = table_ref[row, start // page_size]
    within = start % page_size
    values = [plgpu.load(ref.at[page, pl.ds(within, block), head, :], mask=inside[:, None], other=_zero(ref))
              for ref in (k_ref, v_ref)]
    return (*values, *(plgpu.load(ref.at[page, pl.ds(within, block), head, _FIRST], mask=inside, other=0)
                       for ref in scale_refs))


def _decode(qh: Array, q_dtype: Any, last: Array, caches: tuple[Array, ...], cache_dtype: Any, *, extent: int,
            runs: int, scale: float, load: Callable[..., tuple[Array, ...]], interpret: bool
            ) -> tuple[Array, Array, Array]:
    """Runs the kernel over ``caches`` (``extent`` keys in runs of ``runs``: the capacity or page size, read by
    ``load`` in blocks that divide it) and merges its shares into one online-softmax state ``(top, total, acc)``
    of ``qh``'s rows."""
    B, kv_heads, M, D = qh.shape
    tile = _tile(M, cache_dtype)
    block = _block_keys(runs, _most_keys(cache_dtype, D, tile))
    load = functools.partial(load, block=block)
    tiles = -(-M // tile)
    padded = tiles * tile
    dtype = _read_dtype(cache_dtype)
    wide_queries = not (dtype in SIXTEEN_BIT and jnp.dtype(q_dtype) == dtype)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, padded - M), (0, 0)))
    last = jnp.pad(last, ((0, 0), (0, padded - M)), constant_values=-1)  # padding rows see nothing
    splits = min(_power_of_two_at_least(-(-PROGRAMS // (B * kv_heads * tiles))), -(-extent // block))
    kernel = functools.partial(_kernel, block=block, splits=splits, tiles=tiles, scale=scale, load=load,
                               wide_queries=wide_queries, float32_dots=_float32_dots(interpret))

    def shares(*trailing: int) -> pl.BlockSpec:
        return pl.BlockSpec((None, None, None, tile, *trailing), lambda b, h, j: (b, h, j // tiles, j % tiles,
                                                                                  *(0 for _ in trailing)))

    acc, top, total = pl.pallas_call(
        kernel,
        grid=(B, kv_heads, splits * tiles),
        in_specs=[pl.BlockSpec((None, None, tile, D), lambda b, h, j: (b, h, j % tiles, 0)),
                  pl.BlockSpec((None, tile), lambda b, h, j: (b, j % tiles)),
                  *[pl.no_block_spec] * len(caches)],
        out_specs=[shares(D), shares(), shares()],
        out_shape=[jax.ShapeDtypeStruct((B, kv_heads, splits, padded, D), _F32),
                   jax.ShapeDtypeStruct((B, kv_heads, splits, padded), _F32),
                   jax.ShapeDtypeStruct((B, kv_heads, splits, padded), _F32)],
        compiler_params=plgpu.CompilerParams(num_warps=WARPS * max(1, tile // 32), num_stages=STAGES),
        interpret=interpret,
        name="jss_decode_attention",
    )(qh if wide_queries else qh.astype(dtype), last, *map(_fp8_as_bits, caches))
    top_all = jnp.max(top, axis=2)
    safe = jnp.where(top_all == -jnp.inf, 0.0, top_all)
    weight = jnp.exp(top - safe[:, :, None])  # each share's softmax mass, rescaled to the common top
    total = jnp.sum(weight * total, axis=2)
    acc = jnp.sum(weight[..., None] * acc, axis=2)
    return top_all[:, :, :M], total[:, :, :M], acc[:, :, :M]


def append_state(qh: Array, q_dtype: Any, last: Array, k: Array, v: Array, *, scale: float, interpret: bool,
                 k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, Array, Array]:
    """The online-softmax state of query rows ``qh`` (``[B, kv_heads, M, D]`` float32, from queries of
    ``q_dtype``) over a head-major cache ``[B, kv_heads, C, D]``; ``last``: ``Int[Array, "B M"]`` the last
    key each row sees (-1: none; at most ``C - 1``); a quantized cache's row scales ``[B, kv_heads, C, 1]``.
    See :func:`takes`."""
    scales = () if k_scale is None else (k_scale, v_scale)
    return _decode(qh, q_dtype, last, (k, v, *scales), v.dtype, extent=k.shape[2], runs=k.shape[2], scale=scale,
                   load=_load_append, interpret=interpret)


def paged_state(qh: Array, q_dtype: Any, last: Array, table: Array, k_pages: Array, v_pages: Array, *,
                page_size: int, scale: float, interpret: bool, k_scale_pages: Array | None = None,
                v_scale_pages: Array | None = None) -> tuple[Array, Array, Array]:
    """:func:`append_state` over pages ``[pages, page_size, kv_heads, D]`` (and scale pages
    ``[pages, page_size, kv_heads, 1]``) through the page table ``[B, pages per row]`` (``last`` at most the keys
    the table holds, less one)."""
    load = functools.partial(_load_paged, page_size=page_size)
    scales = () if k_scale_pages is None else (k_scale_pages, v_scale_pages)
    return _decode(qh, q_dtype, last, (table.astype(jnp.int32), k_pages, v_pages, *scales), v_pages.dtype,
                   extent=table.shape[1] * page_size, runs=page_size, scale=scale, load=load, interpret=interpret)
