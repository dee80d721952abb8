"""Ring prefill: an append longer than the ring keeps its sinks and last rows in one call.

Against the plain-Python model of the ring (``tests.support.models.KVModel``,
which holds every position and shows the sinks and the last ``window`` (+
staging margin) ones), and against the same rows appended one chunk at a
time (chunked prefill).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from tests.support.models import KVModel, Op, drive

B, H, D = 2, 2, 4
WINDOW, MAX_STAGED = 5, 3


def ring(sink, batch=B):
    return jss.KVCache.allocate(batch=batch, kv_heads=H, head_dim=D, window=WINDOW, sink=sink, max_staged=MAX_STAGED)


def prefill_chunk(draw, rng):
    """Rows of a length within the staging margin, past it, or past the whole ring; ragged half of the time."""
    T = draw(st.sampled_from((2, 7, 19)))
    k, v = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for _ in range(2))
    counts = jnp.asarray([draw(st.integers(0, T)) for _ in range(B)], jnp.int32) if draw(st.booleans()) else None
    return jss.KVChunk(k, v, counts)


@st.composite
def prefill_ops(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    names = draw(st.lists(st.sampled_from(["append", "append", "commit_payload", "stage", "commit", "discard"]),
                          min_size=1, max_size=8))
    return [Op(name) if name in ("commit", "discard") else Op(name, prefill_chunk(draw, rng)) for name in names]


class TestRingPrefillMatchesModel(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @settings(deadline=None, max_examples=30)
    @given(ops=prefill_ops(), sink=st.sampled_from([0, 2]))
    def test_long_appends_match_the_model(self, ops, sink):
        model = KVModel(B, window=WINDOW, sink=sink, max_staged=MAX_STAGED, heads=H, head_dim=D)
        drive(ring(sink), model, ops, self.variant)


@pytest.mark.parametrize("sink", [0, 2])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_one_long_append_leaves_what_a_chunked_prefill_leaves(sink, jitted):
    rng = np.random.default_rng(sink)
    T = 23
    k, v = (jnp.asarray(rng.normal(size=(B, 3, T, H, D)), jnp.float32) for _ in range(2))
    append = jax.jit(lambda c, k, v: c.append((k, v))) if jitted else (lambda c, k, v: c.append((k, v)))
    whole = append(ring(sink, (B, 3)), k, v)
    chunked = ring(sink, (B, 3))
    for start in range(0, T, MAX_STAGED):
        chunked = append(chunked, k[:, :, start:start + MAX_STAGED], v[:, :, start:start + MAX_STAGED])
    for name in ("k", "v", "bookkeeping"):
        np.testing.assert_array_equal(np.asarray(getattr(whole, name)), np.asarray(getattr(chunked, name)))
    rows = whole.view(include_staged=False).materialize()
    want = [p for p in range(T) if p < sink or p >= T - WINDOW]
    for b, row in enumerate(rows):  # the sinks from the first rows, the last window rows
        assert row["positions"].tolist() == want
        np.testing.assert_array_equal(row["k"], np.asarray(k).reshape(B * 3, T, H, D)[b, want])


def test_a_long_append_is_donated_in_place_and_compiles_once():
    cache = ring(2)

    @chex.assert_max_traces(n=1)
    def prefill(cache, k, v):
        return cache.append((k, v))

    donated = jax.jit(prefill, donate_argnums=0)
    rng = np.random.default_rng(3)
    for _ in range(2):
        k, v = (jnp.asarray(rng.normal(size=(B, 17, H, D)), jnp.float32) for _ in range(2))
        before = cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()
        cache = donated(cache, k, v)
        assert (cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()) == before
    assert np.asarray(cache.committed).tolist() == [34, 34]


def test_staging_past_the_margin_is_still_refused_and_says_append_takes_any_length():
    k = jnp.ones((B, MAX_STAGED + 1, H, D))
    with pytest.raises(jss.CapacityError, match=r"max_staged 3 rows staged between commits \(append takes any"):
        ring(0).stage((k, k))
