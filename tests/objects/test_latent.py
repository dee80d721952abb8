"""LatentBuffer: ring and bounded append, one item or several, oldest to newest."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jax_session_state as jss
from tests.support.models import ItemModel, Op, drive

ITEM = (2, 3)


class LatentModel(ItemModel):
    def view(self, include_staged):
        items = self.visible(include_staged)
        return np.asarray(items, np.float32).reshape(len(items), *ITEM)


@st.composite
def ops(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(draw(st.integers(1, 16))):
        name = draw(st.sampled_from(["stage", "stage", "append", "commit", "discard", "commit_payload"]))
        if name in ("commit", "discard"):
            out.append(Op(name))
            continue
        shape = draw(st.sampled_from([ITEM, (1, *ITEM), (3, *ITEM)]))
        out.append(Op(name, jnp.asarray(rng.normal(size=shape), jnp.float32)))
    return out


class TestLatentBufferMatchesModel(chex.TestCase):
    """Against the plain-Python model, eagerly and jitted (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=ops(), ring=st.booleans())
    def test_matches_model(self, ops, ring):
        kwargs = {"ring": True, "max_staged": 3} if ring else {}
        buffer = jss.LatentBuffer.allocate(capacity=5, item_shape=ITEM, **kwargs)
        model = LatentModel(capacity=5, ring=ring, max_staged=3, single_rank=len(ITEM))
        drive(buffer, model, ops, self.variant)


def test_bounded_buffer_refuses_past_capacity():
    buffer = jss.LatentBuffer.allocate(capacity=2, item_shape=(1,)).append(jnp.ones((2, 1)))
    with pytest.raises(jss.CapacityError, match=r"LatentBuffer\(.*exceeds capacity 2"):
        buffer.append(jnp.ones((1,)))
    flagged = jax.jit(lambda b: b.append(jnp.ones((1,))))(buffer)
    assert bool(flagged.overflowed) and int(flagged.view().count) == 2


def test_ring_stage_beyond_margin_is_refused():
    buffer = jss.LatentBuffer.allocate(capacity=3, item_shape=(1,), ring=True, max_staged=1)
    with pytest.raises(jss.CapacityError, match="max_staged 1"):
        buffer.stage(jnp.ones((2, 1)))


def test_wrong_item_shape_names_the_object():
    buffer = jss.LatentBuffer.allocate(capacity=3, item_shape=(2,))
    with pytest.raises(ValueError, match=r"LatentBuffer\(.*items leaf 0 must have shape \[n, 2\]"):
        buffer.append(jnp.ones((3, 3)))


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "append"])
@pytest.mark.parametrize(
    ("size", "error", "tail"),
    [
        (0, jss.PayloadError, r"size must be >= 1; got 0\."),
        (True, jss.PayloadTypeError, r"size must be an int >= 1; got True\."),  # a bool is not a count of items
        (2.0, jss.PayloadTypeError, r"size must be an int >= 1; got 2\.0\."),
        ("2", jss.PayloadTypeError, r"size must be an int >= 1; got '2'\."),  # told before the ring's bound
    ],
)
def test_branch_window_tells_a_size_of_the_wrong_type_from_one_out_of_range(ring, size, error, tail):
    buffer = jss.LatentBuffer.allocate(capacity=3, item_shape=(1,), ring=ring, max_staged=1 if ring else 0)
    with pytest.raises(error, match=rf"^LatentBuffer\(.*\)\.branch_window: {tail}$") as raised:
        buffer.branch_window(size)
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)


def test_branch_window_takes_a_numpy_integer_size_and_bounds_a_ring():
    ring = jss.LatentBuffer.allocate(capacity=3, item_shape=(1,), ring=True, max_staged=1)
    assert ring.branch_window(np.int64(2)).capacity == 2
    message = r"^LatentBuffer\(.*\): a lane window of 5 items exceeds the ring's 4 slots\.$"
    with pytest.raises(jss.PayloadError, match=message):
        ring.branch_window(5)


NOT_A_SHAPE = r"item_shape must be a tuple of ints, the shape of one item \(\(n,\) for n values\); got "


@pytest.mark.parametrize(
    ("item_shape", "error", "tail"),
    [
        (2, jss.PayloadTypeError, NOT_A_SHAPE + r"2\."),
        ("ab", jss.PayloadTypeError, NOT_A_SHAPE + r"'ab'\."),
        ((2.0,), jss.PayloadTypeError, r"item_shape must be an int >= 0; got 2\.0\."),
        ((2, -1), jss.PayloadError, r"item_shape must be >= 0; got -1\."),
    ],
)
def test_allocate_names_an_item_shape_that_is_not_a_shape(item_shape, error, tail):
    with pytest.raises(error, match=rf"^LatentBuffer\.allocate: {tail}$"):
        jss.LatentBuffer.allocate(capacity=3, item_shape=item_shape)


def test_allocate_takes_an_item_shape_as_a_tuple_or_a_list():
    assert jss.LatentBuffer.allocate(capacity=3, item_shape=[2, 1]).item_shape == (2, 1)
    assert jss.LatentBuffer.allocate(capacity=3, item_shape=()).view().items.shape == (3,)
