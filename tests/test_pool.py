"""SessionPool: slot operations, stepping every slot in one call, errors, compile count."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from tests.support.attention_reference import assert_close, reference
from tests.support.pooled import CAPACITY, CHUNK, DIM, HEADS, KV_HEADS, new_session, step, steps_fit

SLOTS = 6


def assert_same_session(got: jss.Session, want: jss.Session, *, rtol: float = 0.0) -> None:
    """Leaf for leaf: the same structure, shapes and dtypes, values within ``rtol`` of the larger."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for a, b in zip(got_leaves, want_leaves):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if rtol == 0.0 or not np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b)
        else:
            assert np.max(np.abs(a - b), initial=0.0) <= rtol * max(np.max(np.abs(b), initial=0.0), 1e-30)


def stepped(session: jss.Session, times: int, scale: float = 1.0) -> jss.Session:
    """``session`` stepped alone ``times`` times."""
    alone = jax.jit(step)
    for _ in range(times):
        session, _ = alone(session, jnp.float32(scale))
    return session


@pytest.mark.parametrize("variant", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_insert_then_extract_gives_back_the_session_leaf_for_leaf(variant):
    pool = jss.SessionPool.allocate(new_session(0), slots=SLOTS)
    session = stepped(new_session(3), 4)  # random K/V, carry, frames, a moved RNG key
    insert, extract = variant(jss.SessionPool.insert), variant(jss.SessionPool.extract)
    pool = insert(pool, 4, session)
    assert pool.active_slots() == [4]
    assert_same_session(extract(pool, 4), session)
    pool = variant(jss.SessionPool.release)(pool, 4)
    assert pool.active_slots() == []
    pool.check()


def test_map_steps_each_slot_like_the_session_alone_and_leaves_empty_slots_unchanged():
    pool = jss.SessionPool.allocate(new_session(0), slots=SLOTS)
    insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
    pool_step = jax.jit(lambda pool, scales: pool.map(step, scales), donate_argnums=0)
    scales = jnp.linspace(0.5, 2.0, SLOTS)
    # Sessions join at different times: ragged lengths, different RNG keys and counters.
    joined = {1: stepped(new_session(11), 2), 3: new_session(13), 4: stepped(new_session(14), 5, 1.5)}
    for slot, session in joined.items():
        pool = insert(pool, slot, session)
    empty_before = jax.tree_util.tree_map(lambda x: x[np.array([0, 2, 5])], pool.sessions)  # a copy
    for _ in range(3):
        pool, out = pool_step(pool, scales)
    pool.check()
    for slot, session in joined.items():
        alone = session
        for _ in range(3):
            alone, alone_out = jax.jit(step)(alone, scales[slot])
        assert_same_session(pool.extract(slot), alone, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out[slot]), np.asarray(alone_out), rtol=1e-5, atol=1e-6)
    lengths = pool.sessions["kv"].committed[:, 0]
    assert lengths.tolist() == [0, 5 * CHUNK, 0, 3 * CHUNK, 8 * CHUNK, 0]
    empty_after = jax.tree_util.tree_map(lambda x: x[np.array([0, 2, 5])], pool.sessions)
    assert_same_session(empty_after, empty_before)  # bit for bit
    assert not np.any(np.asarray(out[np.array([0, 2, 5])]))  # empty slots give zeros


def test_per_slot_rng_keys_stay_per_slot():
    pool = jss.SessionPool.allocate(new_session(0), slots=3)
    for slot in range(3):
        pool = pool.insert(slot, new_session(slot + 20))
    pool, out = jax.jit(jss.SessionPool.map, static_argnums=1)(pool, step, jnp.ones(3))
    keys = np.asarray(jax.random.key_data(pool.sessions.attrs["rng"]))
    assert len({tuple(k) for k in keys}) == 3
    assert not np.allclose(np.asarray(out[0]), np.asarray(out[1]))


@pytest.mark.parametrize("native", [True, False] if _library.AVAILABLE else [False])
def test_attend_under_the_pool_reads_each_slots_own_valid_length(native):
    rng = np.random.default_rng(5)
    lengths = np.array([0, 1, 17, 40, CAPACITY])  # ragged, one empty, one full
    k = rng.standard_normal((len(lengths), 1, KV_HEADS, CAPACITY, DIM)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((len(lengths), 1, 2, HEADS, DIM)).astype(np.float32)
    garbage = np.arange(CAPACITY)[None, None, None, :, None] >= lengths[:, None, None, None, None]
    k_dirty = np.where(garbage, 1e4, k)  # rows past a slot's length must not be read

    def one(q, k, v, length):
        view = jss.KVView(k=k, v=v, lengths=length[None], positions=None, window=None, sink=0)
        return jss.attend_with_lse(q, view)

    with _library.use(native):
        out, lse = jax.jit(jax.vmap(one))(q, k_dirty, v, jnp.asarray(lengths, jnp.int32))
    for slot, length in enumerate(lengths):
        positions = np.where(np.arange(CAPACITY) < length, np.arange(CAPACITY), -1)[None]
        ref_out, ref_lse = reference(q[slot], k[slot], v[slot], np.array([length]), positions)
        assert_close(out[slot], lse[slot], ref_out, ref_lse)


def test_two_hundred_random_slot_operations_and_steps_compile_once():
    rng = np.random.default_rng(7)

    @functools.partial(jax.jit, donate_argnums=0)
    @chex.assert_max_traces(n=1)
    def insert(pool, slot, session):
        return pool.insert(slot, session)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def extract(pool, slot):
        return pool.extract(slot)

    @functools.partial(jax.jit, donate_argnums=0)
    @chex.assert_max_traces(n=1)
    def release(pool, slot):
        return pool.release(slot)

    @functools.partial(jax.jit, donate_argnums=0)
    @chex.assert_max_traces(n=1)
    def advance(pool, scales):
        return pool.map(step, scales)

    pool = jss.SessionPool.allocate(new_session(0), slots=SLOTS)
    model: dict[int, jss.Session] = {}  # slot -> the session stepped alone
    for i in range(200):
        live = sorted(model)
        free = [s for s in range(SLOTS) if s not in model]
        choice = rng.integers(4)
        if choice == 0 and free:
            slot = int(rng.choice(free))
            model[slot] = new_session(i)
            joining = new_session(i)
            if i % 2:  # committed to the device, like a session brought back from host memory
                joining = jax.device_put(joining, jax.devices()[0])
            pool = insert(pool, slot, joining)
        elif choice == 1 and live:
            slot = int(rng.choice(live))
            assert_same_session(extract(pool, slot), model[slot], rtol=1e-5)
        elif choice == 2 and live:
            slot = int(rng.choice(live))
            pool = release(pool, slot)
            del model[slot]
        else:
            for slot in [s for s in live if not steps_fit(int(model[s].attrs["steps"]))]:
                pool = release(pool, slot)  # a full session leaves
                del model[slot]
            pool, _ = advance(pool, jnp.ones(SLOTS))
            model = {s: stepped(session, 1) for s, session in model.items()}
    pool.check()
    # Nor compiled again when sessions brought back from host memory (committed arrays) join: the
    # pool's steps see one pool whatever joined; insert compiles once per placement of the session.
    for jitted in (extract, release, advance):
        assert jitted._cache_size() == 1
    assert insert._cache_size() == 2
    assert pool.active_slots() == sorted(model)
    for slot, session in model.items():
        assert_same_session(pool.extract(slot), session, rtol=1e-5)


def test_insert_writes_one_slot_in_place_and_extract_reads_one_slot():
    pool = jss.SessionPool.allocate(new_session(0), slots=64)
    for neighbour in (2, 4):  # random sessions either side of the slot written: they must stay as they are
        pool = pool.insert(neighbour, stepped(new_session(10 + neighbour), 1 + neighbour))
    session = stepped(new_session(1), 2)
    insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
    text = insert.lower(pool, 3, session).compile().as_text()
    assert "dynamic-update-slice" in text
    assert "f32[64,1,2,48,8]{4,3,2,1,0} copy(" not in text  # no copy of a whole K/V leaf of the pool
    held = jax.tree_util.tree_map(jnp.copy, pool.sessions)  # copies: a reference to the pool would stop donation
    before = pool.sessions["kv"].k.unsafe_buffer_pointer()
    pool = insert(pool, 3, session)
    assert pool.sessions["kv"].k.unsafe_buffer_pointer() == before  # donated: written where it was
    extract_text = jax.jit(jss.SessionPool.extract).lower(pool, 3).compile().as_text()
    assert "f32[64,1,2,48,8]" not in extract_text.split("ENTRY")[-1].split("ROOT")[-1]
    assert_same_session(pool.extract(3), session)
    assert pool.active_slots() == [2, 3, 4]
    others = np.flatnonzero(np.arange(64) != 3)  # every other slot, leaf for leaf, bit for bit as before the insert
    assert_same_session(*(jax.tree_util.tree_map(lambda x: x[others], s) for s in (pool.sessions, held)))
    assert_same_session(jax.tree_util.tree_map(lambda x: x[3], pool.sessions), session)  # read by index, not extract
    assert int(pool.sessions["kv"].committed[3, 0]) == 2 * CHUNK
    assert [int(pool.sessions["kv"].committed[s, 0]) for s in (2, 4)] == [3 * CHUNK, 5 * CHUNK]


@pytest.mark.parametrize("native", [True, False] if _library.AVAILABLE else [False])
def test_a_donated_pool_step_writes_every_leaf_in_place(native):
    """Every buffer of the pool (caches, carries, flags) is where it was after a donated ``map``."""
    pool = jss.SessionPool.allocate(new_session(0), slots=SLOTS)
    for slot in range(SLOTS - 1):  # one empty slot; the others at different lengths
        pool = pool.insert(slot, stepped(new_session(slot), slot % 3))
    held = jax.tree_util.tree_map(jnp.copy, pool.sessions)  # copies: a reference to the pool would stop donation
    with _library.use(native):
        map_step = jax.jit(lambda pool, scales: pool.map(step, scales), donate_argnums=0)
        pool, _ = map_step(pool, jnp.ones(SLOTS))
        before = [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(pool)]
        for _ in range(3):
            pool, out = map_step(pool, jnp.ones(SLOTS))
    assert [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(pool)] == before
    assert np.all(np.asarray(out[SLOTS - 1]) == 0) and np.any(np.asarray(out[0]) != 0)
    kv = pool.sessions["kv"]
    for slot in range(SLOTS - 1):  # each slot's 4 chunks, drawn here from its key as `step` draws them
        start, rng = (slot % 3) * CHUNK, held.attrs["rng"][slot]
        assert kv.committed[slot].tolist() == [start + 4 * CHUNK]
        want = {name: np.array(getattr(held["kv"], name)[slot]) for name in ("k", "v")}
        for i in range(4):
            rng, k_rows, _ = jax.random.split(rng, 3)
            rows = dict(zip("kv", np.asarray(jax.random.normal(k_rows, (2, 1, CHUNK, KV_HEADS, DIM)))))
            for name in ("k", "v"):  # at its offset; the rows before and after as they were
                want[name][:, :, start + i * CHUNK:start + (i + 1) * CHUNK] = rows[name].transpose(0, 2, 1, 3)
        for name in ("k", "v"):
            np.testing.assert_allclose(np.asarray(getattr(kv, name)[slot]), want[name], rtol=1e-6, atol=1e-7,
                                       err_msg=f"slot {slot} {name}")
        assert_same_session(pool.extract(slot), stepped(new_session(slot), slot % 3 + 4), rtol=1e-5)
    assert_same_session(*(jax.tree_util.tree_map(lambda x: x[SLOTS - 1], s) for s in (pool.sessions, held)))


def test_mismatched_session_is_refused_naming_the_object():
    pool = jss.SessionPool.allocate(new_session(0), slots=2)
    wrong_capacity = new_session(1).with_objects(
        kv=jss.KVCache.allocate(batch=1, kv_heads=KV_HEADS, head_dim=DIM, capacity=CAPACITY * 2))
    with pytest.raises(jss.PayloadError, match=r"object 'kv' is KVCache\(.*capacity=96.*capacity=48"):
        pool.insert(0, wrong_capacity)
    with pytest.raises(jss.PayloadError, match=r"missing: \['frames'\]"):
        pool.insert(0, jss.Session(objects={k: v for k, v in new_session(1).objects.items() if k != "frames"},
                                   attrs=new_session(1).attrs))
    with pytest.raises(jss.PayloadError, match=r"attrs\['steps'\] of shape \(\) and dtype float32"):
        pool.insert(0, new_session(1).with_attrs(steps=jnp.float32(0)))
    with pytest.raises(jss.NotResidentError, match="'carry'"):
        pool.insert(0, new_session(1).with_objects(carry=new_session(1)["carry"].reset()))
    with pytest.raises(jss.PayloadTypeError, match="expected a Session"):
        pool.insert(0, {"kv": 1})
    assert pool.active_slots() == []


def test_bad_slots_raise_eagerly_and_are_refused_under_jit():
    pool = jss.SessionPool.allocate(new_session(0), slots=2).insert(1, new_session(1))
    with pytest.raises(IndexError, match=r"slot 2 is out of range \[0, 2\)"):
        pool.insert(2, new_session(2))
    with pytest.raises(jss.PayloadError, match="slot 1 holds a live session"):
        pool.insert(1, new_session(2))
    with pytest.raises(jss.PayloadError, match="slot 0 is empty"):
        pool.extract(0)
    with pytest.raises(jss.PayloadError, match="slot 0 is already empty"):
        pool.release(0)
    for slot in (0.5, True, "1", None):  # a bool is no slot; a str or None is not array-like at all
        with pytest.raises(jss.PayloadTypeError, match=rf"^SessionPool\.insert: slot must be an integer scalar; got "
                                                        rf"{re.escape(repr(slot))}\.$"):
            pool.insert(slot, new_session(2))
    before = jax.tree_util.tree_map(lambda x: x.copy(), pool)
    for operation, args in [
        (jss.SessionPool.insert, (1, new_session(2))),
        (jss.SessionPool.insert, (5, new_session(2))),
        (jss.SessionPool.release, (0,)),
        (jss.SessionPool.release, (-1,)),
    ]:
        refused = jax.jit(operation)(pool, *args)
        with pytest.raises(jss.PayloadError, match="refused and wrote nothing"):
            refused.check()
        assert_same_session(refused.sessions, before.sessions)
        np.testing.assert_array_equal(np.asarray(refused.active), before.active)


def test_check_under_jit_is_refused():
    pool = jss.SessionPool.allocate(new_session(0), slots=2)
    with pytest.raises(jss.PayloadTypeError, match=r"SessionPool\.check\(\) reads flags; call it outside jit"):
        jax.jit(lambda p: p.check())(pool)
    pool.check()  # outside jit, nothing refused: no error


def test_map_refuses_arguments_without_a_slot_axis_and_steps_that_change_the_session():
    pool = jss.SessionPool.allocate(new_session(0), slots=2)
    with pytest.raises(jss.PayloadError, match="leading axis of 2 slots"):
        pool.map(step, jnp.ones(3))
    with pytest.raises(jss.PayloadError, match=r"returned a session that differs in structure in \['extra'\]"):
        pool.map(lambda s, x: (s.with_attrs(extra=x), x), jnp.ones(2))
    with pytest.raises(jss.PayloadError, match=r"\.attrs\['steps'\] of shape \(3,\)"):
        pool.map(lambda s, x: (s.with_attrs(steps=jnp.zeros(3, jnp.int32)), x), jnp.ones(2))


def test_allocate_refuses_a_template_with_dropped_objects():
    template = new_session(0).with_objects(carry=new_session(0)["carry"].reset())
    with pytest.raises(jss.NotResidentError, match="template object 'carry'"):
        jss.SessionPool.allocate(template, slots=2)


@pytest.mark.parametrize(
    ("slots", "error", "message"),
    [
        (0, jss.PayloadError, r"SessionPool\.allocate: slots must be >= 1; got 0\."),
        (-2, jss.PayloadError, r"SessionPool\.allocate: slots must be >= 1; got -2\."),
        (2.0, jss.PayloadTypeError, r"SessionPool\.allocate: slots must be an int >= 1; got 2\.0\."),
        ("2", jss.PayloadTypeError, r"SessionPool\.allocate: slots must be an int >= 1; got '2'\."),
        (True, jss.PayloadTypeError, r"SessionPool\.allocate: slots must be an int >= 1; got True\."),
    ],
)
def test_allocate_tells_a_slots_of_the_wrong_type_from_one_out_of_range(slots, error, message):
    with pytest.raises(error, match=message) as raised:
        jss.SessionPool.allocate(new_session(0), slots=slots)
    # PayloadError and PayloadTypeError are siblings: the value case is not a TypeError, nor the type case a ValueError.
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)


def test_allocate_takes_a_numpy_integer_slots():
    pool = jss.SessionPool.allocate(new_session(0), slots=np.int64(3))
    assert pool.slots == 3 and type(pool.slots) is int


def test_pool_bytes_count_every_slot():
    pool = jss.SessionPool.allocate(new_session(0), slots=5)
    one = new_session(0).nbytes_by_device()["cpu:0"]
    assert pool.nbytes_by_device()["cpu:0"] == 5 * one + pool.active.nbytes + pool.refused.nbytes + pool.tag.nbytes
