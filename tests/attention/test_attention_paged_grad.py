"""Gradients of attention over a PagedView (native paged kernel and page loop) against float64 finite differences."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from tests.support.attention_reference import central_difference, reference

SLOTS, KV_HEADS, GROUPS, D, PAGE = 3, 2, 2, 8, 4


def forked_cache(rng):
    """Ragged random rows in a paged cache, slot 2 a fork of slot 0 (its full pages shared) grown on its own."""
    cache = jss.PagedKVCache.allocate(max_slots=SLOTS, kv_heads=KV_HEADS, head_dim=D, page_size=PAGE, num_pages=40)
    k, v = (jnp.asarray(rng.standard_normal((SLOTS, 30, KV_HEADS, D)), jnp.float32) for _ in range(2))
    cache = cache.append(jss.KVChunk(k, v, jnp.asarray([30, 9, 0], jnp.int32))).fork(0, 2)
    k, v = (jnp.asarray(rng.standard_normal((SLOTS, 6, KV_HEADS, D)), jnp.float32) for _ in range(2))
    return cache.append(jss.KVChunk(k, v, jnp.asarray([0, 3, 6], jnp.int32)))


def loss_weights(rng, T):
    return (rng.standard_normal((SLOTS, T, KV_HEADS * GROUPS, D)), rng.standard_normal((SLOTS, T, KV_HEADS * GROUPS)))


def reference_loss(q, k_pages, v_pages, table, lengths, q_positions, weights):
    """``sum(out * w) + sum(lse * w_lse)`` of float64 attention over each slot's pages, read through its table."""
    rows = table.shape[1] * PAGE
    ids = np.maximum(table, 0)
    gather = lambda pool: pool[ids].reshape(SLOTS, rows, KV_HEADS, D).transpose(0, 2, 1, 3)  # noqa: E731
    positions = np.where(np.arange(rows) < lengths[:, None], np.arange(rows), -1)
    out, lse = reference(q, gather(k_pages), gather(v_pages), lengths, positions, q_positions=q_positions)
    return np.sum(out * weights[0]) + np.sum(np.where(np.isfinite(lse), lse * weights[1], 0.0))


@pytest.mark.parametrize("implementation", ["auto", "loop"])
@pytest.mark.parametrize("T, explicit_positions", [(1, False), (3, False), (3, True)])
def test_grad_through_paged_attention_matches_float64_finite_differences(implementation, T, explicit_positions):
    if implementation == "auto" and not _library.enabled():
        pytest.skip(f"the native kernel is not in use: {_library.status()}")
    rng = np.random.default_rng(T + 10 * explicit_positions)
    cache = forked_cache(rng)
    view = cache.view()
    table, lengths = np.asarray(view.page_table), np.asarray(view.lengths)
    q = rng.standard_normal((SLOTS, T, KV_HEADS * GROUPS, D)).astype(np.float32)
    q_positions = (np.minimum(lengths[:, None] - 1, rng.integers(0, 40, (SLOTS, T))).astype(np.int32)
                   if explicit_positions else None)
    weights = loss_weights(rng, T)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def grads(q, k_pages, v_pages, view):  # lengths and tables traced: one compile for every length
        def loss(q, k_pages, v_pages):
            paged = view.replace(k_pages=k_pages, v_pages=v_pages)
            positions = None if q_positions is None else jnp.asarray(q_positions)
            out, lse = jss.attend_with_lse(q, paged, q_positions=positions, implementation=implementation)
            return jnp.sum(out * weights[0]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * weights[1], 0.0))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k_pages, v_pages)

    got = grads(jnp.asarray(q), view.k_pages, view.v_pages, view)
    point = [np.asarray(x, np.float64) for x in (q, view.k_pages, view.v_pages)]
    f = lambda x: reference_loss(*x, table, lengths, q_positions, weights)  # noqa: E731
    for _ in range(4):  # directional derivatives along random directions of every input
        direction = [rng.standard_normal(x.shape) for x in point]
        numeric = central_difference(f, point, direction)
        analytic = sum(np.sum(np.asarray(g, np.float64) * d) for g, d in zip(got, direction))
        assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), (analytic, numeric)
    # A shared page sums both slots' gradients; pages no slot reads get none.
    read = np.unique(table[table >= 0])
    unread = np.setdiff1d(np.arange(view.k_pages.shape[0]), read)
    assert np.all(np.asarray(got[1])[unread] == 0) and np.all(np.asarray(got[2])[unread] == 0)
    assert np.abs(np.asarray(got[2])[table[0, 0]]).sum() > 0
    grads(jnp.asarray(q), view.k_pages, view.v_pages, view.replace(lengths=view.lengths - 1))  # no new trace
