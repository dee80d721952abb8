"""EncodeOnceKV: written once; later writes are no-ops; staging is discardable."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jax_session_state as jss
from tests.support.models import OK, REFUSED_CAPACITY, REFUSED_COUNTS, Op, drive

B, H, D, LENGTH = 2, 2, 3, 6


class EncodeOnceModel:
    def __init__(self):
        self.rows, self.lengths = None, None
        self.written = self.staged = self.overflowed = False

    def apply(self, op):
        if op.name in ("stage", "commit_payload", "append"):
            k, v, counts = op.payload.k, op.payload.v, op.payload.counts
            T = k.shape[1]
            counts = [T] * B if counts is None else list(np.asarray(counts))
            if any(c < 0 or c > T for c in counts):
                return REFUSED_COUNTS
            if any(c > LENGTH for c in counts):  # rows past the capacity are padding only while no count reaches them
                return REFUSED_CAPACITY
            if not self.written:
                self.rows = (np.asarray(k), np.asarray(v))
                self.lengths, self.staged = counts, True
            if op.name == "stage":
                return OK
        if op.name == "discard":
            self.staged = False
        else:
            self.written, self.staged = self.written or self.staged, False
        return OK

    def view(self, include_staged):
        shown = self.written or (self.staged and include_staged)
        out = []
        for b in range(B):
            n = self.lengths[b] if shown else 0
            k = self.rows[0][b, :n] if shown else np.zeros((0, H, D), np.float32)
            v = self.rows[1][b, :n] if shown else np.zeros((0, H, D), np.float32)
            out.append({"positions": np.arange(n, dtype=np.int32), "k": k, "v": v})
        return out


@st.composite
def ops(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(draw(st.integers(1, 8))):
        name = draw(st.sampled_from(["stage", "append", "commit", "discard", "commit_payload"]))
        if name in ("commit", "discard"):
            out.append(Op(name))
            continue
        T = draw(st.sampled_from([2, LENGTH, LENGTH + 2]))
        k, v = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for _ in range(2))
        counts = draw(st.sampled_from([None, "ragged", "bad"]))
        if counts == "ragged":
            counts = jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32)
        elif counts == "bad":
            counts = jnp.asarray([T + 1, 0], jnp.int32)
        out.append(Op(name, jss.KVChunk(k, v, counts)))
    return out


class TestEncodeOnceKVMatchesModel(chex.TestCase):
    """Against the plain-Python model, eagerly and jitted (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=ops())
    def test_matches_model(self, ops):
        cond = jss.EncodeOnceKV.allocate(batch=B, kv_heads=H, head_dim=D, capacity=LENGTH)
        drive(cond, EncodeOnceModel(), ops, self.variant)


def test_second_commit_is_a_no_op_under_jit():
    cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    step = jax.jit(lambda c, x: c.commit((x, x)), donate_argnums=0)
    cond = step(cond, jnp.ones((1, 3, 1, 2)))
    cond = step(cond, jnp.full((1, 3, 1, 2), 7.0))
    assert bool(cond.written)
    (row,) = cond.view().materialize()
    np.testing.assert_array_equal(row["k"], np.ones((3, 1, 2)))


def test_more_tokens_than_capacity_is_a_capacity_error():
    cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 1, 2)), jnp.float32)
    with pytest.raises(jss.CapacityError, match=r"EncodeOnceKV\(.*\[5\] conditioning tokens exceed capacity 4"):
        cond.stage((rows, rows))
    assert not bool(cond.overflowed) and int(cond.lengths[0]) == 0

    # Under jit the write is refused and flagged; jss.check raises as for every kind.
    refused = jax.jit(lambda c, k: c.commit((k, k)))(cond, rows)
    assert bool(refused.overflowed) and not bool(refused.written) and int(refused.lengths[0]) == 0
    np.testing.assert_array_equal(refused.k, np.zeros_like(refused.k))
    with pytest.raises(jss.CapacityError):
        jss.check({"cond": refused})

    # Rows past the capacity are padding where no row's count reaches them.
    padded = cond.commit((rows, rows, jnp.array([4], jnp.int32)))
    (row,) = padded.view().materialize()
    np.testing.assert_array_equal(row["k"], np.asarray(rows[0, :4]))
