"""Writes into bfloat16 and float8 storage on CPU: in place, by the native row writer, as XLA would write them.

XLA:CPU converts a bfloat16 or float8 operand whole to float32 for any op on
it, so its own in-place writes copy the whole buffer.  These tests hold the
row writer to a plain numpy model on random data, hold every kind's write
through it to the same write in XLA ops (``_library.use(False)``), and check
by buffer pointer and compiled HLO that a donated write moves only its rows.
The tests of the writer skip, saying why, where the native kernel was not
built; the kinds then write in XLA ops, which the rest of the suite covers.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from jax_session_state._core import _library, _writes

needs_native = pytest.mark.skipif(
    not _library.AVAILABLE or jax.default_backend() != "cpu",
    reason=f"the native row writer runs on CPU only; here: {jax.default_backend()}, {_library.STATUS}",
)
CONVERTED = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2]


def as_f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def numpy_rows(buffer: np.ndarray, slots: np.ndarray, rows: np.ndarray, axis: int) -> np.ndarray:
    """The model: each row, in order, into its slot of its group; out-of-range slots dropped."""
    out = buffer.copy()
    lead, size, T = buffer.shape[:axis], buffer.shape[axis], rows.shape[axis]
    k = slots.ndim - 1
    for g in np.ndindex(*lead):
        for t in range(T):
            s = int(slots[g[:k] + (t,)])
            if 0 <= s < size:
                out[g + (s,)] = rows[g + (t,)]
    return out


def test_only_the_dtypes_xla_cpu_converts_take_the_row_writer():
    assert [_writes.converted_by_xla_cpu(d) for d in CONVERTED] == [True] * 3
    others = (jnp.float32, jnp.float16, jnp.int8, jnp.int32, jnp.bool_, jax.random.key(0).dtype)
    assert not any(_writes.converted_by_xla_cpu(d) for d in others)


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(CONVERTED + [jnp.float32, jnp.int8]),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    tail=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    size=st.integers(1, 9),
    T=st.integers(1, 6),
    data=st.data(),
)
def test_the_row_writer_matches_numpy_jitted_and_under_vmap(seed, dtype, lead, tail, size, T, data):
    rng = np.random.default_rng(seed)
    axis, k = len(lead), data.draw(st.integers(0, len(lead)))

    def operands():
        buffer, rows = (jnp.asarray(rng.normal(size=shape) * 4).astype(dtype)
                        for shape in ((*lead, size, *tail), (*lead, T, *tail)))
        slots = rng.integers(-2, size + 2, size=(*lead[:k], T)).astype(np.int32)  # some out of range: dropped
        return np.asarray(buffer), slots, np.asarray(rows)

    def write(b, s, r):
        return _library.write_rows(b, s, r, axis=axis)

    buffer, slots, rows = operands()
    np.testing.assert_array_equal(as_f32(jax.jit(write)(buffer, slots, rows)),
                                  numpy_rows(buffer, slots, rows, axis).astype(np.float32))
    lanes = [operands() for _ in range(3)]
    got = jax.jit(jax.vmap(write))(*(np.stack(parts) for parts in zip(*lanes)))
    for lane, (b, s, r) in enumerate(lanes):
        np.testing.assert_array_equal(as_f32(got[lane]), numpy_rows(b, s, r, axis).astype(np.float32))


@needs_native
def test_scatter_rows_in_xla_ops_is_the_same_write():
    rng = np.random.default_rng(0)
    buffer = jnp.asarray(rng.normal(size=(2, 3, 7, 4)), jnp.bfloat16)
    rows = jnp.asarray(rng.normal(size=(2, 3, 5, 4)), jnp.bfloat16)
    slots = jnp.asarray([[0, 6, 7, -1, 3], [2, 9, 4, 5, 1]], jnp.int32)
    np.testing.assert_array_equal(as_f32(_writes.scatter_rows(buffer, slots, rows, axis=2)),
                                  as_f32(_library.write_rows(buffer, slots, rows, axis=2)))


def random_kv(rng, cache, T, counts=None):
    shape = (cache.batch, T, cache.kv_heads, cache.head_dim)
    k, v = (jnp.asarray(rng.normal(size=shape), cache.dtype) for _ in range(2))
    return jss.KVChunk(k, v, None if counts is None else jnp.asarray(counts, jnp.int32))


def assert_same_leaves(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(as_f32(x), as_f32(y))


def both_ways(fn, *args):
    """``fn(*args)`` jitted with the native row writer and with XLA's writes, and whether the first called it."""
    results, calls = [], []
    for native in (True, False):
        with _library.use(native):
            jitted = jax.jit(lambda *a: fn(*a))  # its own trace, with the switch as set
            results.append(jitted(*args))
            calls.append(f'custom_call_target="{_library.WRITE_TARGET}"' in jitted.lower(*args).compile().as_text())
    assert not calls[1]
    return results, calls[0]


KV_CASES = {
    "append, one row": {"batch": 1, "capacity": 40},
    "append, batch rows": {"batch": 3, "capacity": 40},
    "ring": {"batch": 2, "window": 9, "sink": 2, "max_staged": 6},
    "fp8 tier": {"batch": 2, "capacity": 40, "quantize": "fp8"},
}


@needs_native
@pytest.mark.parametrize("case", KV_CASES, ids=list(KV_CASES))
def test_kv_cache_writes_natively_as_xla_writes(case):
    rng = np.random.default_rng(1)
    cache = jss.KVCache.allocate(kv_heads=2, head_dim=8, dtype=jnp.bfloat16, **KV_CASES[case])
    for T, counts in ((5, None), (4, [4, 1, 0][:cache.batch]), (6, None), (3, [0, 3, 2][:cache.batch])):
        chunk = random_kv(rng, cache, T, counts)
        (native, xla), called = both_ways(lambda c, x: c.append(x), cache, chunk)
        assert called
        assert_same_leaves(native, xla)
        cache = native
    assert int(cache.committed.max()) > 0 and np.any(as_f32(cache.k) != 0)


@needs_native
def test_item_buffers_and_paged_pools_write_natively_as_xla_writes():
    rng = np.random.default_rng(2)
    frames = jss.LatentBuffer.allocate(capacity=6, item_shape=(3, 4), dtype=jnp.bfloat16, ring=True)
    for n in (1, 3, 4):
        items = jnp.asarray(rng.normal(size=(n, 3, 4)) if n > 1 else rng.normal(size=(3, 4)), jnp.bfloat16)
        (native, xla), called = both_ways(lambda b, x: b.append(x), frames, items)
        assert called
        assert_same_leaves(native, xla)
        frames = native
    paged = jss.PagedKVCache.allocate(max_slots=3, kv_heads=2, head_dim=8, page_size=4, num_pages=12,
                                      dtype=jnp.bfloat16)
    chunk = jss.KVChunk(*(jnp.asarray(rng.normal(size=(3, 6, 2, 8)), jnp.bfloat16) for _ in range(2)),
                        jnp.asarray([6, 2, 0], jnp.int32))
    (native, xla), called = both_ways(lambda c, x: c.append(x), paged, chunk)
    assert called
    assert_same_leaves(native, xla)
    (forked, forked_xla), called = both_ways(lambda c: c.fork(0, 2), native)  # copies the partly filled page
    assert called
    assert_same_leaves(forked, forked_xla)
    assert int(forked.committed[2]) == 6


@needs_native
def test_conditioning_is_written_natively_once_and_then_no_more():
    rng = np.random.default_rng(7)
    cond = jss.EncodeOnceKV.allocate(batch=2, kv_heads=2, head_dim=8, capacity=10, dtype=jnp.bfloat16)
    chunk = random_kv(rng, cond, 7, [7, 4])
    written = []
    for _ in range(2):  # the second commit is a no-op: the conditioning is written once
        (native, xla), called = both_ways(lambda c, x: c.commit(x), cond, chunk)
        assert called
        assert_same_leaves(native, xla)
        cond, chunk = native, random_kv(rng, cond, 7, [7, 4])
        written.append(as_f32(cond.k))
    assert bool(cond.written) and np.any(written[0] != 0)
    np.testing.assert_array_equal(written[1], written[0])


@needs_native
def test_a_session_pool_of_bfloat16_sessions_inserts_natively_as_xla_does():
    def session(seed):
        cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=16, dtype=jnp.bfloat16)
        return jss.Session(objects={"kv": cache.append(random_kv(np.random.default_rng(seed), cache, 5))})

    pool = jss.SessionPool.allocate(session(0), slots=4)
    (native, xla), called = both_ways(lambda p, s: p.insert(2, s), pool, session(3))
    assert called
    assert_same_leaves(native, xla)
    assert_same_leaves(native.extract(2), session(3))


@needs_native
def test_a_donated_bfloat16_append_writes_its_rows_in_place_and_compiles_once():
    cache = jss.KVCache.allocate(batch=1, kv_heads=8, head_dim=64, capacity=4096, dtype=jnp.bfloat16)
    rng = np.random.default_rng(3)
    chunks = [random_kv(rng, cache, 16) for _ in range(4)]
    append = jax.jit(chex.assert_max_traces(lambda c, x: c.append(x), n=1), donate_argnums=0)
    text = append.lower(cache, chunks[0]).compile().as_text()
    assert f'custom_call_target="{_library.WRITE_TARGET}"' in text
    assert "f32[1,8,4096,64]" not in text  # no float32 copy of the cache
    assert "bf16[1,8,4096,64]{3,2,1,0} copy(" not in text
    cache = append(cache, chunks[0])
    before = cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()
    for chunk in chunks[1:]:
        cache = append(cache, chunk)
    assert (cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()) == before
    want = np.concatenate([as_f32(c.k) for c in chunks], axis=1)
    np.testing.assert_array_equal(as_f32(cache.k[:, :, :64]), want.transpose(0, 2, 1, 3))
    assert not np.any(as_f32(cache.k[:, :, 64:]))
    want_v = np.concatenate([as_f32(c.v) for c in chunks], axis=1)  # V too: each chunk at its offset
    np.testing.assert_array_equal(as_f32(cache.v[:, :, :64]), want_v.transpose(0, 2, 1, 3))
    assert not np.any(as_f32(cache.v[:, :, 64:]))
    assert cache.committed.tolist() == [64] and cache.staged.tolist() == [0]


@needs_native
def test_gradients_flow_through_a_native_write_as_through_xla_writes():
    rng = np.random.default_rng(4)
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=12, dtype=jnp.bfloat16)
    cache = cache.append(random_kv(rng, cache, 3))
    k = jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.bfloat16)
    weights = jnp.asarray(rng.normal(size=(1, 2, 12, 8)), jnp.float32)

    def loss(scale, held, cache):  # d/d scale: the rows written; d/d held: the rows kept
        cache = cache.with_storage(k=(cache.k * held).astype(jnp.bfloat16))
        written = cache.append(jss.KVChunk((k * scale).astype(jnp.bfloat16), k))
        return jnp.sum(written.k.astype(jnp.float32) * weights)

    grads = []
    for native in (True, False):
        with _library.use(native):
            grad = jax.jit(jax.grad(lambda *a: loss(*a), argnums=(0, 1)))
            grads.append(grad(jnp.float32(1.5), jnp.float32(0.5), cache))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)
    assert all(float(g) != 0.0 for g in grads[0])


def bf16_session(seed: int) -> jss.Session:
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=32, dtype=jnp.bfloat16)
    frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(8,), dtype=jnp.bfloat16, ring=True)
    rng = np.random.default_rng(seed)
    return jss.Session(objects={"kv": cache.append(random_kv(rng, cache, 3 + seed)), "frames": frames})


def bf16_step(session: jss.Session, rows: jax.Array) -> tuple[jss.Session, jax.Array]:
    """Appends ``rows`` ``[1, 2, 2, 8]`` as K and V, and their first row as a frame."""
    session = session.append(kv=jss.KVChunk(rows, rows), frames=rows[0, 0, 0])
    return session, session["kv"].committed


@needs_native
def test_a_pool_step_masks_the_native_writes_of_its_inactive_slots():
    from jax_session_state.pool._masked_step import run_masked

    rows = jnp.asarray(np.random.default_rng(5).normal(size=(1, 2, 2, 8)), jnp.bfloat16)
    session = bf16_session(0)
    written = [i for i, leaf in enumerate(jax.tree_util.tree_leaves(session)) if leaf.dtype == jnp.bfloat16]
    for live in (True, False):
        with _library.use(True):
            (stepped, _), origins = run_masked(bf16_step, jnp.bool_(live), session, rows)
        assert [origins[i] for i in written] == written  # written in place by masked writes: no select needed
        if not live:  # the rest (counters) the pool selects against the old leaves
            new, old = jax.tree_util.tree_leaves(stepped), jax.tree_util.tree_leaves(session)
            assert_same_leaves([new[i] for i in written], [old[i] for i in written])

    pool = jss.SessionPool.allocate(bf16_session(0), slots=4)
    for slot in (0, 2):
        pool = pool.insert(slot, bf16_session(slot + 1))
    per_slot = jnp.asarray(np.random.default_rng(6).normal(size=(4, 1, 2, 2, 8)), jnp.bfloat16)
    results = []
    for native in (True, False):
        with _library.use(native):
            map_step = jax.jit(lambda p, r: p.map(bf16_step, r), donate_argnums=0)
            fresh = jax.tree_util.tree_map(jnp.copy, pool)
            before = [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(fresh)]
            stepped, _ = map_step(fresh, per_slot)
            if native:
                assert [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(stepped)] == before
            results.append(stepped)
    assert_same_leaves(*results)

    def slot(p, i):
        return jax.tree_util.tree_map(lambda x: x[i], p.sessions)

    assert_same_leaves(slot(results[0], 1), slot(pool, 1))  # an empty slot: untouched
    assert int(results[0].extract(2).objects["kv"].committed[0]) == 3 + 3 + 2
    assert_same_leaves(slot(results[0], 3), slot(pool, 3))
    written = as_f32(per_slot)  # numpy: each live slot's two rows at its length, the rows before unchanged
    for live_slot in (0, 2):
        old, new = pool.extract(live_slot).objects, results[0].extract(live_slot).objects
        length = int(old["kv"].committed[0])
        assert new["kv"].committed.tolist() == [length + 2]
        for name in ("k", "v"):
            want = as_f32(getattr(old["kv"], name)).copy()
            want[:, :, length:length + 2] = written[live_slot].transpose(0, 2, 1, 3)
            np.testing.assert_array_equal(as_f32(getattr(new["kv"], name)), want, err_msg=f"slot {live_slot} {name}")
        np.testing.assert_array_equal(as_f32(new["frames"].view().materialize()), written[live_slot, :1, 0, 0])


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
def test_gpu_and_tpu_lowerings_keep_xla_writes(platform):
    """Lowered for an accelerator (``jax.export``, no device needed), a bfloat16 step holds no native call."""
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=64, dtype=jnp.bfloat16)
    frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(8,), dtype=jnp.bfloat16)
    rows = jnp.ones((1, 4, 2, 8), jnp.bfloat16)

    def step(cache, frames, rows):
        cache = cache.append(jss.KVChunk(rows, rows))
        return cache, frames.append(rows[0, 0, 0]), jss.attend(rows, cache.view())

    module = jax.export.export(jax.jit(step), platforms=[platform])(cache, frames, rows).mlir_module()
    assert "stablehlo.custom_call @jax_session_state" not in module
    assert "dynamic_update_slice" in module
    if _library.enabled():  # the same step lowered for this CPU does call it
        assert f"custom_call @{_library.WRITE_TARGET}" in jax.jit(step).lower(cache, frames, rows).as_text()
