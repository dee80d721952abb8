"""attend() against a naive float64 numpy reference, on every kind of view.

The reference and the error metric are in ``attention_reference.py``.

Every test runs twice: with the native CPU kernel of append mode (where it
was built) and with the pure-JAX kernels only.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _bucketed, _key_blocks
from tests.support.attention_reference import append_view, assert_close, randn, reference

EXAMPLES = settings(max_examples=25)


@pytest.fixture(scope="module", autouse=True, params=["native", "pure"])
def kernel(request):
    """Runs the module with the native kernel, then without it (jit caches cleared in between)."""
    native = request.param == "native"
    if native and not _library.AVAILABLE:
        pytest.skip(f"the native kernel is not available here ({_library.STATUS}); the pure run covers attend()")
    jax.clear_caches()
    jitted.cache_clear()
    with _library.use(native):
        yield request.param


def ring_positions(length, capacity, sink):
    positions = np.full(capacity, -1, np.int32)
    for p in range(length):
        positions[p if p < sink else sink + (p - sink) % (capacity - sink)] = p
    return positions


@functools.cache
def jitted(**static):
    return jax.jit(functools.partial(jss.attend_with_lse, **static))


@EXAMPLES
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    T=st.sampled_from([1, 3, 16]),
    capacity=st.sampled_from([16, 77, 200]),
    causal=st.booleans(),
)
def test_append_mode(seed, batch, kv_heads, groups, T, capacity, causal):
    rng = np.random.default_rng(seed)
    q = randn(rng, batch, T, kv_heads * groups, 8)
    k, v = randn(rng, batch, kv_heads, capacity, 8), randn(rng, batch, kv_heads, capacity, 8)
    lengths = rng.integers(0, capacity + 1, batch).astype(np.int32)
    lengths[0] = 0 if seed % 3 == 0 else lengths[0]  # empty rows
    view = append_view(k, v, lengths)
    out, lse = jitted(causal=causal)(q, view)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert_close(out, lse, *reference(q, k, v, lengths, view.positions, causal=causal))


@EXAMPLES
@given(
    seed=st.integers(0, 2**31 - 1), T=st.sampled_from([1, 16]), causal=st.booleans(), scale=st.sampled_from([None, 0.3])
)
def test_explicit_query_positions(seed, T, causal, scale):
    rng = np.random.default_rng(seed)
    q = randn(rng, 2, T, 4, 8)
    k, v = randn(rng, 2, 2, 150, 8), randn(rng, 2, 2, 150, 8)
    lengths = rng.integers(0, 151, 2).astype(np.int32)
    q_positions = jnp.asarray(rng.integers(-3, 153, (2, T)), jnp.int32)
    view = append_view(k, v, lengths)
    out, lse = jss.attend_with_lse(q, view, causal=causal, scale=scale, q_positions=q_positions)
    ref = reference(q, k, v, lengths, view.positions, causal=causal, scale=scale, q_positions=q_positions)
    assert_close(out, lse, *ref)


@EXAMPLES
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    T=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([1, 5, 12]),
    sink=st.sampled_from([0, 1, 3]),
    causal=st.just(True),  # causal=False on a ring raises (tests/attention/test_frames.py)
)
def test_ring_mode_with_wraparound_and_sinks(seed, batch, groups, T, window, sink, causal):
    rng = np.random.default_rng(seed)
    capacity = sink + window + T + 1
    lengths = rng.integers(0, 4 * capacity, batch).astype(np.int32)  # wraps several times
    positions = np.stack([ring_positions(int(n), capacity, sink) for n in lengths])
    q = randn(rng, batch, T, 2 * groups, 8)
    k, v = randn(rng, batch, 2, capacity, 8), randn(rng, batch, 2, capacity, 8)
    view = jss.KVView(
        k=k, v=v, lengths=jnp.asarray(lengths), positions=jnp.asarray(positions), window=window, sink=sink
    )
    out, lse = jitted(causal=causal)(q, view)
    assert_close(out, lse, *reference(q, k, v, lengths, positions, window=window, sink=sink, causal=causal))


def test_ring_cache_equals_windowed_attention_over_the_whole_history():
    rng = np.random.default_rng(1)
    window, sink, chunk, steps = 6, 2, 4, 9
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, window=window, sink=sink, max_staged=chunk)
    history_k, history_v = [], []
    for _ in range(steps):
        k, v = randn(rng, 1, chunk, 2, 8), randn(rng, 1, chunk, 2, 8)
        history_k.append(k), history_v.append(v)
        cache = cache.append((jnp.asarray(k), jnp.asarray(v)))
        q = randn(rng, 1, chunk, 4, 8)
        out, lse = jss.attend_with_lse(q, cache.view())
        all_k = np.concatenate(history_k, 1).transpose(0, 2, 1, 3)
        all_v = np.concatenate(history_v, 1).transpose(0, 2, 1, 3)
        n = all_k.shape[2]
        assert_close(out, lse, *reference(q, all_k, all_v, [n], np.arange(n)[None], window=window, sink=sink))


@pytest.mark.parametrize("ring", [False, True], ids=["append", "ring"])
def test_cascade_over_branch_lanes_equals_the_concatenation(ring):
    rng = np.random.default_rng(2)
    H, D, T = 2, 8, 3
    kv = (
        jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, window=7, sink=2, max_staged=T)
        if ring
        else jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=256)
    )
    session = jss.Session(objects={"kv": kv})
    prefix_k, prefix_v = [], []
    for _ in range(6):
        k, v = randn(rng, 1, T, H, D), randn(rng, 1, T, H, D)
        prefix_k.append(k), prefix_v.append(v)
        session = session.append(kv=(jnp.asarray(k), jnp.asarray(v)))
    lanes, chunks = 4, 3
    rows_k, rows_v = randn(rng, lanes, chunks, 1, T, H, D), randn(rng, lanes, chunks, 1, T, H, D)
    queries = randn(rng, lanes, chunks, 1, T, 2 * H, D)

    def lane_rollout(lane, rows_k, rows_v, queries):
        outs = []
        for c in range(chunks):
            lane = lane.stage(kv=(rows_k[c], rows_v[c]))
            outs.append(jss.attend_with_lse(queries[c], lane.view()["kv"]))
        return lane, outs

    rollout = jax.jit(lambda s, k, v, q: s.branch(lanes, window=chunks * T).map(lane_rollout, k, v, q))
    _, outs = rollout(session, rows_k, rows_v, queries)
    for lane in range(lanes):
        history_k, history_v = (
            np.concatenate(prefix + [rows[lane, c] for c in range(chunks)], 1).transpose(0, 2, 1, 3)
            for prefix, rows in ((prefix_k, rows_k), (prefix_v, rows_v)))
        for c in range(chunks):
            n = (len(prefix_k) + c + 1) * T
            ref = reference(queries[lane, c], history_k[:, :, :n], history_v[:, :, :n], [n], np.arange(n)[None],
                            window=7 if ring else None, sink=2 if ring else 0)
            assert_close(outs[c][0][lane], outs[c][1][lane], *ref)


def test_merge_both_empty_is_zero_not_nan():
    zeros, empty = jnp.zeros((1, 2, 3, 4)), jnp.full((1, 2, 3), -jnp.inf)
    out, lse = jss.merge_attention(zeros, empty, zeros, empty)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def _paged_and_dense(rng, slots=3, kv_heads=2, head_dim=8, page_size=4, num_pages=40, steps=5, dtype=jnp.float32):
    """The same random ragged rows appended to a paged cache and to a dense one."""
    paged = jss.PagedKVCache.allocate(max_slots=slots, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                                      num_pages=num_pages, dtype=dtype)
    dense = jss.KVCache.allocate(batch=slots, kv_heads=kv_heads, head_dim=head_dim, capacity=steps * 7, dtype=dtype)
    for _ in range(steps):
        k = jnp.asarray(randn(rng, slots, 7, kv_heads, head_dim), dtype)
        v = jnp.asarray(randn(rng, slots, 7, kv_heads, head_dim), dtype)
        counts = jnp.asarray(rng.integers(0, 8, slots), jnp.int32)
        paged, dense = paged.append(jss.KVChunk(k, v, counts)), dense.append(jss.KVChunk(k, v, counts))
    return paged, dense


@pytest.mark.parametrize("implementation", ["auto", "loop", "bucketed"])
@pytest.mark.parametrize("page_size", [4, 16, 128])
def test_paged_view_equals_dense(implementation, page_size):
    rng = np.random.default_rng(3 + page_size)
    paged, dense = _paged_and_dense(rng, page_size=page_size, num_pages=3 * -(-35 // page_size) + 2)
    view = dense.view()
    for T in (1, 3):
        q = randn(rng, 3, T, 4, 8)
        out, lse = jitted(implementation=implementation)(q, paged.view())
        assert_close(out, lse, *reference(q, view.k, view.v, view.lengths, view.positions))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_step_reads_pages_in_place_with_no_pool_sized_gather(dtype):
    """The compiled step gathers at most one block of pages at a time (or none: the native kernel)."""
    rng = np.random.default_rng(8)
    pages, size = 512, 16  # a pool of 8192 rows, no other array of the step is this size
    paged, dense = _paged_and_dense(rng, page_size=size, num_pages=pages, dtype=dtype)
    q = jnp.asarray(randn(rng, 3, 2, 4, 8))
    hlo = jax.jit(lambda q, view: jss.attend_with_lse(q, view)).lower(q, paged.view()).compile().as_text()
    for shape in re.findall(r"= \w+\[([\d,]*)\]\S* gather\(", hlo):
        rows = np.prod([int(d) for d in shape.split(",") if d]) // (2 * 8)  # rows of kv_heads x head_dim
        block = jss.attention.PAGED_BLOCK_SIZE
        assert rows <= 3 * block, f"a gather of {rows} rows in a step over a pool of {pages * size}"
    assert "gather(" in hlo or _library.PAGED_TARGET in hlo
    assert f"[{pages * size}," not in hlo and f",{pages * size}," not in hlo  # nothing the size of the dense view
    view = dense.view()
    ref = reference(q, np.asarray(view.k, np.float64), np.asarray(view.v, np.float64), view.lengths, view.positions)
    assert_close(*jss.attend_with_lse(q, paged.view()), *ref)


@EXAMPLES
@given(seed=st.integers(0, 2**31 - 1), T=st.sampled_from([1, 4]), groups=st.sampled_from([1, 2]),
       causal=st.booleans(), capacity=st.sampled_from([100, 300, 600]))
def test_bucketed_implementation_matches_float64_on_ragged_rows(seed, T, groups, causal, capacity):
    rng = np.random.default_rng(seed)
    q = randn(rng, 3, T, 2 * groups, 16)
    k, v = randn(rng, 3, 2, capacity, 16), randn(rng, 3, 2, capacity, 16)
    lengths = rng.integers(0, capacity + 1, 3).astype(np.int32)
    view = append_view(k, v, lengths)
    out, lse = jitted(implementation="bucketed", causal=causal)(q, view)
    assert_close(out, lse, *reference(q, k, v, lengths, view.positions, causal=causal))


def test_bucketed_implementation_is_a_switch_over_static_prefixes_and_compiles_once():
    traces = []

    @jax.jit
    def f(q, view):
        traces.append(None)
        return jss.attend(q, view, implementation="bucketed")

    capacity = 2000
    assert _bucketed.buckets(capacity) == [256, 512, 1024, capacity]
    rng = np.random.default_rng(9)
    q, k, v = randn(rng, 1, 1, 2, 8), randn(rng, 1, 2, capacity, 8), randn(rng, 1, 2, capacity, 8)
    hlo = f.lower(q, append_view(k, v, [5])).compile().as_text()
    assert " conditional(" in hlo and " while(" not in hlo
    for length in (0, 5, 700, capacity):
        view = append_view(k, v, [length])
        np.testing.assert_allclose(f(q, view), reference(q, k, v, [length], view.positions)[0], atol=1e-5)
    assert len(traces) == 1


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_dtype", ["float32", "cache"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_bucketed_implementation_over_a_16_bit_cache_matches_float64(dtype, q_dtype, paged):
    """Keys and values read as stored (not widened) still give float32 accuracy on their rounded values."""
    rng = np.random.default_rng(12)
    q_dtype = dtype if q_dtype == "cache" else jnp.float32
    paged_cache, dense = _paged_and_dense(rng, page_size=16, num_pages=12, dtype=dtype)
    view = dense.view()
    for T in (1, 4):
        q = jnp.asarray(3 * randn(rng, 3, T, 4, 8), q_dtype)
        out, lse = jitted(implementation="bucketed")(q, paged_cache.view() if paged else view)
        assert out.dtype == q_dtype and lse.dtype == jnp.float32
        ref_out, ref_lse = reference(*(np.asarray(x, np.float64) for x in (q, view.k, view.v)), view.lengths,
                                     view.positions)
        if q_dtype == jnp.float32:
            assert_close(out, lse, ref_out, ref_lse)
        else:  # the scores are exact; the output is rounded to q's 16-bit dtype
            assert_close(np.asarray(out, np.float64), lse, np.asarray(jnp.asarray(ref_out, dtype), np.float64), ref_lse)


@pytest.mark.parametrize("paged", [False, True])
def test_bucketed_implementation_does_not_widen_a_16_bit_cache(paged):
    """No bucket of a bfloat16 cache is converted to float32: its dots read it as stored (bfloat16 queries),
    and only the keys are widened for float32 queries, never the values."""
    rng = np.random.default_rng(13)
    paged_cache, dense = _paged_and_dense(rng, page_size=16, num_pages=40, steps=40, dtype=jnp.bfloat16)
    view = paged_cache.view() if paged else dense.view()
    sizes = _bucketed.buckets(view.page_table.shape[1] * view.page_size if paged else view.k.shape[2])
    assert len(sizes) > 1
    for q_dtype, widened in ((jnp.bfloat16, 0), (jnp.float32, len(sizes))):
        q = jnp.asarray(randn(rng, 3, 1, 4, 8), q_dtype)
        text = jax.jit(functools.partial(jss.attend, implementation="bucketed")).lower(q, view).as_text()
        converts = re.findall(r"stablehlo\.convert %\S+ : \(tensor<3x2x(\d+)x8xbf16>\) -> tensor<3x2x\d+x8xf32>", text)
        assert len([n for n in converts if int(n) in sizes]) == widened, converts


def test_unknown_or_unavailable_implementations_are_named():
    view = append_view(np.ones((1, 1, 8, 4), np.float32), np.ones((1, 1, 8, 4), np.float32), [3])
    with pytest.raises(jss.PayloadError, match=r"implementation must be one of .*'fused'"):
        jss.attend(jnp.ones((1, 1, 1, 4)), view, implementation="fused")
    if not _library.enabled():
        with pytest.raises(RuntimeError, match="the native kernel is not in use"):
            jss.attend(jnp.ones((1, 1, 1, 4)), view, implementation="native")


def test_one_compile_for_every_length():
    traces = []

    @jax.jit
    def f(q, view):
        traces.append(None)
        return jss.attend_with_lse(q, view)

    rng = np.random.default_rng(4)
    q = randn(rng, 2, 1, 2, 8)
    k, v = randn(rng, 2, 2, 100, 8), randn(rng, 2, 2, 100, 8)
    for lengths in ([0, 0], [3, 17], [100, 64], [33, 1]):
        view = append_view(k, v, lengths)
        assert_close(*f(q, view), *reference(q, k, v, lengths, view.positions))  # out and lse of the one compile
    assert len(traces) == 1


def test_vmap_over_views():
    rng = np.random.default_rng(5)
    q = randn(rng, 3, 2, 4, 4, 8)
    k, v = randn(rng, 3, 2, 2, 40, 8), randn(rng, 3, 2, 2, 40, 8)
    lengths = rng.integers(0, 41, (3, 2)).astype(np.int32)
    out, lse = jax.jit(jax.vmap(lambda q, k, v, n: jss.attend_with_lse(q, append_view_jnp(k, v, n))))(q, k, v, lengths)
    for i in range(3):
        positions = np.where(np.arange(40) < lengths[i][:, None], np.arange(40), -1)
        assert_close(out[i], lse[i], *reference(q[i], k[i], v[i], lengths[i], positions))


def append_view_jnp(k, v, lengths):
    capacity = k.shape[2]
    iota = jnp.arange(capacity)
    return jss.KVView(k=k, v=v, lengths=lengths, positions=jnp.where(iota < lengths[:, None], iota, -1))


def test_bfloat16_cache_accumulates_in_float32():
    rng = np.random.default_rng(6)
    q = jnp.asarray(randn(rng, 1, 16, 4, 32), jnp.bfloat16)
    k, v = (jnp.asarray(randn(rng, 1, 2, 300, 32), jnp.bfloat16) for _ in range(2))
    view = append_view_jnp(k, v, jnp.asarray([257], jnp.int32))
    out, lse = jss.attend_with_lse(q, view)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref, _ = reference(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), [257],
                       np.asarray(view.positions))
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 1e-2 * np.max(np.abs(ref))


@pytest.mark.parametrize(
    "q_shape, match",
    [
        ((1, 4, 3, 8), r"q_heads=3 is not a multiple of the view's kv_heads=2"),
        ((2, 4, 4, 8), r"q must be \[\*batch, T, q_heads, head_dim\] with batch \[1\].*got q of shape \[2, 4, 4, 8\]"),
        ((1, 4, 4, 16), "q has head_dim 16 but the view has head_dim 8"),
        ((4, 4, 8), r"q must be \[\*batch, T, q_heads, head_dim\]; got shape \[4, 4, 8\]"),
    ],
)
def test_bad_queries_are_named(q_shape, match):
    view = append_view_jnp(jnp.zeros((1, 2, 16, 8)), jnp.zeros((1, 2, 16, 8)), jnp.asarray([4], jnp.int32))
    with pytest.raises(jss.PayloadError, match=match):
        jss.attend(jnp.ones(q_shape), view)


def test_bad_positions_and_views_are_named():
    view = append_view_jnp(jnp.zeros((1, 2, 16, 8)), jnp.zeros((1, 2, 16, 8)), jnp.asarray([4], jnp.int32))
    with pytest.raises(jss.PayloadError, match=r"q_positions must have shape \[1, 4\]"):
        jss.attend(jnp.ones((1, 4, 2, 8)), view, q_positions=jnp.zeros((4,), jnp.int32))
    with pytest.raises(jss.PayloadTypeError, match="got LatentView"):
        jss.attend(jnp.ones((1, 4, 2, 8)), jss.LatentBuffer.allocate(capacity=2, item_shape=(1,)).view())


def test_append_step_does_no_work_over_the_whole_capacity():
    """The view's positions ([batch, capacity]) are not read in append mode: XLA drops them from a step."""
    capacity = 4093  # a size no other array of the step has

    def step(cache, q, rows):
        cache = cache.append((rows, rows))
        return cache, jss.attend(q, cache.view())

    cache = jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=8, capacity=capacity)
    rows, q = jnp.ones((2, 3, 2, 8)), jnp.ones((2, 3, 4, 8))
    hlo = jax.jit(step, donate_argnums=0).lower(cache, q, rows).compile().as_text()
    assert not re.search(rf"(s32|pred)\[2,{capacity}\]", hlo)


@pytest.mark.usefixtures("kernel_takes_every_step")
def test_branch_lanes_read_the_prefix_once():
    """Under vmap over lanes, the shared prefix is read once for all lanes: in place by one native call
    with every lane's queries as rows, or (pure) in unbatched blocks (no per-lane gather)."""
    lanes, capacity = 5, 203
    session = jss.Session(objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=capacity)})
    session = session.append(kv=(jnp.ones((1, 100, 2, 8)), jnp.ones((1, 100, 2, 8))))

    def lane_step(lane, q):
        lane = lane.stage(kv=(q[:, :, :2], q[:, :, :2]))
        return lane, jss.attend(q, lane.view()["kv"])

    step = jax.jit(lambda branches, q: branches.map(lane_step, q))
    q = jnp.asarray(randn(np.random.default_rng(7), lanes, 1, 3, 4, 8))
    hlo = step.lower(session.branch(lanes, window=6), q).compile().as_text()
    shapes = dict(re.findall(r"(%[\w.-]+) = (\S+?)\{", hlo))
    prefix = f"f32[1,2,{capacity},8]"
    reads = [(op, shape) for shape, op, operand in re.findall(r"= (\S+?)\{\S* (dynamic-slice|gather)\((%[\w.-]+)", hlo)
             if shapes.get(operand) == prefix]
    calls = re.findall(
        rf"= \(f32\[([\d,]+)\][^)]*\) custom-call\(([^)]*)\), custom_call_target=\"{_library.TARGET}\"", hlo
    )
    if _library.enabled():
        assert not reads, reads
        assert len(calls) == 1 and calls[0][0] == f"1,{lanes * 3},4,8", calls  # every lane's queries, one call
        assert [shapes.get(x) for x in calls[0][1].split(", ")[1:3]] == [prefix, prefix]  # k, v: the parameters
    else:
        assert not calls
        assert reads and all(op == "dynamic-slice" and re.fullmatch(r"f32\[1,2,\d+,8\]", s) for op, s in reads), reads


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_quantized_cache_matches_float64_attention_over_its_dequantized_rows(quantize):
    """Blocks of a quantized cache are read as values times row scales: exact up to float32 rounding.

    The capacity spans several quantized blocks and is not a multiple of one
    (the last block is shifted back); the rows are ragged, queries grouped.
    """
    rng = np.random.default_rng(7)
    B, kv_heads, groups, D, T = 2, 2, 2, 16, 3
    capacity = 2 * _key_blocks.QUANTIZED_BLOCK_SIZE + 37
    lengths = np.array([capacity, _key_blocks.QUANTIZED_BLOCK_SIZE + 5], np.int32)
    k, v = randn(rng, B, capacity, kv_heads, D) * 3, randn(rng, B, capacity, kv_heads, D)
    cache = jss.KVCache.allocate(batch=B, kv_heads=kv_heads, head_dim=D, capacity=capacity, quantize=quantize)
    cache = cache.append(jss.KVChunk(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths)))
    view = cache.view()
    q = randn(rng, B, T, kv_heads * groups, D)
    out, lse = jss.attend_with_lse(jnp.asarray(q), view)
    dequantized = [np.asarray(x, np.float64) * np.asarray(s, np.float64)
                   for x, s in ((view.k, view.k_scale), (view.v, view.v_scale))]
    assert_close(out, lse, *reference(q, *dequantized, lengths, np.asarray(view.positions)))
    exact, _ = reference(q, np.moveaxis(k, 1, 2), np.moveaxis(v, 1, 2), lengths, np.asarray(view.positions))
    relative = np.linalg.norm(np.asarray(out) - exact) / np.linalg.norm(exact)
    assert 0 < relative <= (2e-2 if quantize == "int8" else 8e-2)  # the documented bound on normal data
