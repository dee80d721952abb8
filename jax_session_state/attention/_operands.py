"""The operands of a read: checks against the view, the score scale, and the query positions.

Query positions are absolute, or (``relative``) offsets from each row's
length: the last ``T`` positions as ``-T..-1``, a constant, so a native
step computes no positions (the kernel adds the lengths).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import Array

from jax_session_state.attention._softmax import to_rows
from jax_session_state.errors import PayloadError


def checked_scale(q: Array, k: Array, scale: float | None) -> tuple[int, float]:
    """Checks q against the view's head-major ``k``; returns the query heads per kv head and the scale."""
    view_batch, kv_heads, _, view_dim = k.shape
    return checked(q, view_batch, kv_heads, view_dim, scale)


def checked(q: Array, view_batch: int, kv_heads: int, view_dim: int, scale: float | None) -> tuple[int, float]:
    """Checks q against a view of this batch, kv heads and head dim; returns the query heads per kv head and the
    scale (default ``1 / sqrt(head_dim)``).

    Raises:
      PayloadError: the batch or head dim differs, or the query heads are not a multiple of the kv heads.
    """
    B, _, q_heads, D = q.shape
    if B != view_batch:
        raise PayloadError(f"attend(): q has batch {B} but the view has batch {view_batch}.")
    if D != view_dim:
        raise PayloadError(f"attend(): q has head_dim {D} but the view has head_dim {view_dim}.")
    if q_heads % kv_heads:
        raise PayloadError(f"attend(): q_heads={q_heads} is not a multiple of the view's kv_heads={kv_heads}.")
    return q_heads // kv_heads, 1.0 / math.sqrt(D) if scale is None else scale


def grouped(q: Array, k: Array, scale: float | None) -> tuple[Array, int, float]:
    """:func:`checked_scale`, and q as ``[B, kv_heads, T*G, D]`` float32."""
    groups, scale = checked_scale(q, k, scale)
    return to_rows(q, k.shape[1]), groups, scale


def default_positions(q: Array, lengths: Array, q_positions: Array | None) -> Array:
    """``q_positions`` as int32, checked to be ``[batch, T]``; by default each row's last ``T`` positions.

    Raises:
      PayloadError: ``q_positions`` is not ``[batch, T]``.
    """
    batch, T = q.shape[:2]
    if q_positions is None:
        return lengths[:, None].astype(jnp.int32) - T + jnp.arange(T, dtype=jnp.int32)
    if q_positions.shape != (batch, T):
        raise PayloadError(
            f"attend(): q_positions must have shape [{batch}, {T}] (batch, T); got {list(q_positions.shape)}."
        )
    return q_positions.astype(jnp.int32)


def relative_offsets(q: Array) -> Array:
    """The last T positions as offsets from each row's length: a constant (the kernel adds the lengths)."""
    B, T = q.shape[:2]
    return jnp.asarray(np.broadcast_to(np.arange(-T, 0, dtype=np.int32), (B, T)))


def query_positions(q: Array, lengths: Array, q_positions: Array | None, relative: bool) -> Array:
    """:func:`relative_offsets` where ``relative`` (the caller has ``q_positions`` None), else
    :func:`default_positions`."""
    return relative_offsets(q) if relative else default_positions(q, lengths, q_positions)


def absolute(lengths: Array, q_positions: Array, relative: bool) -> Array:
    """Query positions, given as they are or (``relative``) as offsets from each row's length."""
    return lengths[:, None] + q_positions if relative else q_positions
