"""Speculative branches: lanes over one shared prefix, adopt, discard, memory."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from jax_session_state.testing import assert_logically_equal

B, H, D = 1, 2, 3


def make_session(*, ring=False):
    kv = (
        jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=6, sink=2, max_staged=3)
        if ring
        else jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=64)
    )
    return jss.Session(
        objects={
            "kv": kv,
            "frames": jss.LatentBuffer.allocate(capacity=4, item_shape=(2,), ring=True, max_staged=1),
            "carry": jss.FixedState.allocate(shapes=(B, 3)),
            "cond": jss.EncodeOnceKV.allocate(batch=B, kv_heads=H, head_dim=D, capacity=4),
        },
        attrs={"rng": jax.random.key(0), "step": jnp.int32(0)},
    )


def lane_data(rng, lanes, chunks, T=3):
    return {
        "k": jnp.asarray(rng.normal(size=(lanes, chunks, B, T, H, D)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(lanes, chunks, B, T, H, D)), jnp.float32),
        "frames": jnp.asarray(rng.normal(size=(lanes, chunks, 2)), jnp.float32),
        "carry": jnp.asarray(rng.normal(size=(lanes, chunks, B, 3)), jnp.float32),
    }


def roll(lane, data):
    """One lane's rollout: several chunks staged one after another."""
    for c in range(data["k"].shape[0]):
        lane = lane.stage(kv=(data["k"][c], data["v"][c]), frames=data["frames"][c], carry=data["carry"][c])
    key, _ = jax.random.split(lane.attrs["rng"])
    return lane.with_attrs(rng=key, step=lane.attrs["step"] + 1), data["carry"][-1].sum()


def sequential(session, data, lane):
    """What adopting ``lane`` must equal: its writes appended to the session one by one."""
    for c in range(data["k"].shape[1]):
        kv = (data["k"][lane, c], data["v"][lane, c])
        session = session.append(kv=kv, frames=data["frames"][lane, c], carry=data["carry"][lane, c])
    return session


@jax.jit
def branch_and_roll(session, data):
    return session.branch(4, window={"kv": 6, "frames": 2}).map(roll, data)[0]


append_prefix = jax.jit(lambda s, k, v, frame: s.append(kv=(k, v), frames=frame))


@pytest.mark.parametrize("ring", [False, True], ids=["append", "ring"])
@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), prefix_chunks=st.integers(0, 5), lane=st.integers(0, 3))
def test_adopt_equals_appending_the_lane(ring, seed, prefix_chunks, lane):
    rng = np.random.default_rng(seed)
    session = make_session(ring=ring)
    for c in range(prefix_chunks):
        k, v = (jnp.asarray(rng.normal(size=(B, 3, H, D)), jnp.float32) for _ in "kv")
        session = append_prefix(session, k, v, jnp.full((2,), float(c)))
    data = lane_data(rng, 4, 2)
    branches = branch_and_roll(session, data)
    adopted = branches.adopt(lane)
    assert_logically_equal(adopted.view(), sequential(session, data, lane).view(), "adopt")
    # The lane saw what the adopted session shows (a ring's lane also still sees
    # the prefix's window as it was before the lane's rows).
    seen, kept = branches.lane(lane).view(), adopted.view()
    assert_logically_equal(seen["frames"], kept["frames"], "lane view")
    (seen_kv,), (kept_kv,) = seen["kv"].materialize(), kept["kv"].materialize()
    shown = np.isin(seen_kv["positions"], kept_kv["positions"])
    assert shown.sum() == len(kept_kv["positions"])
    np.testing.assert_array_equal(seen_kv["k"][shown], kept_kv["k"])
    np.testing.assert_array_equal(seen_kv["v"][shown], kept_kv["v"])
    if not ring:
        np.testing.assert_array_equal(seen_kv["positions"], kept_kv["positions"])


def test_lanes_are_independent_and_the_prefix_untouched():
    rng = np.random.default_rng(0)
    session = make_session()
    data = lane_data(rng, 3, 1)
    branches, scores = session.branch(3, window=4).map(roll, data)
    np.testing.assert_allclose(scores, data["carry"][:, -1].sum(axis=(1, 2)), rtol=1e-6)
    for i in range(3):
        np.testing.assert_array_equal(branches.lane(i).view()["carry"], data["carry"][i, -1])
    assert_logically_equal(branches.prefix.view(), session.view(), "the prefix changed")
    assert branches.discard() is branches.prefix


def test_rng_keys_split_per_lane_and_adopted():
    session = make_session()
    branches = session.branch(5, window=4)
    keys = jax.random.key_data(branches.attrs["rng"])
    assert keys.shape[0] == 5 and len({tuple(k) for k in np.asarray(keys)}) == 5
    np.testing.assert_array_equal(branches.attrs["step"], np.zeros(5))
    adopted = branches.adopt(3)
    np.testing.assert_array_equal(jax.random.key_data(adopted.attrs["rng"]), keys[3])


def test_jitted_plan_step_compiles_once():
    rng = np.random.default_rng(1)

    @chex.assert_max_traces(n=1)
    def plan(session, data):
        branches, scores = session.branch(4, window={"kv": 6, "frames": 2}).map(roll, data)
        return branches.adopt(jnp.argmax(scores))

    step = jax.jit(plan, donate_argnums=0)
    session = make_session()
    for _ in range(3):
        data = lane_data(rng, 4, 2)
        best = int(jnp.argmax(data["carry"][:, -1].sum(axis=(1, 2))))
        expected = sequential(session.fork(), data, best)  # a copy: the step donates session
        session = step(session, data)
        assert_logically_equal(session.view(), expected.view(), "jitted adopt")


def test_memory_grows_with_lanes_times_window_not_prefix():
    session = jss.Session(objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=4, head_dim=16, capacity=4096)})
    rows = jnp.ones((1, 4096, 4, 16))
    session = session.append(kv=(rows, rows))
    lanes, window = 16, 32
    branches = session.branch(lanes, window=window)
    window_bytes = 2 * 4 * window * 16 * 4  # k and v of one lane
    assert branches.nbytes <= session.nbytes + 1.1 * lanes * window_bytes
    forks = [session.fork() for _ in range(lanes)]
    assert sum(f.nbytes for f in forks) > 10 * branches.nbytes


@pytest.mark.parametrize(
    ("lanes", "error", "message"),
    [
        (0, jss.PayloadError, r"^branch\(\): lanes must be >= 1; got 0\.$"),
        (-2, jss.PayloadError, r"^branch\(\): lanes must be >= 1; got -2\.$"),
        (True, jss.PayloadTypeError, r"^branch\(\): lanes must be an int >= 1; got True\.$"),
        (2.0, jss.PayloadTypeError, r"^branch\(\): lanes must be an int >= 1; got 2\.0\.$"),
        ("2", jss.PayloadTypeError, r"^branch\(\): lanes must be an int >= 1; got '2'\.$"),
    ],
)
def test_branch_tells_lanes_of_the_wrong_type_from_too_few(lanes, error, message):
    with pytest.raises(error, match=message) as raised:
        make_session().branch(lanes, window=4)
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)


def test_branch_takes_a_numpy_integer_lanes():
    branches = make_session().branch(np.int64(3), window=4)
    assert branches.lanes == 3 and type(branches.lanes) is int


def test_branching_staged_data_is_refused():
    session = make_session().stage(carry=jnp.ones((B, 3)))
    with pytest.raises(jss.PayloadError, match=r"staged data in \['carry'\].*Commit or discard"):
        session.branch(2, window=4)


def test_adopt_out_of_range():
    session = make_session()
    branches = session.branch(2, window=4)
    with pytest.raises(IndexError, match=r"lane 2 is out of range.*0\.\.1"):
        branches.adopt(2)
    with pytest.raises(IndexError):
        branches.adopt(-1)
    staged, _ = branches.map(roll, lane_data(np.random.default_rng(2), 2, 1))
    kept = jax.jit(lambda b, i: b.adopt(i))(staged, jnp.int32(7))  # traced: adopts nothing
    assert_logically_equal(kept.view(), session.view(), "out-of-range traced adopt")


@pytest.mark.parametrize("operation", ["adopt", "lane"])
@pytest.mark.parametrize(
    ("index", "shown"),
    [
        (True, "True"),  # a bool is not a lane number: x[True] would add an axis, not pick lane 1
        (np.bool_(True), "np.True_"),
        (1.0, "1.0"),
        ("1", "'1'"),
        (jnp.array([1]), r"Array\(\[1\], dtype=int32\)"),
    ],
)
def test_a_lane_index_of_the_wrong_type_is_a_type_error(operation, index, shown):
    branches = make_session().branch(2, window=4)
    with pytest.raises(
        jss.PayloadTypeError, match=rf"^Branches\.{operation}: index must be an integer scalar; got {shown}\.$"
    ):
        getattr(branches, operation)(index)
    for index in (np.int64(1), jnp.int32(1)):  # numpy and jax integers are lane numbers
        assert getattr(branches, operation)(index) is not None


def test_lanes_cannot_write_shared_objects():
    branches = make_session().branch(2, window=4)
    rows = jnp.ones((B, 2, H, D))
    with pytest.raises(jss.PayloadTypeError, match=r"lanes cannot write 'cond' \(EncodeOnceKV"):
        branches.lane(0).stage(cond=(rows, rows))


def test_lane_overflow_is_flagged_per_lane():
    branches = make_session().branch(2, window={"kv": 2, "frames": 1})
    rows = jnp.ones((2, B, 3, H, D))
    flagged = branches.map(lambda lane, r: lane.stage(kv=(r, r)), rows)
    with pytest.raises(jss.CapacityError, match=r"windows\['kv'\]"):
        jss.check(flagged)



def overflow_session(rng):
    """A session whose K/V and frames hold a random prefix of 3 entries."""
    session = jss.Session(
        objects={
            "kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=32),
            "frames": jss.LatentBuffer.allocate(capacity=8, item_shape=(2,)),
        }
    )
    k, v = (jnp.asarray(rng.normal(size=(B, 3, H, D)), jnp.float32) for _ in "kv")
    return session.append(kv=(k, v), frames=jnp.asarray(rng.normal(size=(3, 2)), jnp.float32))


def random_entries(rng, name, n, lanes=2):
    """``n`` random entries of ``name`` for each of ``lanes`` lanes: K/V rows or frames."""
    if name == "kv":
        return tuple(jnp.asarray(rng.normal(size=(lanes, B, n, H, D)), jnp.float32) for _ in "kv")
    return jnp.asarray(rng.normal(size=(lanes, n, 2)), jnp.float32)


def first_entry(name, payload):
    """The first entry of one lane's payload of ``name``."""
    return tuple(x[:, :1] for x in payload) if name == "kv" else payload[:1]


def of_lane(tree, lane):
    return jax.tree_util.tree_map(lambda x: x[lane], tree)


def overflowing_lanes(branches, name, first, more, over):
    """Each lane stages ``first``, then all of ``more`` where ``over`` (2 entries: past its window of 2, refused),
    else the first entry of ``more``."""

    def roll(lane, first, more, over):
        lane = lane.stage(**{name: first})
        return jax.lax.cond(
            over,
            lambda lane: lane.stage(**{name: more}),
            lambda lane: lane.stage(**{name: first_entry(name, more)}),
            lane,
        )

    return branches.map(roll, first, more, over)


def read_entries(session, name):
    """The committed entries of ``name``: K/V rows of batch row 0, or frames."""
    if name == "kv":
        (row,) = session.view()["kv"].materialize()
        return {key: row[key] for key in "kv"}
    return session.view()["frames"].materialize()


def appended_entries(session, name, *payloads):
    """What ``name`` must read once ``payloads`` (one lane's) are appended to ``session``: a numpy model."""
    before = read_entries(session, name)
    if name == "kv":
        return {
            key: np.concatenate([before[key], *(np.asarray(p[i])[0] for p in payloads)]) for i, key in enumerate("kv")
        }
    return np.concatenate([before, *(np.asarray(p) for p in payloads)])


def refused_lane_case(name):
    """A session, its branches, one lane's refused write, and what adopting lane 0 or lane 1 must read."""
    rng = np.random.default_rng(5)
    session = overflow_session(rng)
    first, more = random_entries(rng, name, 1), random_entries(rng, name, 2)
    over = jnp.array([True, False])  # lane 0's second write does not fit its window: refused
    kept = (
        appended_entries(session, name, of_lane(first, 0)),
        appended_entries(session, name, of_lane(first, 1), first_entry(name, of_lane(more, 1))),
    )
    return session, session.branch(2, window=2), (first, more, over), kept


@pytest.mark.parametrize("name", ["kv", "frames"])
def test_adopting_a_lane_whose_write_was_refused_raises_eagerly_and_adopts_nothing(name):
    session, branches, lane_data, kept = refused_lane_case(name)
    rolled = overflowing_lanes(branches, name, *lane_data)
    kind = type(session[name]).__name__
    message = (
        rf"^Branches\.adopt: a write of lane 0 to '{name}' \({kind}\(.*capacity=(32|8).*\)\) was refused: it did not "
        rf"fit the lane's window of 2 entries \({kind}\(.*capacity=2.*\)\), which holds (\[1\]|1); adopting the "
        rf"lane would lose that write, so nothing was adopted\. Branch with a larger window for '{name}', or "
        r"adopt another lane\.$"
    )
    with pytest.raises(jss.CapacityError, match=message):
        rolled.adopt(0)
    assert_logically_equal(rolled.prefix.view(), session.view(), "a refused adopt changed the prefix")
    assert bool(rolled.windows[name].overflowed[0]) and not bool(rolled.windows[name].overflowed[1])
    adopted = rolled.adopt(1)  # the other lane's writes all fit
    jss.check(adopted)
    chex.assert_trees_all_equal(read_entries(adopted, name), kept[1])


@pytest.mark.parametrize("name", ["kv", "frames"])
def test_adopting_a_lane_whose_write_was_refused_under_jit_flags_the_object(name):
    session, branches, lane_data, kept = refused_lane_case(name)
    step = jax.jit(lambda branches, lane_data, lane: overflowing_lanes(branches, name, *lane_data).adopt(lane))
    lost = step(branches, lane_data, 0)
    with pytest.raises(jss.CapacityError, match=rf"refused and wrote nothing.*\.objects\['{name}'\]"):
        jss.check(lost)
    chex.assert_trees_all_equal(read_entries(lost, name), kept[0])  # the lane's writes that fit
    adopted = step(branches, lane_data, 1)
    jss.check(adopted)
    chex.assert_trees_all_equal(read_entries(adopted, name), kept[1])
    nothing = step(branches, lane_data, jnp.int32(7))  # out of range: adopts nothing, so loses nothing
    jss.check(nothing)
    assert_logically_equal(nothing.view(), session.view(), "out-of-range adopt")
