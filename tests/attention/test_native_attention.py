"""The native CPU kernel of append-mode attention: against float64, under vmap and grad, in a compiled step.

Tests of the kernel itself skip, saying why, where it was not built; without
it the library runs the pure-JAX kernels, which the "pure" run of
``test_attention.py`` covers, and the switch tests at the end always run.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _native
from tests.support.attention_reference import (
    append_view,
    assert_close,
    assert_directional_derivatives,
    randn,
    reference,
)

needs_native = pytest.mark.skipif(
    not _library.AVAILABLE or jax.default_backend() != "cpu",
    reason=f"the native kernel runs on CPU only; here: {jax.default_backend()}, {_library.STATUS}",
)


@functools.cache
def native_attend(causal):
    """attend_with_lse jitted with the native kernel; q_positions may be None."""
    with _library.use(True):
        f = jax.jit(lambda q, view, q_positions: jss.attend_with_lse(q, view, causal=causal, q_positions=q_positions))
        return lambda *args: _traced_with(True, f, *args)


def _traced_with(native, f, *args):
    with _library.use(native):  # a first call traces: with the switch as asked
        return f(*args)


def calls_native(hlo):
    return hlo.count(f'custom_call_target="{_library.TARGET}"')


@needs_native
@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    T=st.sampled_from([1, 3, 16]),
    head_dim=st.sampled_from([8, 16, 32, 64]),
    capacity=st.sampled_from([16, 77, 300]),
    causal=st.booleans(),
    explicit_positions=st.booleans(),
)
def test_native_matches_float64(seed, batch, kv_heads, groups, T, head_dim, capacity, causal, explicit_positions):
    rng = np.random.default_rng(seed)
    q = randn(rng, batch, T, kv_heads * groups, head_dim)
    k, v = randn(rng, batch, kv_heads, capacity, head_dim), randn(rng, batch, kv_heads, capacity, head_dim)
    lengths = rng.integers(0, capacity + 1, batch).astype(np.int32)
    lengths[0] = 0 if seed % 3 == 0 else lengths[0]  # empty rows
    q_positions = jnp.asarray(rng.integers(-3, capacity + 3, (batch, T)), jnp.int32) if explicit_positions else None
    view = append_view(k, v, lengths)
    out, lse = native_attend(causal)(q, view, q_positions)
    ref = reference(q, k, v, lengths, view.positions, causal=causal, q_positions=q_positions)
    assert_close(out, lse, *ref)


@needs_native
@pytest.mark.parametrize("T, groups", [(16, 2), (1, 1)], ids=["rows-in-lanes", "dot-per-row"])
def test_long_rows_split_over_threads_merge_exactly(T, groups):
    """Enough keys that the kernel splits each (row, kv head) over threads and merges by log-sum-exp."""
    rng = np.random.default_rng(11)
    capacity = 20000 if T == 1 else 2304
    q = randn(rng, 1, T, 2 * groups, 64)
    k, v = randn(rng, 1, 2, capacity, 64), randn(rng, 1, 2, capacity, 64)
    lengths = np.asarray([capacity - 37], np.int32)
    view = append_view(k, v, lengths)
    for causal in (True, False):
        assert_close(*native_attend(causal)(q, view, None), *reference(q, k, v, lengths, view.positions, causal=causal))


def lane_inputs(rng, lanes=3, T=4):
    q = randn(rng, lanes, 2, T, 4, 32)
    k, v = randn(rng, 2, 2, 90, 32), randn(rng, 2, 2, 90, 32)
    lengths = np.asarray([70, 0], np.int32)
    q_positions = rng.integers(-2, 90, (lanes, 2, T)).astype(np.int32)
    return q, k, v, lengths, q_positions


@needs_native
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_vmap_over_lanes_sharing_a_cache_is_one_call_with_every_lane_as_rows():
    rng = np.random.default_rng(12)
    q, k, v, lengths, q_positions = lane_inputs(rng)
    view = append_view(k, v, lengths)
    f = jax.jit(jax.vmap(lambda q, p: jss.attend_with_lse(q, view, q_positions=p)))
    hlo = _traced_with(True, lambda: f.lower(q, q_positions).compile().as_text())
    assert calls_native(hlo) == 1
    out, lse = _traced_with(True, f, q, q_positions)
    for lane in range(q.shape[0]):
        ref = reference(q[lane], k, v, lengths, view.positions, q_positions=q_positions[lane])
        assert_close(out[lane], lse[lane], *ref)


@needs_native
def test_vmap_with_only_some_cache_operands_batched_falls_back_to_the_pure_kernel():
    rng = np.random.default_rng(13)
    q, k, v, lengths, q_positions = lane_inputs(rng)
    ks = np.stack([k, 2 * k, -k])  # one K per lane, V and lengths shared

    def attend_one(q, k, p):
        return jss.attend_with_lse(q, jss.KVView(k=k, v=jnp.asarray(v), lengths=jnp.asarray(lengths),
                                                 positions=jnp.zeros((2, 90), jnp.int32)), q_positions=p)

    out, lse = _traced_with(True, jax.jit(jax.vmap(attend_one)), q, ks, q_positions)
    positions = append_view(k, v, lengths).positions
    for lane in range(3):
        assert_close(out[lane], lse[lane], *reference(q[lane], ks[lane], v, lengths, positions,
                                                      q_positions=q_positions[lane]))


def loss(q, k, v, lengths, q_positions, weights):
    """A scalar of both outputs, so the gradient flows through out and lse."""
    view = jss.KVView(k=k, v=v, lengths=lengths, positions=jnp.zeros(lengths.shape + (1,), jnp.int32))
    out, lse = jss.attend_with_lse(q, view, q_positions=q_positions)
    return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), 0.3 * lse, 0.0))


def reference_loss(q, k, v, lengths, q_positions, weights):
    """``loss`` in float64 through the naive reference."""
    capacity = np.shape(k)[2]
    positions = np.where(np.arange(capacity) < np.asarray(lengths)[:, None], np.arange(capacity), -1)
    out, lse = reference(q, k, v, lengths, positions, q_positions=q_positions)
    return np.sum(out * weights) + np.sum(np.where(np.isfinite(lse), 0.3 * lse, 0.0))


def grad_inputs(seed, T=5):
    rng = np.random.default_rng(seed)
    q = randn(rng, 2, T, 4, 8)
    k, v = randn(rng, 2, 2, 70, 8), randn(rng, 2, 2, 70, 8)
    lengths = np.asarray([57, 0], np.int32)  # one row sees nothing
    q_positions = np.asarray([[60, 3, 20, -1, 56], [1, 2, 3, 4, 5]], np.int32)[:, :T]
    return q, k, v, lengths, q_positions, randn(rng, 2, T, 4, 8)


def pure_grad(*args):
    """The pure kernel's own autodiff (eager, concrete lengths: its loop is then a scan)."""
    with _library.use(False):
        return jax.grad(loss, argnums=(0, 1, 2))(*map(jnp.asarray, args))


@needs_native
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_grad_through_native_attend_equals_the_pure_kernels_autodiff_even_jitted():
    args = grad_inputs(14)
    expected = pure_grad(*args)
    native_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # lengths traced: the pure kernel could not
    native = _traced_with(True, native_grad, *args)
    q, k, v, lengths, q_positions, weights = args
    f = lambda x: reference_loss(*x, lengths, q_positions, weights)  # noqa: E731
    assert_directional_derivatives(native, (q, k, v), f, np.random.default_rng(140))
    for got, want in zip(native, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(expected[1]))) > 0  # the comparison is not of zeros


@needs_native
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_grad_and_vmap_compose_both_ways():
    q, k, v, lengths, q_positions, weights = grad_inputs(15, T=3)
    lanes = np.stack([q, -q, 0.5 * q])
    lane_positions = np.stack([q_positions, q_positions + 1, q_positions - 4])

    def lanes_loss(k, lanes, lane_positions):
        per_lane = jax.vmap(lambda q, p: loss(q, k, v, lengths, p, weights))(lanes, lane_positions)
        return jnp.sum(per_lane)

    # grad of a vmap over lanes that share the cache: into the shared K and into each lane's queries
    native = _traced_with(True, jax.jit(jax.grad(lanes_loss, argnums=(0, 1))), k, lanes, lane_positions)
    with _library.use(False):
        expected = jax.grad(lanes_loss, argnums=(0, 1))(*map(jnp.asarray, (k, lanes, lane_positions)))
    rng = np.random.default_rng(150)
    f = lambda x: sum(reference_loss(x[1][lane], x[0], v, lengths, lane_positions[lane], weights)  # noqa: E731
                      for lane in range(3))
    assert_directional_derivatives(native, (k, lanes), f, rng)
    for got, want in zip(native, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # vmap of a grad: per-lane gradients of the queries
    per_lane = jax.vmap(jax.grad(loss), in_axes=(0, None, None, None, 0, None))
    native = _traced_with(True, jax.jit(per_lane), lanes, k, v, lengths, lane_positions, weights)
    for lane in range(3):
        f = lambda x, lane=lane: reference_loss(x[0], k, v, lengths, lane_positions[lane], weights)  # noqa: E731
        assert_directional_derivatives([native[lane]], [lanes[lane]], f, rng)
        want = pure_grad(lanes[lane], k, v, lengths, lane_positions[lane], weights)[0]
        np.testing.assert_allclose(native[lane], want, rtol=1e-4, atol=1e-5)


@needs_native
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_default_positions_reach_the_kernel_as_offsets_from_each_rows_length():
    """Without q_positions the kernel takes the constant offsets -T..-1 and adds each row's length.

    That must stay right wherever the lengths come from: lanes sharing a
    cache (folded into query rows), lanes with their own caches (folded into
    the batch), the pure fallback under vmap, and the backward pass.
    """
    rng = np.random.default_rng(17)
    q, k, v, lengths, _ = lane_inputs(rng)
    lane_lengths = np.asarray([[70, 0], [90, 5], [1, 33]], np.int32)
    ks, vs = np.stack([k, 2 * k, -k]), np.stack([v, v, 0.5 * v])
    view = append_view(k, v, lengths)
    shared = jax.jit(jax.vmap(lambda q: jss.attend_with_lse(q, view)))
    hlo = _traced_with(True, lambda: shared.lower(q).compile().as_text())
    assert calls_native(hlo) == 1 and " iota(" not in hlo  # the offsets are a constant: no positions computed
    own = jax.jit(jax.vmap(lambda q, k, v, n: jss.attend_with_lse(q, append_view_of(k, v, n))))
    only_k = jax.jit(jax.vmap(lambda q, k: jss.attend_with_lse(q, append_view_of(k, jnp.asarray(v), lengths))))
    got_shared = _traced_with(True, shared, q)
    got_own = _traced_with(True, own, q, ks, vs, lane_lengths)
    got_only_k = _traced_with(True, only_k, q, ks)
    positions = np.broadcast_to(np.arange(90), (2, 90))
    for lane in range(3):
        assert_close(*(x[lane] for x in got_shared), *reference(q[lane], k, v, lengths, positions))
        assert_close(*(x[lane] for x in got_own),
                     *reference(q[lane], ks[lane], vs[lane], lane_lengths[lane], positions))
        assert_close(*(x[lane] for x in got_only_k), *reference(q[lane], ks[lane], v, lengths, positions))
    q1, k1, v1, lengths1, _, weights = grad_inputs(18)
    with _library.use(False):
        expected = jax.grad(loss, argnums=(0, 1, 2))(*map(jnp.asarray, (q1, k1, v1, lengths1)), None, weights)
    native = _traced_with(True, jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q1, k1, v1, lengths1, None, weights)
    f = lambda x: reference_loss(*x, lengths1, None, weights)  # noqa: E731  (default positions: the last T)
    assert_directional_derivatives(native, (q1, k1, v1), f, np.random.default_rng(180))
    for got, want in zip(native, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(expected[1]))) > 0


def append_view_of(k, v, lengths):
    """An append-mode view of traced arrays (its positions are never read there)."""
    return jss.KVView(k=k, v=v, lengths=lengths, positions=jnp.zeros(lengths.shape + (1,), jnp.int32))


def rollout_step(cache, q, keys, values):
    cache = cache.append((keys, values))
    return cache, jss.attend(q, cache.view())


@needs_native
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_compiled_step_calls_the_kernel_on_the_cache_in_place_and_compiles_once():
    traces = []

    def step(cache, q, keys, values):
        traces.append(None)
        return rollout_step(cache, q, keys, values)

    capacity = 4093  # a size no other array of the step has
    cache = jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=8, capacity=capacity)
    jitted = jax.jit(step, donate_argnums=0)
    hlo = _traced_with(
        True, lambda: jitted.lower(cache, jnp.ones((2, 3, 4, 8)), *[jnp.ones((2, 3, 2, 8))] * 2).compile().as_text()
    )
    assert calls_native(hlo) == 1 and " while(" not in hlo  # no pure loop left on CPU
    assert not re.search(rf"copy\S*\(f32\[2,2,{capacity},8\]", hlo) and f"f32[2,2,{capacity},8]" in hlo
    rng = np.random.default_rng(16)
    history_k, history_v = [], []
    for T in (3, 3, 3, 3):
        q, k, v = randn(rng, 2, T, 4, 8), randn(rng, 2, T, 2, 8), randn(rng, 2, T, 2, 8)
        cache, out = _traced_with(True, jitted, cache, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        history_k.append(k), history_v.append(v)
        keys, values = (np.concatenate(h, 1).transpose(0, 2, 1, 3) for h in (history_k, history_v))
        n = keys.shape[2]
        ref_out, _ = reference(q, keys, values, [n, n], np.broadcast_to(np.arange(n), (2, n)))
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    assert len(traces) == 1


@needs_native
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("T, groups", [(5, 2), (1, 1), (1, 2)], ids=["rows-in-lanes", "dot-per-row", "two-rows"])
def test_half_precision_caches_take_the_kernel_and_match_float64_on_their_values(dtype, T, groups):
    rng = np.random.default_rng(5)
    batch, kv_heads, D, capacity = 2, 2, 64, 300
    q = randn(rng, batch, T, kv_heads * groups, D)
    k = np.array(jnp.asarray(randn(rng, batch, kv_heads, capacity, D), dtype))  # the values the cache holds
    v = np.array(jnp.asarray(randn(rng, batch, kv_heads, capacity, D), dtype))
    if dtype == jnp.float16:
        v[0, 0, 3, :4] = np.asarray([6e-8, -3e-5, 60000, -0.0], np.float16)  # subnormals, a large one, -0
    lengths = np.asarray([capacity, 123], np.int32)
    view = append_view(jnp.asarray(k), jnp.asarray(v), lengths)
    f = jax.jit(lambda q, view: jss.attend_with_lse(q, view))
    hlo = _traced_with(True, lambda: f.lower(jnp.asarray(q), view).compile().as_text())
    assert calls_native(hlo) == 1 and " while(" not in hlo
    out, lse = _traced_with(True, f, jnp.asarray(q), view)
    ref = reference(q, k.astype(np.float64), v.astype(np.float64), lengths, view.positions)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert_close(out, lse, *ref)


@needs_native
def test_ring_views_take_the_ring_kernel():
    ring = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, window=8, sink=2, max_staged=4)
    rows = jnp.ones((1, 3, 2, 8))
    hlo = _traced_with(
        True, lambda: jax.jit(rollout_step).lower(ring, jnp.ones((1, 3, 4, 8)), rows, rows).compile().as_text()
    )
    assert calls_native(hlo) == 0 and hlo.count(f'custom_call_target="{_library.RING_TARGET}"') == 1


FORCED_ISA = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_session_state as jss
    from jax_session_state._core import _library
    from jax_session_state.attention import _native
    from tests.support.attention_reference import append_view, randn, reference
    rng = np.random.default_rng(3)
    worst = 0.0
    cases = ((1, 1, 64, 700, "float32"), (2, 1, 48, 90, "float32"), (16, 2, 64, 1300, "float32"),
             (7, 4, 128, 333, "float32"), (4, 1, 64, 500, "float32"), (1, 1, 64, 700, "bfloat16"),
             (4, 2, 32, 200, "float16"), (1, 1, 64, 2500, "float32"), (1, 1, 64, 2500, "bfloat16"))
    for T, groups, D, capacity, dtype in cases:
        q = randn(rng, 2, T, 2 * groups, D)
        k, v = (np.asarray(jnp.asarray(randn(rng, 2, 2, capacity, D), dtype)) for _ in range(2))
        lengths = np.asarray([capacity, capacity // 3], np.int32)
        view = append_view(jnp.asarray(k), jnp.asarray(v), lengths)
        k, v = k.astype(np.float64), v.astype(np.float64)
        f = jax.jit(lambda q, view: jss.attend_with_lse(q, view))
        native = f.lower(jnp.asarray(q), view).compile().as_text().count(_library.TARGET) > 0
        out, _ = f(jnp.asarray(q), view)
        ref, _ = reference(q, k, v, lengths, view.positions)
        worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))))
        print("native" if native else "pure", T * groups, dtype)
    print(_library.ISA, "|", jss.attention.native_status(), "|", worst)
""")


def _run_with_isa(isa):
    env = {**os.environ, _library.ENV_ISA: isa}
    return subprocess.run([sys.executable, "-c", FORCED_ISA], capture_output=True, text=True, env=env, check=False)


@needs_native
@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_every_isa_path_the_cpu_runs_matches_float64_and_is_named(isa):
    if isa not in _library.ISAS:
        pytest.skip(f"this build has the paths {sorted(_library.ISAS)}")
    done = _run_with_isa(isa)
    if not _library.ISAS[isa]:
        assert done.returncode != 0 and f"{_library.ENV_ISA}='{isa}': this CPU lacks" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    *kinds, summary = done.stdout.strip().splitlines()
    used, status, worst = summary.split(" | ")
    assert used == isa and status.startswith(f"native kernel ({isa}):") and f"forced by {_library.ENV_ISA}" in status
    assert float(worst) < 1e-5
    declined = _native.DECLINED_ROWS.get(isa)
    for kind in kinds:  # where the path is slower than the pure loop over float32, the pure loop runs
        path, rows, dtype = kind.split()
        slower = declined is not None and int(rows) >= declined and dtype == "float32"
        assert path == ("pure" if slower else "native"), kinds


def test_an_unknown_isa_is_a_clear_error():
    if not _library.AVAILABLE:
        pytest.skip(_library.STATUS)
    done = _run_with_isa("avx1024")
    assert done.returncode != 0
    assert f"{_library.ENV_ISA}='avx1024': the native attention kernel has the paths" in done.stderr


SWITCHED_OFF = textwrap.dedent("""
    import jax, jax.numpy as jnp, re
    import jax_session_state as jss
    from jax_session_state._core import _library
    from jax_session_state.attention import _native
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=64)
    step = lambda cache, q: jss.attend(q, cache.append((q[:, :, :2], q[:, :, :2])).view())
    hlo = jax.jit(step).lower(cache, jnp.ones((1, 3, 4, 8))).compile().as_text()
    try:
        with _library.use(True):
            pass
    except RuntimeError as error:
        refused = str(error)
    print(_library.AVAILABLE, "|", _library.STATUS, "|", hlo.count(_library.TARGET), "|", refused, "|",
          jss.attention.native_status())
""")


def test_environment_switch_leaves_the_kernel_unregistered():
    env = {**os.environ, _library.ENV_SWITCH: "0"}
    done = subprocess.run([sys.executable, "-c", SWITCHED_OFF], capture_output=True, text=True, env=env, check=True)
    available, status, calls, refused, public = done.stdout.strip().splitlines()[-1].split(" | ")
    assert available == "False" and status == f"disabled by {_library.ENV_SWITCH}=0" and calls == "0"
    assert refused == f"the native attention kernel is not available: {status}"
    assert public == f"pure JAX: {status}"


@needs_native
def test_native_status_says_which_kernel_functions_traced_now_use():
    assert jss.attention.native_status() == f"native kernel ({_library.ISA}): {_library.STATUS}"
    assert _library.ISAS.get(_library.ISA)
    with _library.use(False):
        assert jss.attention.native_status() == "pure JAX: turned off by _library.use(False)"


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("T, groups, page_size, table_pages", [(1, 1, 16, 11), (1, 2, 5, 11), (16, 2, 16, 11),
                                                                (1, 1, 7, 400)])
def test_pages_are_read_in_place_page_by_page(dtype, T, groups, page_size, table_pages):
    """Token-major pages through a shuffled table, head dim 64 (the specialised, paired and in-register reads).

    A tile spans several pages (at most eight); 400 pages of 7 rows are enough keys to split across threads.
    """
    rng = np.random.default_rng(51 + T + page_size)
    batch, kv_heads, D = 3, 2, 64
    num_pages = batch * table_pages + 3
    k, v = (np.array(jnp.asarray(randn(rng, num_pages, page_size, kv_heads, D), dtype)) for _ in range(2))
    table = rng.permutation(num_pages)[: batch * table_pages].reshape(batch, table_pages).astype(np.int32)
    capacity = table_pages * page_size
    lengths = np.asarray([capacity, 29, 0], np.int32)
    q = randn(rng, batch, T, kv_heads * groups, D)
    positions = jnp.asarray(lengths[:, None] - T + np.arange(T), jnp.int32)
    out, lse = jax.jit(lambda *args: _native.paged_kernel(*args, causal=True, scale=0.125, relative=False))(
        jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(q), jnp.asarray(lengths), positions)

    def head_major(pages):
        return pages.astype(np.float64)[table].reshape(batch, capacity, kv_heads, D).transpose(0, 2, 1, 3)

    key_positions = np.broadcast_to(np.arange(capacity), (batch, capacity))
    assert_close(out, lse, *reference(q, head_major(k), head_major(v), lengths, key_positions, scale=0.125))
