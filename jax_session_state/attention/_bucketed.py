"""The ``"bucketed"`` reader: one fused pass over the valid prefix rounded up to a power of two.

``lax.switch`` picks the pass by the longest row's length, so a step runs
one of a handful of kernels and does O(valid) work; a bucket whose float32
scores would pass :data:`BUCKET_SCORE_BYTES`
is read in chunks that fit.  What GPUs and TPUs read where no kernel of
their own is chosen.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from jax_session_state.attention._key_blocks import BLOCK_SIZE, cache_blocks, key_slice
from jax_session_state.attention._pooled import fold_slots
from jax_session_state.attention._softmax import (
    F32,
    SIXTEEN_BIT,
    empty_state,
    finish,
    last_visible,
    online_update,
    scores,
    to_rows,
)

SMALLEST_BUCKET = 256
"""The ``"bucketed"`` implementation's smallest static prefix (keys)."""

BUCKET_SCORE_BYTES = 1 << 28
"""The most bytes of float32 scores ``[B, Hk, T*G, n]`` one ``"bucketed"`` pass holds: a longer bucket is read in
chunks of a power-of-two number of keys that fit (batch 32, 8 kv heads, 64 query rows each: 4096 keys)."""



def buckets(capacity: int) -> list[int]:
    """Static prefix lengths: powers of two from :data:`SMALLEST_BUCKET`, the last one the capacity."""
    sizes, n = [], min(SMALLEST_BUCKET, capacity)
    while n < capacity:
        sizes.append(n)
        n *= 2
    return [*sizes, capacity]


def _bucket_scores(q_dtype: Any, qh: Array, keys: Array) -> Array:
    """A bucket's unscaled float32 scores: keys of a 16-bit float cache meet queries of their own dtype as they
    are stored (the products are exact, summed in float32); any other mix is widened to float32 first."""
    if keys.dtype in SIXTEEN_BIT and keys.dtype == q_dtype:
        return jnp.einsum("bhmd,bhnd->bhmn", qh.astype(keys.dtype), keys, preferred_element_type=F32)
    return scores(keys.astype(F32), qh)


def chunk_units(score_rows: int, unit: int) -> int:
    """Units (of ``unit`` keys) per chunk of a long bucket: the most keys, a power of two from
    :data:`SMALLEST_BUCKET` on, whose float32 scores for ``score_rows`` query rows (counted as one where there
    are none) fit :data:`BUCKET_SCORE_BYTES`; at least one unit."""
    keys, rows = SMALLEST_BUCKET, max(score_rows, 1)
    while 2 * keys * rows * 4 <= BUCKET_SCORE_BYTES:
        keys *= 2
    return max(1, keys // unit)


def read_buckets(q: Array, lengths: Array, q_positions: Array, causal: bool, scale: float, prefix: Any, *,
              kv_heads: int, units: int, unit: int = 1) -> tuple[Array, Array]:
    """Dense masked passes over the smallest static bucket holding every row's valid keys.

    ``prefix(first, count)`` gives keys and values ``[first * unit,
    (first + count) * unit)`` head-major (``first`` may be traced; a
    bfloat16 or float16 cache's as stored: ``_softmax.weighted_sum`` reads the
    values unwidened, :func:`_bucket_scores` the keys where the queries
    share their dtype); the cache holds ``units * unit`` keys (``unit``: 1
    dense, the page size paged).  The bucket is picked at run time by
    ``lax.switch``, so the work is at most twice the valid length (and at
    least :data:`SMALLEST_BUCKET`).  A bucket whose ``[B, Hk, T*G, n]``
    float32 scores would pass :data:`BUCKET_SCORE_BYTES` is read in chunks
    that fit, a loop of static length merged by online softmax (so
    ``jax.grad`` works through it, recomputing each chunk's scores rather
    than keeping them).  The scale multiplies the scores, not the keys.
    """
    sizes = buckets(units * unit)
    qh = to_rows(q, kv_heads)
    last = last_visible(lengths, q_positions, causal, q.shape[2] // kv_heads)
    chunk = chunk_units(math.prod(qh.shape[:3]), unit)

    def read(state: Any, first: Any, count: int, seen: Any, n: int) -> Any:
        """Keys ``[first * unit, first * unit + n)`` of the ``count`` units from ``first``; those below ``seen``
        were read before (the last chunk moves back to end inside the cache)."""
        keys, values = (x[:, :, :n] for x in prefix(first, count))
        position = first * unit + lax.broadcasted_iota(jnp.int32, (1, 1, 1, n), 3)
        visible = (position >= seen) & (position <= last)
        return online_update(state, _bucket_scores(q.dtype, qh, keys) * scale, visible, values)

    def branch(n: int) -> Any:
        count = -(-n // unit)

        def attend_prefix() -> tuple[Array, Array, Array]:
            if count <= chunk:
                return read(empty_state(qh), 0, count, 0, n)

            @jax.checkpoint  # a VJP keeps each chunk's state, not its scores
            def step(i: Array, state: Any) -> Any:
                return read(state, jnp.minimum(i * chunk, count - chunk), chunk, i * chunk * unit, chunk * unit)

            return lax.fori_loop(0, -(-count // chunk), step, empty_state(qh))

        return attend_prefix

    needed = jnp.clip(jnp.max(lengths), 0, units * unit)
    index = jnp.sum(needed > jnp.asarray(sizes[:-1], jnp.int32))  # the first bucket that holds them all
    return finish(q, lax.switch(index, [branch(n) for n in sizes]))


def bucketed_append(q: Array, k: Array, v: Array, lengths: Array, q_positions: Array, *, causal: bool,
                     scale: float, k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, Array]:
    """:func:`read_buckets` over a head-major cache ``[B, kv_heads, C, D]`` (its first ``lengths`` slots).

    A quantized cache's bucket is dequantized (its row scales applied) as
    it is read.  Under ``jax.vmap`` over independent caches the slots fold
    into the batch, one bucket for all, or are read slot by slot, each in
    its own bucket, where that is cheaper (``_pooled``).
    """
    cache = {"k": k, "v": v, "lengths": lengths}
    if k_scale is not None:
        cache.update(k_scale=k_scale, v_scale=v_scale)
    kv_heads, capacity = k.shape[1], k.shape[2]

    def read(q: Array, q_positions: Array, cache: dict[str, Array], row: Array | None) -> tuple[Array, Array]:
        rows = None if row is None else (row, q.shape[0])
        lengths = cache["lengths"] if row is None else lax.dynamic_slice_in_dim(cache["lengths"], row, q.shape[0])

        def prefix(first: Any, count: int) -> tuple[Array, Array]:
            keys, values = (key_slice(cache[name], first, count, rows) for name in ("k", "v"))
            if "k_scale" not in cache:
                return keys, values
            k_scale, v_scale = (key_slice(cache[name], first, count, rows) for name in ("k_scale", "v_scale"))
            return keys.astype(F32) * k_scale, values.astype(F32) * v_scale

        return read_buckets(q, lengths, q_positions, causal, scale, prefix, kv_heads=kv_heads, units=capacity)

    return fold_slots(read, functools.partial(cache_blocks, n=BLOCK_SIZE))(q, q_positions, cache)
