"""Leading batch axes (``batch=(B, P)``) and row subsets (``KVChunk(rows=)``, ``attend(rows=)``).

Each kind with a batch axis, allocated with a batch shape, must hold exactly
what the same kind with the batch flattened holds after the same writes
(payloads reshaped), read the same through ``attend``, write in place under
donation and compile once.  A write of some rows must equal the full write
with counts 0 for every other row; a read of some rows must equal the full
read of those rows.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_session_state as jss
from jax_session_state import checkpoint

B, P, H, D = 2, 3, 2, 8
N = B * P
T = 4

KINDS = {
    "append": lambda batch: jss.KVCache.allocate(batch=batch, kv_heads=H, head_dim=D, capacity=24),
    "ring": lambda batch: jss.KVCache.allocate(batch=batch, kv_heads=H, head_dim=D, window=6, sink=2,
                                               max_staged=T),
    "int8": lambda batch: jss.KVCache.allocate(batch=batch, kv_heads=H, head_dim=D, capacity=24, quantize="int8"),
    "paged": lambda batch: jss.PagedKVCache.allocate(max_slots=batch, kv_heads=H, head_dim=D, page_size=4,
                                                     num_pages=48, max_pages_per_slot=8),
}


def chunk(rng, lead, t=T, ragged=True):
    k, v = (jnp.asarray(rng.normal(size=(*lead, t, H, D)), jnp.float32) for _ in range(2))
    counts = jnp.asarray(rng.integers(0, t + 1, size=lead), jnp.int32) if ragged else None
    return k, v, counts


def flat(x):
    return None if x is None else x.reshape(N, *x.shape[2:])


def storage(obj):
    return {name: np.asarray(getattr(obj, name)) for name in obj.storage_fields() if getattr(obj, name) is not None}


def assert_same_state(shaped, flattened):
    got, want = storage(shaped), storage(flattened)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


STEPS = ("append", "stage", "stage", "commit", "append", "stage", "discard", "append")


def run_steps(obj, payloads, step_fn):
    for op, payload in zip(STEPS, payloads):
        obj = step_fn(obj, op, payload)
    return obj


def apply(obj, op, payload):
    if op == "commit":
        return obj.commit()
    if op == "discard":
        return obj.discard()
    return getattr(obj, op)(jss.KVChunk(*payload))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_batch_shape_holds_and_reads_what_the_flattened_batch_does(kind, jitted):
    rng = np.random.default_rng(0)
    payloads = [chunk(rng, (B, P)) for _ in STEPS]
    shaped, flattened = KINDS[kind]((B, P)), KINDS[kind](N)
    assert shaped.nbytes == flattened.nbytes
    step = jax.jit(apply, static_argnums=1) if jitted else apply
    for op, (k, v, counts) in zip(STEPS, payloads):
        shaped = step(shaped, op, (k, v, counts))
        flattened = step(flattened, op, (flat(k), flat(v), flat(counts)))
        assert_same_state(shaped, flattened)
    q = jnp.asarray(rng.normal(size=(B, P, T, 2 * H, D)), jnp.float32)
    attend = jax.jit(jss.attend) if jitted else jss.attend
    out = attend(q, shaped.view())
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out).reshape(N, *q.shape[2:]),
                               np.asarray(attend(flat(q), flattened.view())), rtol=1e-6, atol=1e-6)
    # The flattened rows read the same, and a view's batch shape travels with it.
    np.testing.assert_allclose(np.asarray(attend(flat(q), shaped.view())), np.asarray(out).reshape(N, T, 2 * H, D),
                               rtol=1e-6, atol=1e-6)
    assert shaped.view().batch_shape == (B, P)


def test_encode_once_takes_a_batch_shape():
    rng = np.random.default_rng(1)
    k, v, counts = chunk(rng, (B, P), t=5)
    shaped = jss.EncodeOnceKV.allocate(batch=(B, P), kv_heads=H, head_dim=D, capacity=8).append((k, v, counts))
    flattened = jss.EncodeOnceKV.allocate(batch=N, kv_heads=H, head_dim=D, capacity=8).append(
        (flat(k), flat(v), flat(counts)))
    assert_same_state(shaped, flattened)
    q = jnp.asarray(rng.normal(size=(B, P, 2, H, D)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jss.attend(q, shaped.view(), causal=False)).reshape(N, 2, H, D),
                               np.asarray(jss.attend(flat(q), flattened.view(), causal=False)), atol=1e-6)


@pytest.mark.parametrize("kind", ["append", "ring", "paged"])
def test_a_donated_step_over_batch_axes_writes_in_place_and_compiles_once(kind):
    rng = np.random.default_rng(2)
    cache = KINDS[kind]((B, P))
    data = list(cache.data_fields)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(cache, k, v, q):
        cache = cache.append((k, v))
        return cache, jss.attend(q, cache.view())

    donated = jax.jit(step.__wrapped__, donate_argnums=0)
    for _ in range(3):
        k, v, _ = chunk(rng, (B, P), t=1)
        q = jnp.asarray(rng.normal(size=(B, P, 1, H, D)), jnp.float32)
        before = [getattr(cache, name).unsafe_buffer_pointer() for name in data]
        cache, out = donated(cache, k, v, q)
        assert [getattr(cache, name).unsafe_buffer_pointer() for name in data] == before
        assert out.shape == (B, P, 1, H, D)
    assert np.asarray(cache.committed).tolist() == [3] * N


# ------------------------------------------------------------------ row subsets
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_write_of_some_rows_equals_the_full_write_with_the_other_rows_empty(kind, jitted):
    rng = np.random.default_rng(3)
    some, full = KINDS[kind]((B, P)), KINDS[kind]((B, P))
    step = jax.jit(apply, static_argnums=1) if jitted else apply
    for op in STEPS:
        rows = jnp.asarray(rng.choice(N, size=2, replace=False), jnp.int32)
        k, v, counts = chunk(rng, (2,))
        full_k, full_v = (jnp.zeros((N, T, H, D)).at[rows].set(x).reshape(B, P, T, H, D) for x in (k, v))
        full_counts = jnp.zeros((N,), jnp.int32).at[rows].set(counts).reshape(B, P)
        some = step(some, op, (k, v, counts, rows))
        full = step(full, op, (full_k, full_v, full_counts))
        assert_same_state(some, full)


@pytest.mark.parametrize("kind", ["append", "ring", "int8", "paged"])
def test_a_donated_write_of_some_rows_stays_in_place_and_compiles_once(kind):
    rng = np.random.default_rng(4)
    cache = KINDS[kind]((B, P))

    @chex.assert_max_traces(n=1)
    def step(cache, k, v, rows):
        return cache.append(jss.KVChunk(k, v, rows=rows))

    donated = jax.jit(step, donate_argnums=0)
    for _ in range(3):
        rows = jnp.asarray(rng.choice(N, size=2, replace=False), jnp.int32)
        k, v, _ = chunk(rng, (2,), t=1)
        before = [getattr(cache, name).unsafe_buffer_pointer() for name in cache.data_fields]
        cache = donated(cache, k, v, rows)
        assert [getattr(cache, name).unsafe_buffer_pointer() for name in cache.data_fields] == before
    assert int(cache.committed.sum()) == 6


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_attention_of_some_rows_equals_those_rows_of_the_full_attention(kind, jitted):
    rng = np.random.default_rng(5)
    cache = KINDS[kind]((B, P))
    for _ in range(3):
        cache = cache.append(chunk(rng, (B, P)))
    q = jnp.asarray(rng.normal(size=(N, T, 2 * H, D)), jnp.float32)
    rows = jnp.asarray([4, 0, 5], jnp.int32)
    attend = jax.jit(jss.attend_with_lse) if jitted else jss.attend_with_lse
    out, lse = attend(q[rows], cache.view(), rows=rows)
    want_out, want_lse = attend(q, cache.view())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out)[np.asarray(rows)], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse)[np.asarray(rows)], rtol=1e-6, atol=1e-6)
    grid = rows.reshape(3, 1)  # rows of any shape: q leads with it
    np.testing.assert_allclose(np.asarray(jss.attend(q[rows].reshape(3, 1, T, 2 * H, D), cache.view(), rows=grid)),
                               np.asarray(out).reshape(3, 1, T, 2 * H, D), rtol=1e-6, atol=1e-6)


def test_attention_of_some_rows_of_a_paged_view_reads_the_pages_where_they_lie():
    rng = np.random.default_rng(6)
    cache = KINDS["paged"]((B, P)).append(chunk(rng, (B, P)))
    rows = jnp.asarray([1, 4], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, T, H, D)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda q, view: jss.attend(q, view, rows=rows, implementation="loop"))(q, cache.view())
    pool = cache.k_pages.shape
    sliced = [e for e in jaxpr.jaxpr.eqns
              if e.primitive.name == "gather" and tuple(e.outvars[0].aval.shape[:1]) == (2,)
              and len(e.invars[0].aval.shape) == len(pool) and tuple(e.invars[0].aval.shape) == pool]
    assert not sliced  # no gather of the pool by the rows


# ---------------------------------------------------------------- accounting, sharding, checkpoints, tiers, pools
def test_storage_axes_name_each_batch_axis_and_shard_the_flattened_axis_over_them():
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rules = jss.ShardingRules(mesh, {"batch": "data", "batch_1": "model"})
    kv = jss.KVCache.allocate(batch=(B, P), kv_heads=H, head_dim=D, capacity=8, sharding=rules)
    assert kv.storage_axes()["k"] == (("batch", "batch_1"), "kv_heads", "capacity", "head_dim")
    assert kv.k.sharding.spec == jax.sharding.PartitionSpec(("data", "model"))
    paged = jss.PagedKVCache.allocate(max_slots=(B, P), kv_heads=H, head_dim=D, page_size=4, num_pages=8)
    assert paged.storage_axes()["page_table"] == (("max_slots", "max_slots_1"), "max_pages_per_slot")
    kv = kv.append(chunk(np.random.default_rng(7), (B, P)))
    assert kv.k.sharding.spec == jax.sharding.PartitionSpec(("data", "model"))


def test_a_batch_shaped_session_round_trips_through_a_checkpoint(tmp_path):
    rng = np.random.default_rng(8)
    session = jss.Session(objects={name: KINDS[name]((B, P)).append(chunk(rng, (B, P))) for name in KINDS})
    checkpoint.save(tmp_path, session)
    restored = checkpoint.restore(tmp_path)
    for name in KINDS:
        assert restored[name].describe() == session[name].describe()
        assert restored[name].batch_shape == (B, P)
        assert_same_state(restored[name], session[name])


def test_a_batch_shaped_cache_demotes_and_reads_its_rows_quantized():
    rng = np.random.default_rng(9)
    cache = jss.KVCache.allocate(batch=(B, P), kv_heads=H, head_dim=D, capacity=16, tiers=("int8",))
    cache = cache.append(chunk(rng, (B, P), ragged=False))
    low = cache.demote()
    q = jnp.asarray(rng.normal(size=(B, P, T, H, D)), jnp.float32)
    assert low.batch_shape == (B, P) and low.nbytes < cache.nbytes
    np.testing.assert_allclose(np.asarray(jss.attend(q, low.view())), np.asarray(jss.attend(q, cache.view())),
                               atol=0.05)


def test_a_pool_steps_sessions_with_batch_axes():
    rng = np.random.default_rng(10)
    template = jss.Session(objects={"kv": KINDS["append"]((B, P))})
    pool = jss.SessionPool.allocate(template, slots=2)
    pool = pool.insert(1, template)

    def step(session, k, v, q):
        session = session.append(kv=(k, v))
        return session, jss.attend(q, session.view()["kv"])

    k, v, _ = chunk(rng, (2, B, P), ragged=False)
    q = jnp.asarray(rng.normal(size=(2, B, P, T, H, D)), jnp.float32)
    pool, out = jax.jit(jss.SessionPool.map, static_argnums=1)(pool, step, k, v, q)
    alone = template["kv"].append((k[1], v[1]))
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(jss.attend(q[1], alone.view())), atol=1e-6)
    assert_same_state(pool.extract(1)["kv"], alone)


# ------------------------------------------------------------------ errors
def test_bad_shapes_and_rows_name_the_object_what_was_expected_and_what_came():
    kv = KINDS["append"]((B, P))
    rng = np.random.default_rng(11)
    k, v, _ = chunk(rng, (N,))  # the flattened rows where [B, P] leads
    owner = r"KVCache\(batch=\(2, 3\).*\.append: "
    with pytest.raises(ValueError, match=owner + r"k must have shape \[2, 3, T, 2, 8\].*got shape \[6, 4, 2, 8\]"):
        kv.append((k, v))
    k, v, _ = chunk(rng, (2,))
    with pytest.raises(ValueError, match=owner + r"rows must be distinct flat batch-row indices in \[0, 6\).*\[1, 1\]"):
        kv.append(jss.KVChunk(k, v, rows=jnp.array([1, 1])))
    with pytest.raises(ValueError, match=r"rows must be distinct.*\[0, 6\).*\[0, 6\]"):
        kv.append(jss.KVChunk(k, v, rows=jnp.array([0, 6])))
    with pytest.raises(TypeError, match=r"rows must be an integer array.*jnp.ravel_multi_index"):
        kv.append(jss.KVChunk(k, v, rows=jnp.array([0.0, 1.0])))
    with pytest.raises(ValueError, match=r"KVCache\(batch=\(2, 3\).*k must have shape \[3, T, 2, 8\]"):
        kv.append(jss.KVChunk(k, v, rows=jnp.array([0, 1, 2])))
    cond = jss.EncodeOnceKV.allocate(batch=(B, P), kv_heads=H, head_dim=D, capacity=8)
    with pytest.raises(TypeError, match=r"EncodeOnceKV\(batch=\(2, 3\).*every batch row at once; write it without"):
        cond.append(jss.KVChunk(k, v, rows=jnp.array([0, 1])))
    with pytest.raises(ValueError, match=r"KVCache.allocate: batch\[1\] must be >= 1; got 0"):
        jss.KVCache.allocate(batch=(2, 0), kv_heads=H, head_dim=D, capacity=8)
    with pytest.raises(ValueError, match=r"batch must be an int or a non-empty tuple"):
        jss.KVCache.allocate(batch=(), kv_heads=H, head_dim=D, capacity=8)
    view = kv.append(chunk(rng, (B, P))).view()
    q = jnp.ones((P, B, 1, H, D))
    expected = r"attend\(\): q must be \[\*batch, T, q_heads, head_dim\] with batch \[2, 3\]"
    with pytest.raises(ValueError, match=expected + r".*got q of shape \[3, 2, 1, 2, 8\]"):
        jss.attend(q, view)
    with pytest.raises(ValueError, match=r"attend\(\): q's batch axes must be rows' shape \[2\]"):
        jss.attend(jnp.ones((3, 1, H, D)), view, rows=jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"attend\(\): rows must be distinct flat indices .* \[0, 6\); got \[0, 9\]"):
        jss.attend(jnp.ones((2, 1, H, D)), view, rows=jnp.array([0, 9]))


def test_a_refused_write_of_some_rows_under_jit_writes_nothing_and_flags_it():
    kv = KINDS["append"]((B, P))
    rng = np.random.default_rng(12)
    kv = kv.append(chunk(rng, (B, P), ragged=False))
    k, v, _ = chunk(rng, (2,), ragged=False)
    before = storage(kv)
    after = jax.jit(lambda kv, rows: kv.append(jss.KVChunk(k, v, rows=rows)))(kv, jnp.array([3, 3]))
    assert bool(after.overflowed)
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(getattr(after, name)), before[name])
    np.testing.assert_array_equal(np.asarray(after.committed), np.asarray(kv.committed))
    with pytest.raises(jss.CapacityError):
        jss.check(after)


@pytest.mark.parametrize("kind", ["append", "ring"])
def test_branches_over_batch_axes_adopt_what_the_flattened_batch_adopts(kind):
    rng = np.random.default_rng(13)
    k, v, _ = chunk(rng, (B, P), ragged=False)
    lane_k, lane_v, _ = chunk(rng, (2, B, P), t=2, ragged=False)
    q = jnp.asarray(rng.normal(size=(2, B, P, 2, H, D)), jnp.float32)

    def run(batch, reshape):
        session = jss.Session(objects={"kv": KINDS[kind](batch).append((reshape(k), reshape(v)))})
        branches = session.branch(2, window=4)
        branches = branches.map(lambda lane, k, v: lane.stage(kv=(k, v)), reshape(lane_k, 1), reshape(lane_v, 1))
        outs = [jss.attend(reshape(q[i]), branches.lane(i).view()["kv"]) for i in range(2)]
        return branches.adopt(1)["kv"], outs

    def to_flat(x, lead=0):
        return x.reshape(*x.shape[:lead], N, *x.shape[lead + 2:])

    shaped, shaped_outs = run((B, P), lambda x, lead=0: x)
    flattened, flat_outs = run(N, to_flat)
    assert_same_state(shaped, flattened)
    for got, want in zip(shaped_outs, flat_outs):
        np.testing.assert_allclose(np.asarray(got).reshape(want.shape), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_a_traced_row_out_of_range_reads_nothing():
    rng = np.random.default_rng(14)
    for kind in ("append", "paged"):
        cache = KINDS[kind]((B, P)).append(chunk(rng, (B, P), ragged=False))
        q = jnp.asarray(rng.normal(size=(2, T, H, D)), jnp.float32)
        out, lse = jax.jit(lambda q, view, rows: jss.attend_with_lse(q, view, rows=rows))(
            q, cache.view(), jnp.array([1, 17]))
        want, _ = jss.attend_with_lse(q[:1], cache.view(), rows=jnp.array([1]))
        np.testing.assert_allclose(np.asarray(out[:1]), np.asarray(want), atol=1e-6)
        assert not np.asarray(out[1]).any() and np.isneginf(np.asarray(lse[1])).all()
