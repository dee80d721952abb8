"""The native CPU kernel over quantized K/V (int8, float8_e4m3fn + float32 row scales): against float64.

The reference is float64 attention over the dequantized rows (values times
their scales), so the kernel must match it to float32 rounding: the scales
are applied inside the kernel, to the scores and to the value weights.
Tests skip, saying why, where the kernel was not built.
"""

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _native
from tests.support.attention_reference import append_view, assert_close, randn, reference
from tests.support.native_paths import run_on_path

needs_native = pytest.mark.skipif(
    not _library.AVAILABLE or jax.default_backend() != "cpu",
    reason=f"the native kernel runs on CPU only; here: {jax.default_backend()}, {_library.STATUS}",
)


def quantized_rows(rng, shape, fmt):
    """Random stored values of ``fmt`` and positive row scales ``shape[:-1] + (1,)``, and their float64 product."""
    if fmt == "int8":
        values = rng.integers(-127, 128, shape).astype(np.int8)
    else:
        values = np.asarray(jnp.asarray(rng.standard_normal(shape) * 60, jnp.float8_e4m3fn))
    scales = rng.uniform(0.002, 0.03, shape[:-1] + (1,)).astype(np.float32)
    return values, scales, values.astype(np.float64) * scales.astype(np.float64)


def quantized_view(k, v, k_scale, v_scale, lengths):
    view = append_view(k, v, lengths)
    return view.replace(k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    fmt=st.sampled_from(["int8", "fp8"]),
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    T=st.sampled_from([1, 3, 16]),
    head_dim=st.sampled_from([16, 24, 64]),
    capacity=st.sampled_from([16, 77, 300]),
    causal=st.booleans(),
    explicit_positions=st.booleans(),
)
def test_quantized_cache_matches_float64_over_its_dequantized_rows(seed, fmt, batch, kv_heads, groups, T, head_dim,
                                                                   capacity, causal, explicit_positions):
    rng = np.random.default_rng(seed)
    q = randn(rng, batch, T, kv_heads * groups, head_dim)
    k, k_scale, k64 = quantized_rows(rng, (batch, kv_heads, capacity, head_dim), fmt)
    v, v_scale, v64 = quantized_rows(rng, (batch, kv_heads, capacity, head_dim), fmt)
    lengths = rng.integers(0, capacity + 1, batch).astype(np.int32)
    q_positions = jnp.asarray(rng.integers(-3, capacity + 3, (batch, T)), jnp.int32) if explicit_positions else None
    view = quantized_view(k, v, k_scale, v_scale, lengths)
    f = jax.jit(lambda q, view, q_positions: jss.attend_with_lse(q, view, causal=causal, q_positions=q_positions,
                                                                  implementation="native"))
    out, lse = f(jnp.asarray(q), view, q_positions)
    assert_close(out, lse, *reference(q, k64, v64, lengths, view.positions, causal=causal, q_positions=q_positions))


@needs_native
@pytest.mark.parametrize("T, groups", [(1, 1), (16, 2)], ids=["dot-per-row", "rows-in-lanes"])
def test_a_quantized_cache_takes_the_kernel_in_a_compiled_step_without_a_dequantized_copy(T, groups):
    """Through ``KVCache.allocate(quantize="int8")``: one kernel call, no loop, no float32 array of the
    cache's shape."""
    B, H, D, capacity = 2, 2, 64, 4093  # a capacity no other array of the step has
    cache = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=capacity, quantize="int8")
    rng = np.random.default_rng(21)
    filled = jnp.asarray(randn(rng, B, 2500, H, D))
    cache = cache.append((filled, -filled))

    def step(cache, q, rows):
        cache = cache.append((rows, rows))
        return cache, jss.attend(q, cache.view())

    step = jax.jit(step, donate_argnums=0)
    q, rows = jnp.asarray(randn(rng, B, T, H * groups, D)), jnp.asarray(randn(rng, B, T, H, D))
    hlo = step.lower(cache, q, rows).compile().as_text()
    assert hlo.count(_library.QUANTIZED_TARGET) == 1 and " while(" not in hlo
    assert not re.search(rf"f32\[{B},{H},{capacity},{D}\]", hlo)  # never dequantized whole
    cache, out = step(cache, q, rows)
    view = cache.view()
    k64, v64 = (np.asarray(x, np.float64) * np.asarray(s, np.float64)
                for x, s in ((view.k, view.k_scale), (view.v, view.v_scale)))
    ref, _ = reference(q, k64, v64, np.asarray(view.lengths), np.asarray(view.positions))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.max(np.abs(ref)))


@needs_native
def test_vmap_over_lanes_of_one_quantized_cache_runs_the_kernel_per_lane():
    rng = np.random.default_rng(25)
    k, k_scale, k64 = quantized_rows(rng, (2, 2, 90, 32), "int8")
    v, v_scale, v64 = quantized_rows(rng, (2, 2, 90, 32), "int8")
    lengths = np.asarray([70, 9], np.int32)
    view = quantized_view(k, v, k_scale, v_scale, lengths)
    q = randn(rng, 3, 2, 4, 4, 32)  # 3 lanes
    q_positions = rng.integers(-2, 90, (3, 2, 4)).astype(np.int32)
    f = jax.jit(jax.vmap(lambda q, p: jss.attend_with_lse(q, view, q_positions=p)))
    assert _library.QUANTIZED_TARGET in f.lower(jnp.asarray(q), jnp.asarray(q_positions)).compile().as_text()
    out, lse = f(jnp.asarray(q), jnp.asarray(q_positions))
    for lane in range(3):
        ref = reference(q[lane], k64, v64, lengths, view.positions, q_positions=q_positions[lane])
        assert_close(out[lane], lse[lane], *ref)


def paged_case(rng, fmt, batch=3, kv_heads=2, page_size=16, table_pages=9, head_dim=64):
    """Token-major quantized pages, a shuffled page table and the same rows head-major in float64."""
    num_pages = batch * table_pages + 2
    k, k_scale, k64 = quantized_rows(rng, (num_pages, page_size, kv_heads, head_dim), fmt)
    v, v_scale, v64 = quantized_rows(rng, (num_pages, page_size, kv_heads, head_dim), fmt)
    table = rng.permutation(num_pages)[: batch * table_pages].reshape(batch, table_pages).astype(np.int32)

    def dense(pages64):  # [B, Hk, table_pages * S, D]
        return pages64[table].reshape(batch, table_pages * page_size, kv_heads, head_dim).transpose(0, 2, 1, 3)

    return (k, v, k_scale, v_scale, table), dense(k64), dense(v64)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("T, groups, page_size, table_pages", [(1, 1, 16, 9), (1, 4, 16, 9), (16, 2, 16, 9),
                                                                (1, 1, 5, 450), (16, 1, 5, 450)])
def test_quantized_pages_are_read_in_place_with_their_scale_pages(fmt, T, groups, page_size, table_pages):
    """A tile spans several pages (at most eight); 450 pages of 5 rows are enough keys to split across threads."""
    rng = np.random.default_rng(31 + T * groups)
    (k, v, k_scale, v_scale, table), k64, v64 = paged_case(rng, fmt, page_size=page_size, table_pages=table_pages)
    batch, capacity = table.shape[0], k64.shape[2]
    lengths = np.asarray([capacity, 37, 0], np.int32)
    q = randn(rng, batch, T, 2 * groups, 64)
    offsets = jnp.asarray(np.broadcast_to(np.arange(-T, 0, dtype=np.int32), (batch, T)))
    call = jax.jit(lambda *args: _native.paged_kernel(*args, causal=True, scale=0.125, relative=True,
                                                      k_scale_pages=jnp.asarray(k_scale),
                                                      v_scale_pages=jnp.asarray(v_scale[..., 0])))
    out, lse = call(jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(q), jnp.asarray(lengths), offsets)
    positions = np.broadcast_to(np.arange(capacity), (batch, capacity))
    assert_close(out, lse, *reference(q, k64, v64, lengths, positions, scale=0.125))


@needs_native
def test_mismatched_scales_are_a_clear_error():
    rng = np.random.default_rng(41)
    k, k_scale, _ = quantized_rows(rng, (1, 2, 32, 16), "int8")
    q = jnp.asarray(randn(rng, 1, 1, 2, 16))
    lengths, offsets = jnp.asarray([5], jnp.int32), jnp.asarray([[-1]], jnp.int32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="k_scale, v_scale \\[B, Hk, C, 1\\] float32 do not match"):
        _native.quantized_kernel(q, k, k, k_scale, k_scale[:, :, :31], lengths, offsets, causal=True, scale=0.25,
                                 relative=True)
    with pytest.raises(jss.PayloadError, match="both k_scale and v_scale, or neither"):
        _native.paged_kernel(k, k, jnp.zeros((1, 1), jnp.int32), q, lengths, offsets, causal=True, scale=0.25,
                             relative=True, k_scale_pages=k_scale)


FORCED_ISA = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_session_state as jss
    from jax_session_state._core import _library
    from jax_session_state.attention import _native
    from tests.support.attention_reference import randn, reference
    from tests.attention.test_native_quantized import paged_case, quantized_rows, quantized_view
    rng = np.random.default_rng(7)
    worst = 0.0
    for T, groups, D, capacity, fmt in ((1, 1, 64, 700, "int8"), (1, 2, 128, 333, "int8"), (16, 2, 64, 1300, "int8"),
                                        (3, 1, 48, 90, "int8"), (1, 1, 64, 500, "fp8"), (16, 1, 32, 200, "fp8")):
        q = randn(rng, 2, T, 2 * groups, D)
        (k, ks, k64), (v, vs, v64) = (quantized_rows(rng, (2, 2, capacity, D), fmt) for _ in range(2))
        lengths = np.asarray([capacity, capacity // 3], np.int32)
        view = quantized_view(k, v, ks, vs, lengths)
        f = jax.jit(lambda q, view: jss.attend_with_lse(q, view))
        native = f.lower(jnp.asarray(q), view).compile().as_text().count(_library.QUANTIZED_TARGET) > 0
        out, _ = f(jnp.asarray(q), view)
        ref, _ = reference(q, k64, v64, lengths, view.positions)
        worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))))
        print("native" if native else "pure", T * groups)
    # Odd runs of pages (5 and 7 rows: a run's last key has no partner in SSE2's integer value sums).
    for T, page_size, table_pages in ((1, 16, 9), (16, 16, 9), (1, 5, 40), (1, 7, 30)):
        (k, v, ks, vs, table), k64, v64 = paged_case(rng, "int8", page_size=page_size, table_pages=table_pages)
        q, lengths = randn(rng, 3, T, 2, 64), np.asarray([100, 144, 3], np.int32)
        positions = jnp.asarray(lengths[:, None] - T + np.arange(T), jnp.int32)
        out, _ = _native.paged_kernel(*map(jnp.asarray, (k, v, table, q, lengths)), positions, causal=True,
                                      scale=0.125, relative=False, k_scale_pages=ks, v_scale_pages=vs)
        ref, _ = reference(q, k64, v64, lengths, np.broadcast_to(np.arange(k64.shape[2]), (3, k64.shape[2])),
                           scale=0.125)
        worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))))
    # Edge rows: a zero query row, a kv head whose value scales are all 0, stored values of -128.
    q = randn(rng, 2, 1, 4, 64)
    q[0, 0, 1] = 0.0
    (k, ks, _), (v, vs, _) = (quantized_rows(rng, (2, 2, 300, 64), "int8") for _ in range(2))
    k[0, 0, :5], v[0, 1, :7], vs[1, 0] = -128, -128, 0.0
    k64, v64 = (x.astype(np.float64) * s.astype(np.float64) for x, s in ((k, ks), (v, vs)))
    view = quantized_view(k, v, ks, vs, np.asarray([300, 211], np.int32))
    out, _ = jax.jit(lambda q, view: jss.attend_with_lse(q, view))(jnp.asarray(q), view)
    ref, _ = reference(q, k64, v64, np.asarray([300, 211], np.int32), view.positions)
    worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))))
    print(_library.ISA, "|", worst)
""")


@needs_native
@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_every_isa_path_reads_quantized_caches_to_float32_rounding(isa):
    *kinds, summary = run_on_path(isa, FORCED_ISA)
    used, worst = summary.split(" | ")
    assert used == isa and float(worst) < 1e-5, summary
    assert all(kind.startswith("native ") for kind in kinds), kinds  # a quantized cache is never declined
