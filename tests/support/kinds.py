"""Factories and payload generators of every kind, shared by the tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jax_session_state as jss

B, H, D = 2, 3, 4


def kv_payload(rng: np.random.Generator, T: int = 5, dtype=jnp.float32) -> jss.KVChunk:
    k = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    v = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    return jss.KVChunk(k, v)


def batch_axes_kv_payload(rng: np.random.Generator, T: int = 5) -> jss.KVChunk:
    """A ragged chunk for a cache of batch shape ``(1, B)``: ``[1, B, T, heads, dim]``."""
    k, v, counts = ragged_kv_payload(rng, T)[:3]
    return jss.KVChunk(k[None], v[None], counts[None])


def ragged_kv_payload(rng: np.random.Generator, T: int = 5) -> jss.KVChunk:
    k, v = kv_payload(rng, T)[:2]
    return jss.KVChunk(k, v, jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32))


KINDS = {
    "kv_append": (
        lambda: jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=64),
        ragged_kv_payload,
    ),
    "kv_ring": (
        lambda: jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=6, sink=2, max_staged=5),
        ragged_kv_payload,
    ),
    "kv_int8": (
        lambda: jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=64, quantize="int8"),
        ragged_kv_payload,
    ),
    "kv_ring_fp8": (
        lambda: jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=6, sink=2, max_staged=5, quantize="fp8"),
        ragged_kv_payload,
    ),
    "kv_ring_batch_axes": (
        lambda: jss.KVCache.allocate(batch=(1, B), kv_heads=H, head_dim=D, window=6, sink=2, max_staged=5),
        batch_axes_kv_payload,
    ),
    "encode_once": (
        lambda: jss.EncodeOnceKV.allocate(batch=B, kv_heads=H, head_dim=D, capacity=8),
        kv_payload,
    ),
    "fixed": (
        lambda: jss.FixedState.allocate(shapes={"h": (B, 6), "conv": (B, 3, 6)}),
        lambda rng: {
            "conv": jnp.asarray(rng.normal(size=(B, 3, 6)), jnp.float32),
            "h": jnp.asarray(rng.normal(size=(B, 6)), jnp.float32),
        },
    ),
    "fixed_evictable": (
        lambda: jss.FixedState.allocate(shapes=(B, 6), recompute_source="prompt"),
        lambda rng: jnp.asarray(rng.normal(size=(B, 6)), jnp.float32),
    ),
    "latent_bounded": (
        lambda: jss.LatentBuffer.allocate(capacity=200, item_shape=(3, 2)),
        lambda rng: jnp.asarray(rng.normal(size=(2, 3, 2)), jnp.float32),
    ),
    "latent_ring": (
        lambda: jss.LatentBuffer.allocate(capacity=5, item_shape=(3, 2), ring=True, max_staged=2),
        lambda rng: jnp.asarray(rng.normal(size=(2, 3, 2)), jnp.float32),
    ),
    "paged": (
        lambda: jss.PagedKVCache.allocate(
            max_slots=B, kv_heads=H, head_dim=D, page_size=4, num_pages=24, max_pages_per_slot=16
        ),
        ragged_kv_payload,
    ),
    "paged_batch_axes": (
        lambda: jss.PagedKVCache.allocate(
            max_slots=(1, B), kv_heads=H, head_dim=D, page_size=4, num_pages=24, max_pages_per_slot=16
        ),
        batch_axes_kv_payload,
    ),
    "paged_int8": (
        lambda: jss.PagedKVCache.allocate(
            max_slots=B, kv_heads=H, head_dim=D, page_size=4, num_pages=24, max_pages_per_slot=16, quantize="int8"
        ),
        ragged_kv_payload,
    ),
    "paged_fp8_bf16": (
        lambda: jss.PagedKVCache.allocate(
            max_slots=B, kv_heads=H, head_dim=D, page_size=4, num_pages=24, max_pages_per_slot=16,
            dtype=jnp.bfloat16, quantize="fp8",
        ),
        lambda rng: jss.KVChunk(*(jnp.asarray(x, jnp.bfloat16) for x in ragged_kv_payload(rng)[:2]),
                                ragged_kv_payload(rng).counts),
    ),
    "retrieval": (
        lambda: jss.RetrievalStore.allocate(
            capacity=6, key_dim=4, value_shapes={"a": (2,), "b": (3,)}, max_staged=3
        ),
        lambda rng: (
            jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
            {
                "a": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
                "b": jnp.asarray(rng.normal(size=(3, 3)), jnp.float32),
            },
        ),
    ),
}
