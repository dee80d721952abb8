"""The online softmax every reader shares: query rows per kv head, a block's update, the normalisation.

Queries are grouped per kv head as rows ``[B, kv_heads, T*G, D]`` (rows
ordered (t, g)); an online-softmax state ``(top, total, acc)`` is updated
block by block (:func:`online_update`) and normalised at the end
(:func:`finish`) into ``(out, lse)`` in the queries' layout.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import Array

F32 = jnp.float32

SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The 16-bit float cache dtypes whose values a dot reads as stored (never widened into a float32 copy)."""

State = tuple[Array, Array, Array]
"""``(top, total, acc)``: the running maximum score, the sum of weights below it and the weighted values."""


def to_rows(x: Array, kv_heads: int) -> Array:
    """``[B, T, q_heads, ...]`` -> float32 ``[B, kv_heads, T*G, ...]``, rows ordered (t, g).

    Only per-query arrays (small) are transposed, never the cache.
    """
    B, T, q_heads = x.shape[:3]
    groups = q_heads // kv_heads
    rows = x.astype(F32).reshape(B, T, kv_heads, groups, *x.shape[3:])
    return jnp.moveaxis(rows, 2, 1).reshape(B, kv_heads, T * groups, *x.shape[3:])


def from_rows(x: Array, T: int) -> Array:
    """The inverse of :func:`to_rows` (float32 kept)."""
    B, kv_heads, M = x.shape[:3]
    rows = x.reshape(B, kv_heads, T, M // T, *x.shape[3:])
    return jnp.moveaxis(rows, 1, 2).reshape(B, T, kv_heads * (M // T), *x.shape[3:])


def finish(q: Array, state: State) -> tuple[Array, Array]:
    """Normalises the online-softmax state into ``(out, lse)`` in q's layout."""
    top, total, acc = state
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(seen, top + jnp.log(safe), -jnp.inf)
    T = q.shape[1]
    return from_rows(out, T).astype(q.dtype), from_rows(lse, T)


def empty_state(qh: Array) -> State:
    """The state of rows ``qh`` before any key: nothing seen."""
    return jnp.full(qh.shape[:3], -jnp.inf, F32), jnp.zeros(qh.shape[:3], F32), jnp.zeros(qh.shape, F32)


def online_update(state: Any, scores: Array, visible: Array, values: Array,
                  value_scale: Array | None = None) -> State:
    """One online-softmax step over a block of ``[B, Hk, M, n]`` scores.

    ``value_scale``: ``[B, Hk, 1, n]`` the row scales of quantized ``values``,
    applied to the weights (``M`` per key) rather than to the values
    (``head_dim`` per key).
    """
    top, total, acc = state
    scores = jnp.where(visible, scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(-1))
    # Rows that have seen nothing keep top = -inf; subtract 0 there (exp(-inf) = 0, not NaN).
    safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)
    weights = jnp.exp(scores - safe_top[..., None])
    decay = jnp.exp(top - safe_top)
    scaled = weights if value_scale is None else weights * value_scale
    return new_top, decay * total + weights.sum(-1), decay[..., None] * acc + weighted_sum(scaled, values)


def weighted_sum(weights: Array, values: Array) -> Array:
    """``weights @ values`` in float32: ``[B, Hk, M, n] x [B, Hk, n, D] -> [B, Hk, M, D]``.

    16-bit float ``values`` (a bucket of a bfloat16 or float16 cache) are
    read as they are stored, never widened into a float32 copy: the float32
    ``weights`` (softmax weights, at most 1) go in as two parts of the
    values' dtype, the nearest one and the rest, stacked on the rows' axis,
    so one dot reads the values once, its products are exact and summed in
    float32, and the two halves' sum carries each weight to 2^-17 of itself
    (bfloat16; float16: 2^-22).
    """
    if values.dtype not in SIXTEEN_BIT:
        return jnp.einsum("bhmn,bhnd->bhmd", weights, values, preferred_element_type=F32)
    high = weights.astype(values.dtype)
    low = (weights - high.astype(F32)).astype(values.dtype)
    both = jnp.einsum("bhmn,bhnd->bhmd", jnp.concatenate([high, low], axis=2), values, preferred_element_type=F32)
    rows = weights.shape[2]
    return both[:, :, :rows] + both[:, :, rows:]


def scores(keys: Array, qh: Array) -> Array:
    """``qh @ keys^T`` in float32: ``[B, Hk, M, D] x [B, Hk, n, D] -> [B, Hk, M, n]``."""
    return jnp.einsum("bhmd,bhnd->bhmn", qh, keys, preferred_element_type=F32)


def last_visible(lengths: Array, q_positions: Array, causal: bool, groups: int) -> Array:
    """The last key each query row sees, ``[B, 1, T*G, 1]`` (rows ordered (t, g))."""
    last = jnp.broadcast_to(lengths[:, None] - 1, q_positions.shape)
    if causal:
        last = jnp.minimum(last, q_positions)
    return jnp.repeat(last, groups, axis=1)[:, None, :, None]


def last_rows(q: Array, lengths: Array, q_positions: Array, causal: bool, kv_heads: int, keys: int) -> Array:
    """:func:`last_visible` as ``Int[Array, "B T*G"]``, of a cache holding ``keys`` keys (the Pallas kernels'
    input)."""
    return last_visible(jnp.minimum(lengths, keys), q_positions, causal, q.shape[2] // kv_heads)[:, 0, :, 0]
