"""Blocks of keys read from a head-major cache ``[B, kv_heads, C, ...]`` where they lie.

A block is a run of slots sliced in place (of every batch row, or of a
few rows of a pool's stacked caches), widened to float32 block by block,
never the whole cache.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from jax_session_state.attention._softmax import F32

BLOCK_SIZE = 64
"""Keys per block in append mode (chosen by measurement on XLA:CPU)."""

QUANTIZED_BLOCK_SIZE = 1024
"""Keys per block of an int8 / fp8 cache in append mode (chosen by measurement on XLA:CPU)."""

Rows = tuple[Array, int] | None
"""``(first, count)``: a block read takes only batch rows ``[first, first + count)`` (None: every row)."""


def block_count(lengths: Array, capacity: int, n: int) -> Array:
    """The blocks of ``n`` slots the longest row reads.

    The trip count depends on lengths only (not on queries), so under vmap
    over lanes sharing one prefix the loop, and every block read, stays
    unbatched.
    """
    return jnp.max(row_blocks(lengths, capacity, n))


def row_blocks(lengths: Array, capacity: int, n: int) -> Array:
    """The blocks of ``n`` slots each row reads: its valid length (at most the capacity), rounded up."""
    return (jnp.clip(lengths, 0, capacity) + n - 1) // n


def block(cache: Array, i: Array, n: int) -> tuple[Array, Array, Array]:
    """Block ``i`` of ``n`` keys: its start, key positions and first new position.

    The last block is shifted back to stay inside the cache; the keys it
    repeats are masked by ``position >= first``.
    """
    first = i * n
    start = jnp.minimum(first, cache.shape[2] - n)
    return start, start + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3), first


def key_slice(cache: Array, start: Array, n: int, rows: Rows) -> Array:
    """Slots ``[start, start + n)`` of a head-major ``[B, kv_heads, C, ...]`` array, of every row or of ``rows``."""
    if rows is None:
        return lax.dynamic_slice_in_dim(cache, start, n, axis=2)
    first, count = rows
    return lax.dynamic_slice(cache, (first, 0, start, 0), (count, cache.shape[1], n, cache.shape[3]))


def block_f32(cache: Array, start: Array, n: int, rows: Rows = None) -> Array:
    """Keys ``[start, start + n)`` of a head-major cache as float32 (of ``rows`` only, where given).

    A 16-bit cache is sliced as 16-bit integers: XLA:CPU widens bfloat16 and
    float16 operations to float32, and would widen the whole capacity on
    every call to slice a block of it (BENCHMARKS.md, the attention rows).
    """
    if cache.dtype.itemsize != 2:  # float32 as it is; int8 and fp8 values widened block by block
        return key_slice(cache, start, n, rows).astype(F32)
    bits = lax.bitcast_convert_type(cache, jnp.uint16)
    return lax.bitcast_convert_type(key_slice(bits, start, n, rows), cache.dtype).astype(F32)


def block_scales(scale: Array, start: Array, n: int, rows: Rows = None) -> Array:
    """The row scales of keys ``[start, start + n)`` of a quantized cache, laid out as scores: ``[B, Hk, 1, n]``."""
    return jnp.swapaxes(key_slice(scale, start, n, rows), 2, 3)


def append_block(k: Array, k_scale: Array | None) -> int:
    """Keys per block of a cache of ``k``'s keys: :data:`BLOCK_SIZE` (quantized: :data:`QUANTIZED_BLOCK_SIZE`),
    at most its capacity."""
    return min(BLOCK_SIZE if k_scale is None else QUANTIZED_BLOCK_SIZE, k.shape[2])


def cache_blocks(cache: dict[str, Array], *, n: int) -> Array:
    """The blocks each row of a head-major cache reads (slot ``j`` holds a position ``>= j``)."""
    return row_blocks(cache["lengths"], cache["k"].shape[2], n)
