"""A speculative lane's own rows (:class:`BranchKVView`'s ``window``): one masked pass over its few slots.

The lane's prefix is read as the view it is (append-mode or ring) and the
two results merge by log-sum-exp (cascade attention, ``_attend``); under
``jax.vmap`` over lanes the prefix is not batched, so its blocks are read
once for every lane.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from jax_session_state.attention._operands import grouped
from jax_session_state.attention._softmax import F32, empty_state, finish, online_update, scores
from jax_session_state.objects.kv import KVView


def read_lane(q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array) -> tuple[Array, Array]:
    """One masked pass over every slot of a lane's small view, by its ``positions``; ``(out, lse)``."""
    qh, groups, scale = grouped(q, view.k, scale)
    key_position = view.positions[:, None, None, :]  # [B, 1, 1, C]
    query_position = jnp.repeat(q_positions, groups, axis=1)[:, None, :, None]  # [B, 1, M, 1]
    visible = (key_position >= 0) & (key_position < view.lengths[:, None, None, None])
    if causal:
        visible &= key_position <= query_position
    if view.window is not None:
        visible &= (key_position < view.sink) | (query_position - key_position < view.window)
    keys = _dequantize(view.k, view.k_scale, view.k.shape[2])
    values = _dequantize(view.v, view.v_scale, view.v.shape[2])
    return finish(q, online_update(empty_state(qh), scores(keys * scale, qh), visible, values))


def _dequantize(values: Array, scale: Array | None, n: int) -> Array:
    """The first ``n`` slots' values as float32, times their row scales where quantized (fused into the reader)."""
    return values.astype(F32) if scale is None else values.astype(F32) * scale[:, :, :n]
