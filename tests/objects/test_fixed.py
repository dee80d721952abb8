"""FixedState: exact-spec commits, a staged value beside the committed one, eviction rules."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jax_session_state as jss
from tests.support.devices import DEVICE
from tests.support.models import OK, Op, drive

SPEC = {"h": (2, 5), "conv": jax.ShapeDtypeStruct((2, 3), jnp.int32)}


class FixedModel:
    def __init__(self, value):
        self.value, self.staged, self.overflowed = value, None, False

    def apply(self, op):
        if op.name == "stage":
            self.staged = op.payload
        elif op.name in ("commit_payload", "append"):
            self.value, self.staged = op.payload, None
        elif op.name == "commit":
            self.value, self.staged = self.staged if self.staged is not None else self.value, None
        else:
            self.staged = None
        return OK

    def view(self, include_staged):
        value = self.staged if include_staged and self.staged is not None else self.value
        return jax.tree_util.tree_map(np.asarray, value)


@st.composite
def ops(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(draw(st.integers(1, 10))):
        name = draw(st.sampled_from(["stage", "append", "commit", "discard", "commit_payload"]))
        payload = {
            "h": jnp.asarray(rng.normal(size=(2, 5)), jnp.float32),
            "conv": jnp.asarray(rng.integers(-9, 9, size=(2, 3)), jnp.int32),
        }
        out.append(Op(name, payload if name not in ("commit", "discard") else None))
    return out


class TestFixedStateMatchesModel(chex.TestCase):
    """Against the plain-Python model, eagerly and jitted (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=ops())
    def test_matches_model(self, ops):
        state = jss.FixedState.allocate(shapes=SPEC)
        zeros = {"h": np.zeros((2, 5), np.float32), "conv": np.zeros((2, 3), np.int32)}
        drive(state, FixedModel(zeros), ops, self.variant)


def test_allocate_from_shapes_dtypes_and_specs():
    state = jss.FixedState.allocate(shapes={"a": (3,), "b": jax.ShapeDtypeStruct((2, 2), jnp.bfloat16)}, dtype=jnp.int8)
    value = state.view()
    assert value["a"].dtype == jnp.int8 and value["b"].dtype == jnp.bfloat16 and value["b"].shape == (2, 2)
    like = jss.FixedState.allocate(shapes=jax.eval_shape(lambda: {"c": jnp.zeros((4,), jnp.float16)}))
    assert like.view()["c"].dtype == jnp.float16


@pytest.mark.parametrize(
    "payload, error, match",
    [
        ({"h": jnp.zeros((2, 5))}, TypeError, "pytree structure"),
        ({"h": jnp.zeros((2, 5)), "conv": jnp.zeros((2, 3), jnp.float32)}, TypeError, "dtype int32; got .*float32"),
        ({"h": jnp.zeros((2, 6)), "conv": jnp.zeros((2, 3), jnp.int32)}, ValueError, r"shape \[2, 5\]"),
        ((jnp.zeros((2, 5)), jnp.zeros((2, 3), jnp.int32)), TypeError, "pytree structure"),
    ],
)
def test_commit_must_match_exactly(payload, error, match):
    state = jss.FixedState.allocate(shapes=SPEC)
    for method in (state.commit, state.stage, state.append):
        with pytest.raises(error, match=match) as raised:
            method(payload)
        assert "FixedState(" in str(raised.value)


def test_not_evictable_without_a_recompute_source():
    state = jss.FixedState.allocate(shapes=(2, 3))
    with pytest.raises(jss.NotEvictableError, match=r"FixedState\(float32\[2, 3\]\) cannot be evicted"):
        state.evict()
    assert state.resident  # refused: nothing released
    evictable = jss.FixedState.allocate(shapes=(2, 3), recompute_source="prompt")
    gone, freed = evictable.evict()
    assert freed == evictable.nbytes and not gone.resident


def test_staged_bytes_are_reported():
    state = jss.FixedState.allocate(shapes=(4, 4))
    assert state.staged_nbytes_by_device() == {DEVICE: 64}
    assert state.nbytes == 2 * 64 + 1  # committed value, staged slot, flag


def test_a_typed_prng_key_is_committed_staged_and_discarded_like_any_leaf():
    state = jss.FixedState.allocate(shapes={"rng": jax.random.key(0), "h": (3,)})
    assert state.describe() == "FixedState({'h': 'float32[3]', 'rng': 'key<fry>[]'})"
    data = lambda s: np.asarray(jax.random.key_data(s.view()["rng"]))  # noqa: E731
    h = jax.random.normal(jax.random.key(1), (3,))
    state = state.commit({"rng": jax.random.key(7), "h": h})
    np.testing.assert_array_equal(data(state), jax.random.key_data(jax.random.key(7)))
    np.testing.assert_array_equal(state.view()["h"], h)

    @chex.assert_max_traces(n=1)
    def step(s, key):
        return s.commit({"rng": jax.random.split(key)[0], "h": s.view()["h"] + 1})

    jitted = jax.jit(step, donate_argnums=0)
    for seed in (2, 3):
        key = jax.random.key(seed)
        state = jitted(state, key)
        np.testing.assert_array_equal(data(state), jax.random.key_data(jax.random.split(key)[0]))
    np.testing.assert_allclose(state.view()["h"], h + 2)
    discarded = state.stage({"rng": jax.random.key(9), "h": h}).discard()
    np.testing.assert_array_equal(data(discarded), data(state))
    with pytest.raises(jss.PayloadTypeError, match=r"FixedState\(.*key<fry>.*\)\.commit: .*dtype key<rbg>"):
        state.commit({"rng": jax.random.key(1, impl="rbg"), "h": h})
    with pytest.raises(jss.PayloadError, match=r"dtype key<fry>; got shape \[2\] and dtype uint32"):
        state.commit({"rng": jnp.ones(2, jnp.uint32), "h": h})
