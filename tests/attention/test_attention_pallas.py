"""attend(implementation="pallas"): the split-K Pallas kernel, run here in Pallas' interpreter, lowered for GPU.

On GPU the kernel compiles through Triton (one custom call, no XLA loop);
on CPU the same kernel body runs interpreted, so every check against the
float64 reference below exercises the code a GPU compiles: its shares of
the valid blocks, its masked loads, the page table and the log-sum-exp
merge, an int8 or fp8 cache's row scales.  Where the kernel does not take a
view (head dim not a power of two of at least 16, runs of keys not a
multiple of 16) and on TPU, ``"pallas"`` reads buckets.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _pallas as _attention_pallas
from tests.support.attention_reference import (
    VIEWS,
    assert_close,
    assert_close_16_bit,
    caches,
    check_compiles_once,
    check_grad,
    float64_reference,
    lowered,
    pooled_attend,
    randn,
    reference,
    view_of,
)
from tests.support.triton_compile import triton_call_count

DIM = 16
pallas_attend = functools.partial(jss.attend_with_lse, implementation="pallas")


def interleaved_paged(rng, *, dtype=jnp.float32, page_size=16, lengths=(300, 90, 0)):
    """A paged cache whose rows grew in turns (each slot's pages scattered through the pool), slot 2 a fork of
    slot 0 (its full pages shared) that then grew apart, and the same rows as a dense view."""
    cache = jss.PagedKVCache.allocate(max_slots=3, kv_heads=2, head_dim=DIM, page_size=page_size, num_pages=80,
                                      dtype=dtype)
    lengths = np.asarray(lengths, np.int32)
    for grow in (lengths * 2 // 5, lengths - lengths * 2 // 5):
        k, v = (jnp.asarray(randn(rng, 3, 200, 2, DIM), dtype) for _ in range(2))
        cache = cache.append(jss.KVChunk(k, v, jnp.asarray(grow)))
    cache = cache.fork(0, 2)
    k, v = (jnp.asarray(randn(rng, 3, 40, 2, DIM), dtype) for _ in range(2))
    view = cache.append(jss.KVChunk(k, v, jnp.asarray([0, 30, 40], jnp.int32))).view()
    return view, view.to_dense()


CACHES = {"f32": dict(), "bf16": dict(dtype=jnp.bfloat16), "f16": dict(dtype=jnp.float16),
          "int8": dict(quantize="int8"), "fp8": dict(quantize="fp8")}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("shares", ["many", "one"])
def test_pallas_matches_float64(cache, paged, shares, monkeypatch):
    """Ragged rows (full, partial, empty), T = 1 and T = 5 (causal or not), GQA 4 and queries of float32 or of the
    dtype the dots read the cache in (its own, bfloat16 for int8 and fp8, whose row scales go on the scores and
    weights); ``shares="one"``: one program walks all of a row's blocks, with 20 query rows in two tiles."""
    if shares == "one":
        monkeypatch.setattr(_attention_pallas, "PROGRAMS", 1)
        monkeypatch.setattr(_attention_pallas, "ROW_TILE", 16)
    rng = np.random.default_rng(0)
    dense, paged_cache = caches(rng, dim=DIM, lengths=[448, 301, 0], **CACHES[cache])
    view = paged_cache.view() if paged else dense.view()
    narrow = CACHES[cache].get("dtype", jnp.bfloat16 if "quantize" in CACHES[cache] else jnp.float32)
    for T, causal, q_dtype in ((1, True, jnp.float32), (5, False, jnp.float32), (5, True, narrow)):
        q = jnp.asarray(3 * randn(rng, 3, T, 8, DIM), q_dtype)
        out, lse = jax.jit(functools.partial(pallas_attend, causal=causal))(q, view)
        ref = float64_reference(np.asarray(q, np.float64), dense.view(), causal=causal)
        (assert_close if q_dtype == jnp.float32 else assert_close_16_bit)(out, lse, *ref)


def test_fp8_bytes_decode_to_bfloat16_exactly():
    """All 256 ``float8_e4m3fn`` bytes (zeros, subnormals, 448, NaN) through the kernel's own decoding."""
    bits = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(_attention_pallas._bfloat16_of_e4m3_bits)(bits), np.float32)
    expected = bits.view(jnp.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    numbers = ~np.isnan(expected)
    assert np.array_equal(np.signbit(got[numbers]), np.signbit(expected[numbers]))  # -0 stays -0


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_pallas_decodes_fp8_bytes_where_the_gpu_cannot_convert_them(paged, monkeypatch):
    """Below compute capability 8.9 (A100) Triton has no float8 conversion: the kernel reads an fp8 cache as its
    bytes and decodes them itself, to the same results, bit for bit."""
    rng = np.random.default_rng(10)
    dense, paged_cache = caches(rng, dim=DIM, lengths=[448, 301, 0], quantize="fp8")
    view = paged_cache.view() if paged else dense.view()
    q = jnp.asarray(3 * randn(rng, 3, 5, 8, DIM))
    converted = jax.jit(lambda q, view: pallas_attend(q, view))(q, view)
    monkeypatch.setattr(_attention_pallas, "compute_capability", lambda: 8.0)
    decoded = jax.jit(lambda q, view: pallas_attend(q, view))(q, view)  # a fresh function: traced anew
    for got, expected in zip(decoded, converted):
        np.testing.assert_array_equal(got, expected)
    assert_close(*decoded, *float64_reference(np.asarray(q, np.float64), dense.view()))
    assert "bitcast_convert" in lowered(lambda q, view: pallas_attend(q, view), "cuda", q, view)


def test_pallas_reads_explicit_query_positions():
    """Positions given per query, some before any key (exact zeros, ``lse = -inf``) and some past the length."""
    rng = np.random.default_rng(1)
    dense, paged_cache = caches(rng, dim=DIM, capacity=256, lengths=[200, 17, 256])
    q_positions = jnp.asarray([[-1, 0, 150, 400], [3, -5, 16, 16], [255, 100, -1, 64]], jnp.int32)
    q = jnp.asarray(randn(rng, 3, 4, 4, DIM))
    ref = float64_reference(q, dense.view(), q_positions=np.asarray(q_positions))
    for view in (dense.view(), paged_cache.view()):
        assert_close(*pallas_attend(q, view, q_positions=q_positions), *ref)


def test_pallas_reads_pages_where_they_lie():
    """Pages scattered through the pool by turns of growth, a fork's shared pages, 16 and 64 keys a page (a block
    of 64 keys in one page or four blocks of 16); the step's lowering gathers nothing pool-sized."""
    rng = np.random.default_rng(2)
    for page_size in (16, 64):
        view, dense = interleaved_paged(rng, page_size=page_size)
        q = jnp.asarray(randn(rng, 3, 2, 8, DIM))
        assert_close(*pallas_attend(q, view), *float64_reference(q, dense))
        text = lowered(pallas_attend, "cuda", q, view)
        pool = "x".join(map(str, view.k_pages.shape))
        assert not any("gather" in line and pool in line.split("->")[-1] for line in text.splitlines())


def test_pallas_compiles_once_for_every_length():
    rng = np.random.default_rng(3)
    k, v = randn(rng, 1, 2, 2000, DIM), randn(rng, 1, 2, 2000, DIM)
    check_compiles_once("pallas", jnp.asarray(randn(rng, 1, 1, 4, DIM)), k, v, (0, 5, 64, 65, 1500, 2000))


def test_pallas_under_vmap_over_caches_matches_float64():
    """A pool's caches under ``vmap``, ragged: the kernel's grid gains the slots' axis."""
    rng = np.random.default_rng(4)
    lengths = np.array([[1024, 3], [5, 0], [64, 1], [0, 0]], np.int32)
    k, v = randn(rng, 4, 2, 2, 1024, DIM), randn(rng, 4, 2, 2, 1024, DIM)
    q = randn(rng, 4, 2, 3, 4, DIM)
    positions = np.where(np.arange(1024) < lengths[..., None], np.arange(1024), -1)
    pooled = pooled_attend("pallas")
    out, lse = jax.jit(pooled)(q, k, v, lengths, positions)
    for slot in range(4):
        assert_close(out[slot], lse[slot], *reference(q[slot], k[slot], v[slot], lengths[slot], positions[slot]))
    text = lowered(pooled, "cuda", q, k, v, lengths, positions)
    assert triton_call_count(text) == 1 and "stablehlo.while" not in text


def test_pallas_branch_lanes_share_one_prefix():
    """Lanes of a branch under ``vmap`` read their shared prefix through the kernel; the result is ``"auto"``'s."""
    rng = np.random.default_rng(6)
    prefix, _ = caches(rng, capacity=608, dim=DIM)
    k, v = jnp.asarray(randn(rng, 5, 3, 4, 2, DIM)), jnp.asarray(randn(rng, 5, 3, 4, 2, DIM))
    q = jnp.asarray(randn(rng, 5, 3, 4, 4, DIM))

    def lanes(prefix, q, k, v, implementation):
        def lane(q, k, v):
            window = prefix.branch_window(8).append(jss.KVChunk(k, v, jnp.full((3,), 4, jnp.int32)))
            return jss.attend(q, prefix.branch_view(window), implementation=implementation)

        return jax.vmap(lane)(q, k, v)

    got = jax.jit(functools.partial(lanes, implementation="pallas"))(prefix, q, k, v)
    np.testing.assert_allclose(got, jax.jit(functools.partial(lanes, implementation="auto"))(prefix, q, k, v),
                               rtol=1e-5, atol=1e-5)
    text = lowered(functools.partial(lanes, implementation="pallas"), "cuda", prefix, q, k, v)
    cache = "x".join(map(str, prefix.k.shape))
    assert triton_call_count(text) == 1 and f"5x{cache}" not in text  # the prefix is not copied per lane


def test_grad_through_pallas_matches_float64_finite_differences():
    """A Pallas call has no VJP of its own: ``jax.grad`` takes the bucketed pass's, recomputed."""
    check_grad("pallas", np.random.default_rng(5), dim=DIM)


def test_grad_through_paged_pallas_matches_the_page_loop():
    """Through float pages too, a fork's shared page summing both slots' gradients."""
    rng = np.random.default_rng(7)
    view, _ = interleaved_paged(rng)
    q = jnp.asarray(randn(rng, 3, 2, 8, DIM))

    def loss(q, k_pages, v_pages, implementation):
        out = jss.attend(q, view.replace(k_pages=k_pages, v_pages=v_pages), implementation=implementation)
        return jnp.sum(jnp.sin(out))

    grads = {name: jax.jit(jax.grad(functools.partial(loss, implementation=name), argnums=(0, 1, 2)))(
        q, view.k_pages, view.v_pages) for name in ("pallas", "loop")}
    for got, expected in zip(grads["pallas"], grads["loop"]):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    assert float(jnp.abs(grads["pallas"][1][view.page_table[0, 0]]).sum()) > 0


@pytest.mark.parametrize("kind", VIEWS)
def test_pallas_lowers_to_one_triton_call_for_gpu_and_buckets_for_tpu(kind):
    view, _, dtype = view_of(kind, np.random.default_rng(8), dim=DIM)
    q = jnp.ones((3, 1, 4, DIM), dtype)
    cuda = lowered(pallas_attend, "cuda", q, view)
    assert triton_call_count(cuda) == 1 and "stablehlo.while" not in cuda
    tpu = lowered(pallas_attend, "tpu", q, view)
    assert "custom_call" not in tpu and "stablehlo.case" in tpu and "stablehlo.while" not in tpu
    if not view.quantized:  # quantized views have no gradients
        grad = lowered(jax.grad(lambda q, view: pallas_attend(q.astype(jnp.float32), view)[0].sum()), "cuda",
                       q.astype(jnp.float32), view)
        assert "stablehlo.while" not in grad  # the backward: the bucketed pass's VJP


@pytest.fixture(params=["native", "no native"])
def gpu_attached(request, monkeypatch):
    """``"auto"`` as it chooses in a process with a CUDA GPU, with the native CPU kernel built and without."""
    jax.clear_caches()
    monkeypatch.setattr(_attention_pallas, "gpu_attached", lambda: True)
    if request.param == "no native":
        monkeypatch.setattr(_library, "enabled", lambda: False)
    yield
    jax.clear_caches()


@pytest.mark.parametrize("kind", VIEWS)
def test_auto_reads_the_kernel_on_cuda_where_a_gpu_is_attached(kind, gpu_attached):
    """Measured faster than buckets on a GPU (BENCHMARKS.md), the kernel is ``"auto"``'s CUDA reader: one Triton
    call, no loop; TPU still reads buckets, CPU what it read before (checked against float64), and the gradient
    lowered for CUDA has no loop either."""
    rng = np.random.default_rng(12)
    view, dense, dtype = view_of(kind, rng, dim=DIM)
    q = jnp.asarray(randn(rng, 3, 2, 4, DIM), dtype)
    cuda = lowered(jss.attend_with_lse, "cuda", q, view)
    assert triton_call_count(cuda) == 1 and "stablehlo.while" not in cuda
    tpu = lowered(jss.attend_with_lse, "tpu", q, view)
    assert "custom_call" not in tpu and "stablehlo.case" in tpu and "stablehlo.while" not in tpu
    out, lse = jax.jit(jss.attend_with_lse)(q, view)
    expected = float64_reference(np.asarray(q, np.float64), dense)
    (assert_close if dtype == jnp.float32 else assert_close_16_bit)(out, lse, *expected)
    if not view.quantized:  # quantized views have no gradients
        grad = lowered(jax.grad(lambda q, view: jss.attend(q.astype(jnp.float32), view).sum()), "cuda",
                       q.astype(jnp.float32), view)
        assert "stablehlo.while" not in grad  # the backward: the bucketed pass's VJP


@pytest.mark.parametrize("declined", ["head dim 8", "head dim 24", "capacity 40", "pages of 8"])
def test_pallas_reads_buckets_where_the_kernel_does_not_take_the_view(declined):
    rng = np.random.default_rng(9)
    options = {"head dim 8": dict(dim=8), "head dim 24": dict(dim=24),
               "capacity 40": dict(dim=DIM, capacity=40, lengths=[40, 3, 0]),
               "pages of 8": dict(dim=DIM, page_size=8)}[declined]
    dense, paged_cache = caches(rng, **options)
    view = paged_cache.view() if declined == "pages of 8" else dense.view()
    q = jnp.asarray(randn(rng, 3, 2, 4, options["dim"]))
    assert "pallas_call" not in str(jax.make_jaxpr(pallas_attend)(q, view))
    out, lse = pallas_attend(q, view)
    bucketed = jss.attend_with_lse(q, view, implementation="bucketed")
    np.testing.assert_array_equal(out, bucketed[0])
    np.testing.assert_array_equal(lse, bucketed[1])


def test_pallas_reads_a_traced_scale_folded_into_the_queries():
    """The kernel takes its scale as a constant: a scale traced under ``jit`` multiplies the queries, the kernel
    runs with 1.0, and is right."""
    rng = np.random.default_rng(10)
    dense, _ = caches(rng, dim=DIM, lengths=[448, 301, 0])
    q = jnp.asarray(randn(rng, 3, 2, 4, DIM))

    def attend(q, view, scale):
        return pallas_attend(q, view, scale=scale)

    assert "pallas_call" in str(jax.make_jaxpr(attend)(q, dense.view(), 0.3))
    assert_close(*jax.jit(attend)(q, dense.view(), 0.3), *float64_reference(q, dense.view(), scale=0.3))
