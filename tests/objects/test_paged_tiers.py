"""Quantized paged K/V (int8, fp8): appends, forks, demotion and attention, against float64 numpy references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _key_blocks
from tests.support.attention_reference import assert_close, reference

SLOTS, H, D, PAGE = 3, 2, 32, 4


def rows(rng, T, slots=SLOTS):
    """Random normal rows of very different magnitudes (each row its own scale), never zeros."""
    return jnp.asarray(rng.normal(size=(slots, T, H, D)) * rng.uniform(0.1, 10, size=(slots, T, H, 1)), jnp.float32)


def paged(num_pages=40, **kw):
    return jss.PagedKVCache.allocate(max_slots=SLOTS, kv_heads=H, head_dim=D, page_size=PAGE, num_pages=num_pages, **kw)


def reference_int8(x):
    """Symmetric per-row int8 round trip in float64."""
    x = np.asarray(x, np.float64)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    scale[scale == 0] = 1
    return np.clip(np.round(x / scale), -127, 127) * scale


def written_rows(rng, cache, steps=4):
    """Ragged random appends (jitted, donated); the rows each slot took, in order."""
    append = jax.jit(lambda c, chunk: c.append(chunk), donate_argnums=0)
    taken = [[] for _ in range(SLOTS)]
    for _ in range(steps):
        k, v = rows(rng, 5), rows(rng, 5)
        counts = rng.integers(0, 6, SLOTS).astype(np.int32)
        cache = append(cache, jss.KVChunk(k, v, jnp.asarray(counts)))
        for s in range(SLOTS):
            taken[s].append((np.asarray(k[s, : counts[s]]), np.asarray(v[s, : counts[s]])))
    return cache, [tuple(np.concatenate([part[i] for part in slot]) for i in range(2)) for slot in taken]


def test_int8_append_quantizes_only_the_rows_it_writes_in_place_and_compiles_once():
    rng = np.random.default_rng(0)
    cache = paged(quantize="int8")
    assert cache.k_pages.dtype == jnp.int8 and cache.k_scale.shape == (40, PAGE, H, 1)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def append(cache, chunk):
        return cache.append(chunk)

    donated = jax.jit(append.__wrapped__, donate_argnums=0)
    cache, written = written_rows(rng, cache)
    before = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(cache)]
    k, v = rows(rng, 2), rows(rng, 2)
    after = donated(cache, jss.KVChunk(k, v, jnp.asarray([2, 0, 1], jnp.int32)))
    assert [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(after)] == before  # in place
    written = [(np.concatenate([wk, k[s, :n]]), np.concatenate([wv, v[s, :n]]))
               for s, ((wk, wv), n) in enumerate(zip(written, (2, 0, 1)))]
    for (want_k, want_v), row in zip(written, after.view().materialize()):
        for got, want in ((row["k"], want_k), (row["v"], want_v)):
            assert got.shape == want.shape
            half_step = np.abs(want).max(axis=-1, keepdims=True) / 254
            assert np.all(np.abs(got - want) <= half_step * (1 + 1e-5))
            np.testing.assert_allclose(got, reference_int8(want), rtol=1e-5, atol=1e-6)
    for _ in range(3):  # one trace for every step
        append(after, jss.KVChunk(k, v, jnp.asarray([1, 1, 1], jnp.int32)))
    hlo = donated.lower(after, jss.KVChunk(k, v, jnp.asarray([1, 1, 1], jnp.int32))).compile().as_text()
    assert f"f32[40,{PAGE},{H},{D}]" not in hlo  # the pool is never widened: only the chunk's rows are quantized


def test_int8_pool_is_under_a_third_of_the_float32_pool():
    f32, int8 = paged(num_pages=64), paged(num_pages=64, quantize="int8")
    pool = lambda c: sum(getattr(c, n).nbytes for n in ("k_pages", "v_pages", "k_scale", "v_scale")  # noqa: E731
                         if getattr(c, n) is not None)
    assert pool(int8) <= 0.3 * pool(f32) and int8.nbytes <= 0.3 * f32.nbytes + 4096


def test_fp8_stays_within_its_relative_precision():
    rng = np.random.default_rng(1)
    cache, written = written_rows(rng, paged(quantize="fp8"))
    assert cache.k_pages.dtype == jnp.float8_e4m3fn
    for slot, (wanted, row) in enumerate(zip(written, cache.view().materialize())):
        for name, want in zip("kv", wanted):
            assert row[name].shape == want.shape, f"slot {slot} {name}"
            assert np.all(np.abs(row[name] - want) <= np.abs(want).max(axis=-1, keepdims=True) * 2.0**-4 + 1e-6), (
                f"slot {slot} {name}"
            )


def test_fork_copies_the_partial_page_with_its_scales_and_free_returns_pages():
    rng = np.random.default_rng(2)
    cache = paged(quantize="int8")
    k, v = rows(rng, 7), rows(rng, 7)
    cache = cache.append(jss.KVChunk(k, v, jnp.asarray([7, 0, 0], jnp.int32)))
    forked = jax.jit(lambda c: c.fork(0, 2), donate_argnums=0)(jax.tree_util.tree_map(jnp.copy, cache))
    src, _, dst = forked.view().materialize()
    for name in ("k", "v"):
        np.testing.assert_array_equal(dst[name], src[name])
        np.testing.assert_allclose(src[name], reference_int8(np.asarray((k, v)[name == "v"][0])), rtol=1e-5, atol=1e-6)
    table = np.asarray(forked.page_table)
    assert table[2, 0] == table[0, 0] and table[2, 1] != table[0, 1]  # page 0 shared, the partial page copied
    assert int(forked.free_count) == 40 - 3
    # The copy is written independently of its source.
    more = rows(rng, 1)
    grown = forked.append(jss.KVChunk(more, more, jnp.asarray([0, 0, 1], jnp.int32)))
    np.testing.assert_array_equal(grown.view().materialize()[0]["k"], src["k"])
    assert int(grown.free(2).free(0).free_count) == 40


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_demote_quantizes_every_page_in_place_of_the_bookkeeping_and_keeps_the_tables(dtype):
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rows(rng, 9), dtype) for _ in range(2))
    cache = paged(tiers=("int8",), dtype=dtype).append(jss.KVChunk(k, v, jnp.asarray([9, 4, 0], jnp.int32))).fork(1, 2)
    cache = cache.stage(jss.KVChunk(k[:, :2], v[:, :2], jnp.asarray([2, 0, 1], jnp.int32)))
    direct = paged(quantize="int8", dtype=dtype).append(jss.KVChunk(k, v, jnp.asarray([9, 4, 0], jnp.int32))).fork(1, 2)
    direct = direct.stage(jss.KVChunk(k[:, :2], v[:, :2], jnp.asarray([2, 0, 1], jnp.int32)))
    bookkeeping = ("page_table", "committed", "staged", "refcounts", "free_pages", "free_count")
    pointers = {name: getattr(cache, name).unsafe_buffer_pointer() for name in bookkeeping}
    before = {name: np.asarray(jnp.copy(getattr(cache, name))) for name in bookkeeping}  # no view of the donated
    demoted = jax.jit(lambda c: c.demote(), donate_argnums=0)(cache)
    assert any(x.is_deleted() for x in jax.tree_util.tree_leaves(cache))  # the input was donated
    assert (demoted.quantize, demoted.tiers, demoted.dtype) == ("int8", (), np.dtype(dtype))
    for name in bookkeeping:
        np.testing.assert_array_equal(np.asarray(getattr(demoted, name)), before[name])
        assert getattr(demoted, name).unsafe_buffer_pointer() == pointers[name], name  # reused, not copied
    for got, want in zip(demoted.view().materialize(), direct.view().materialize()):
        for name in ("positions", "k", "v"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert demoted.nbytes < (0.3 if dtype == jnp.float32 else 0.6) * paged(dtype=dtype).nbytes
    with pytest.raises(jss.NotDemotableError, match=r"PagedKVCache\(.*has no lower tier"):
        demoted.demote()


def test_bad_tiers_input_is_named_and_changes_nothing():
    with pytest.raises(TypeError, match=r"PagedKVCache.allocate: only a floating-point cache can be quantized"):
        paged(dtype=jnp.int32, quantize="int8")
    with pytest.raises(TypeError, match=r"PagedKVCache.allocate: only a floating-point cache"):
        paged(dtype=jnp.int32, tiers=("int8",))
    with pytest.raises(ValueError, match=r"PagedKVCache.allocate: quantize / tiers name a format in"):
        paged(quantize="int4")
    with pytest.raises(ValueError, match="has no lower tier"):
        paged(quantize="int8", tiers=("fp8",))
    one = jnp.ones((SLOTS, 2, H, D))
    cache = paged().append((one, one))
    with pytest.raises(jss.NotDemotableError, match=r"PagedKVCache\(.*tiers=\(\"int8\",\)"):
        cache.demote()
    assert cache.k_pages.dtype == jnp.float32 and cache.committed.tolist() == [2, 2, 2]
    with pytest.raises(jss.PayloadTypeError, match=r"PagedKVCache\(.*dtype float32"):
        paged(quantize="int8").append((one.astype(jnp.int8), one.astype(jnp.int8)))


def _quantized_paged_view(quantize, page_size, slots_lengths, rng):
    kw = dict(max_slots=len(slots_lengths), kv_heads=H, head_dim=D, page_size=page_size, quantize=quantize)
    longest = max(slots_lengths)
    cache = jss.PagedKVCache.allocate(num_pages=sum(-(-n // page_size) for n in slots_lengths) + 2, **kw)
    k, v = (rng.standard_normal((len(slots_lengths), longest, H, D)).astype(np.float32) for _ in range(2))
    cache = cache.append(jss.KVChunk(jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots_lengths, jnp.int32)))
    return cache.view(), k, v


@pytest.mark.parametrize("quantize, bound", [("int8", 2e-2), ("fp8", 8e-2)])
@pytest.mark.parametrize("implementation", [
    "auto", "loop", "bucketed",
    pytest.param("native", marks=pytest.mark.skipif(not _library.enabled(), reason="the native kernel is not built")),
])
def test_attend_over_quantized_pages_matches_float64_over_the_dequantized_rows(quantize, bound, implementation):
    """Several page blocks of the loop, the last partial; ragged slots; grouped queries; scales applied per block.

    Exact (to float32 rounding) against the dequantized rows; within the
    documented bound of attention over the rows written (random normal K/V).
    """
    rng = np.random.default_rng(4)
    block = _key_blocks.QUANTIZED_BLOCK_SIZE
    lengths = [block + 300, 17, 2 * block + 5]
    view, k, v = _quantized_paged_view(quantize, 16, lengths, rng)
    assert view.quantized and view.k_pages.dtype != jnp.float32
    dense = view.to_dense()
    dequantized = [np.asarray(x, np.float64) * np.asarray(s, np.float64)
                   for x, s in ((dense.k, dense.k_scale), (dense.v, dense.v_scale))]
    q = rng.standard_normal((len(lengths), 3, 2 * H, D)).astype(np.float32)
    attend = jax.jit(lambda q, view: jss.attend_with_lse(q, view, implementation=implementation))
    out, lse = attend(jnp.asarray(q), view)
    assert_close(out, lse, *reference(q, *dequantized, np.asarray(lengths), np.asarray(dense.positions)))
    capacity = dense.k.shape[2]
    pad = ((0, 0), (0, capacity - k.shape[1]), (0, 0), (0, 0))
    exact, _ = reference(q, np.moveaxis(np.pad(k, pad), 1, 2), np.moveaxis(np.pad(v, pad), 1, 2),
                         np.asarray(lengths), np.asarray(dense.positions))
    relative = np.linalg.norm(np.asarray(out) - exact) / np.linalg.norm(exact)
    assert 0 < relative <= bound  # the documented bound on normal data


def test_quantized_pages_are_read_in_place_by_the_kernel_and_the_loop():
    rng = np.random.default_rng(5)
    view, _, _ = _quantized_paged_view("int8", 16, [4000, 100, 2500], rng)
    q = jnp.asarray(rng.standard_normal((3, 1, H, D)), jnp.float32)
    pool_rows = view.k_pages.shape[0] * view.k_pages.shape[1]
    for implementation in ("auto", "loop"):
        hlo = jax.jit(functools.partial(jss.attend, implementation=implementation)).lower(q, view).compile()
        hlo = hlo.as_text()
        assert f"f32[{view.k_pages.shape[0]},16,{H},{D}]" not in hlo  # no float copy of the pool
        assert f"[{pool_rows}," not in hlo and f"f32[3,{H},{view.page_table.shape[1] * 16},{D}]" not in hlo
        assert (f'"{_library.QUANTIZED_PAGED_TARGET}"' in hlo) == (implementation == "auto" and _library.enabled())
    loop = jss.attend(q, view, implementation="loop")
    np.testing.assert_allclose(np.asarray(jss.attend(q, view)), np.asarray(loop), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["allocated", "demoted"])
def test_quantized_paged_cache_round_trips_a_checkpoint_exactly(tmp_path, how):
    rng = np.random.default_rng(6)
    cache, _ = written_rows(rng, paged(quantize="int8") if how == "allocated" else paged(tiers=("int8",)))
    cache = cache.fork(0, 2) if int(cache.committed[2]) == 0 else cache
    if how == "demoted":
        cache = cache.demote()
    session = jss.Session(objects={"kv": cache})
    jss.checkpoint.save(tmp_path / "ckpt", session)
    restores = (jss.checkpoint.restore(tmp_path / "ckpt"), jss.checkpoint.restore(tmp_path / "ckpt", target=session))
    for restored in restores:
        kv = restored["kv"]
        assert (kv.quantize, kv.tiers, kv.k_pages.dtype) == ("int8", (), jnp.int8)
        for name in kv.storage_fields():
            np.testing.assert_array_equal(np.asarray(getattr(kv, name)), np.asarray(getattr(cache, name)), err_msg=name)
        q = jnp.asarray(rng.standard_normal((SLOTS, 1, H, D)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(jss.attend(q, kv.view())), np.asarray(jss.attend(q, cache.view())))


def test_attend_under_vmap_over_stacked_quantized_caches_equals_each_alone():
    """A pool's vmap folds the scale pages with the pools (page ids offset per cache)."""
    rng = np.random.default_rng(7)
    caches = [written_rows(rng, paged(quantize="int8"), steps=3 + i)[0] for i in range(3)]
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *(c.view() for c in caches))
    q = jnp.asarray(rng.standard_normal((3, SLOTS, 1, 2 * H, D)), jnp.float32)
    out, lse = jax.jit(jax.vmap(jss.attend_with_lse))(q, stacked)
    for i, cache in enumerate(caches):
        alone = jss.attend_with_lse(q[i], cache.view())
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(alone[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[i]), np.asarray(alone[1]), rtol=1e-5, atol=1e-5)
