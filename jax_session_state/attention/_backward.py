"""The flash-attention backward pass, block by block: what the append-mode and paged VJPs share.

With ``P = exp(S - lse)`` over the visible keys: ``dV = P^T dO``,
``dS = P * (dO V^T - rowsum(dO * O) + dlse)``, ``dQ = scale dS K``,
``dK = scale dS^T Q``.  A reader walks its key blocks with
:func:`flash_loop` and adds each block's gradients where its keys lie.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import Array, lax

from jax_session_state.attention._softmax import F32, from_rows, scores, to_rows


def backward_rows(q: Array, kv_heads: int, d_out: Array, d_lse: Array, out: Array, lse: Array) -> tuple[Array, ...]:
    """What every flash backward starts from, in rows ``[B, kv_heads, T*G, ...]``: q, dO, lse and delta.

    ``lse`` is ``+inf`` where a query saw nothing (so ``P = 0`` there);
    ``delta = rowsum(dO * O) - dlse``, both ``[..., 1]``.
    """
    qh, d_rows = to_rows(q, kv_heads), to_rows(d_out, kv_heads)
    lse_rows = to_rows(lse, kv_heads)
    lse_rows = jnp.where(jnp.isneginf(lse_rows), jnp.inf, lse_rows)[..., None]
    delta = (jnp.sum(d_rows * to_rows(out, kv_heads), -1) - to_rows(d_lse, kv_heads))[..., None]
    return qh, d_rows, lse_rows, delta


def flash_block_grads(grads: tuple[Array, Array, Array], keys: Array, values: Array, visible: Array, qh: Array,
                      rows: tuple[Array, Array, Array], scale: float, add: Any) -> tuple[Array, Array, Array]:
    """One key block's step of a flash backward: ``P`` and ``dS`` of the block, ``dQ`` summed, and ``dK``,
    ``dV`` added into their gradients by ``add(grad, block)`` (where the block's keys lie).

    ``rows`` is ``(dO, lse, delta)`` from :func:`backward_rows`.
    """
    dq, dk, dv = grads
    d_rows, lse_rows, delta = rows
    p = jnp.where(visible, jnp.exp(scores(keys, qh) * scale - lse_rows), 0.0)
    ds = p * (jnp.einsum("bhmd,bhnd->bhmn", d_rows, values) - delta) * scale
    return (dq + jnp.einsum("bhmn,bhnd->bhmd", ds, keys), add(dk, jnp.einsum("bhmn,bhmd->bhnd", ds, qh)),
            add(dv, jnp.einsum("bhmn,bhmd->bhnd", p, d_rows)))


def flash_loop(q: Array, qh: Array, k: Array, v: Array, blocks: Array, body: Any) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)``: ``body(i, grads)`` over ``blocks`` key blocks from zeros, cast to the operands' dtypes."""
    zeros = (jnp.zeros_like(qh), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    dq, dk, dv = lax.fori_loop(0, blocks, body, zeros)
    return from_rows(dq, q.shape[1]).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
