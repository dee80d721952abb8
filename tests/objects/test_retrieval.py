"""RetrievalStore: replaces the oldest when full; top-k by dot product over valid entries."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jax_session_state as jss
from tests.support.models import ItemModel, Op, drive

KEY_DIM, CAPACITY, MARGIN = 3, 4, 2


class RetrievalModel(ItemModel):
    def view(self, include_staged):
        entries = self.visible(include_staged)
        return {
            "keys": np.asarray([e[0] for e in entries], np.float32).reshape(-1, KEY_DIM),
            "values": {"a": np.asarray([e[1]["a"] for e in entries], np.float32).reshape(-1, 2)},
        }


def entries(rng, n):
    return (
        jnp.asarray(rng.normal(size=(n, KEY_DIM)), jnp.float32),
        {"a": jnp.asarray(rng.normal(size=(n, 2)), jnp.float32)},
    )


@st.composite
def ops(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(draw(st.integers(1, 14))):
        name = draw(st.sampled_from(["stage", "append", "append", "commit", "discard", "commit_payload"]))
        payload = entries(rng, draw(st.sampled_from([1, 2, 3]))) if name not in ("commit", "discard") else None
        out.append(Op(name, payload))
    return out


def make():
    return jss.RetrievalStore.allocate(capacity=CAPACITY, key_dim=KEY_DIM, value_shapes={"a": (2,)}, max_staged=MARGIN)


class TestRetrievalStoreMatchesModel(chex.TestCase):
    """Against the plain-Python model, eagerly and jitted (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=ops())
    def test_matches_model(self, ops):
        drive(make(), RetrievalModel(capacity=CAPACITY, ring=True, max_staged=MARGIN), ops, self.variant)


retrieve = jax.jit(jss.RetrievalStore.retrieve, static_argnums=2)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 9), k=st.sampled_from([1, 3, CAPACITY + MARGIN]))
def test_retrieve_matches_numpy_top_k(seed, n, k):
    rng = np.random.default_rng(seed)
    bank = make()
    for _ in range(n):
        bank = bank.append(entries(rng, 1))
    query = jnp.asarray(rng.normal(size=(2, KEY_DIM)), jnp.float32)
    hit = retrieve(bank, query, k)
    visible = bank.view().materialize()
    scores = np.asarray(query, np.float64) @ visible["keys"].astype(np.float64).T  # [2, valid]
    for row in range(2):
        order = np.argsort(-scores[row], kind="stable")[:k]
        found = int(np.asarray(hit.valid[row]).sum())
        assert found == min(k, len(order))  # invalid slots never returned while valid ones remain
        scale = np.abs(scores[row]).max(initial=1.0)  # float32 dot products: error relative to the largest
        np.testing.assert_allclose(hit.scores[row, :found], scores[row, order], rtol=1e-5, atol=1e-6 * scale)
        np.testing.assert_allclose(hit.values["a"][row, :found], visible["values"]["a"][order], rtol=0)
        assert np.all(np.isneginf(np.asarray(hit.scores[row, found:])))


def test_view_age_and_validity():
    bank = make()
    for i in range(6):
        bank = bank.append((jnp.full((KEY_DIM,), float(i)), {"a": jnp.full((2,), float(i))}))
    view = bank.view()
    keys = np.asarray(view.keys)[:, 0]
    valid, age = np.asarray(view.valid), np.asarray(view.age)
    assert sorted(keys[valid].tolist()) == [2.0, 3.0, 4.0, 5.0]  # the two oldest were replaced
    for key, a in zip(keys[valid], age[valid]):
        assert a == 5 - key
    assert np.all(age[~valid] == -1)


def test_retrieve_rejects_bad_query():
    with pytest.raises(ValueError, match=r"RetrievalStore\(.*key_dim=3"):
        make().retrieve(jnp.ones((4,)), 1)


@pytest.mark.parametrize(
    ("k", "error", "tail"),
    [
        (0, jss.PayloadError, r"k must be >= 1; got 0\."),
        (7, jss.PayloadError, r"k must lie in \[1, 6\]; got 7\."),  # the bank has CAPACITY + MARGIN = 6 slots
        (True, jss.PayloadTypeError, r"k must be an int >= 1; got True\."),  # a bool is not a count of matches
        (2.0, jss.PayloadTypeError, r"k must be an int >= 1; got 2\.0\."),
        ("2", jss.PayloadTypeError, r"k must be an int >= 1; got '2'\."),
    ],
)
def test_retrieve_tells_a_k_of_the_wrong_type_from_one_out_of_range(k, error, tail):
    with pytest.raises(error, match=rf"^RetrievalStore\(.*\)\.retrieve: {tail}$") as raised:
        make().retrieve(jnp.ones((KEY_DIM,)), k)
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)


def test_retrieve_takes_a_numpy_integer_k():
    bank = make().append(entries(np.random.default_rng(0), 3))
    hit = bank.retrieve(jnp.ones((KEY_DIM,)), np.int64(2))
    assert hit.scores.shape == (2,) and bool(hit.valid.all())
