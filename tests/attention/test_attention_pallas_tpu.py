"""attend(implementation="pallas") on TPU: the Mosaic kernel, run here in Pallas' TPU interpret mode, lowered for TPU.

``_pallas_tpu.ON_CPU``, set for every test, makes ``"pallas"`` traced for
CPU run the TPU kernel in Pallas' interpreter (the HLO interpreter, which
runs under ``vmap``; one test runs ``pltpu.InterpretParams``, with SMEM,
VMEM and the block pipeline simulated), so the checks against the float64
reference below exercise the body a TPU compiles: its scalar-prefetched
block counts and page table, the clamped key-block ``index_map``, the online
softmax in VMEM scratch, the row scales of an int8 or fp8 cache.  Shapes are
tiny (head dim 16, blocks of 16 to 32 keys): the interpreter is slow.
Lowered for TPU with a head dim of 128 the kernel is one
``tpu_custom_call``; where TPU tiling does not take a view, and for
``"auto"``, TPU reads buckets.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import jax_session_state as jss
from jax_session_state.attention import _pallas_tpu
from tests.attention.test_attention_pallas import interleaved_paged
from tests.support.attention_reference import (
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

DIM = 16
KERNEL = "jss_decode_attention_tpu"
pallas_attend = functools.partial(jss.attend_with_lse, implementation="pallas")


@pytest.fixture(autouse=True, scope="module")
def tpu_kernel_on_cpu():
    """``"pallas"`` on CPU runs the TPU kernel interpreted, in blocks of at most 32 keys; programs traced with the
    GPU kernel's choice are cleared before and after the module."""
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_pallas_tpu, "ON_CPU", True)
        patch.setattr(_pallas_tpu, "BLOCK_KEYS", 32)
        yield
    jax.clear_caches()


@pytest.fixture
def traced_for_tpu(monkeypatch):
    """``"pallas"`` traced as for a TPU program (its CPU branch the GPU kernel's, as outside the tests)."""
    jax.clear_caches()
    monkeypatch.setattr(_pallas_tpu, "ON_CPU", False)
    yield
    jax.clear_caches()


CACHES = {"f32": dict(), "bf16": dict(dtype=jnp.bfloat16), "int8": dict(quantize="int8"), "fp8": dict(quantize="fp8")}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_tpu_kernel_matches_float64(cache, paged):
    """Ragged rows (full, partial, empty), T = 3 not causal, GQA 4, float32 queries (and T = 1 causal queries of a
    16-bit cache's dtype); a dense cache of 192 keys in blocks of 32, pages of 16.  (Causal reads of float32
    queries: every test below.)"""
    rng = np.random.default_rng(0)
    dense, paged_cache = caches(rng, dim=DIM, capacity=192, lengths=[192, 101, 0], **CACHES[cache])
    view = paged_cache.view() if paged else dense.view()
    narrow = CACHES[cache].get("dtype")
    cases = ((3, False, jnp.float32),) + (((1, True, narrow),) if narrow else ())
    for T, causal, q_dtype in cases:
        q = jnp.asarray(3 * randn(rng, 3, T, 8, DIM), q_dtype)
        attend = jax.jit(functools.partial(pallas_attend, causal=causal))
        assert KERNEL in str(jax.make_jaxpr(attend)(q, view))
        out, lse = attend(q, view)
        ref = float64_reference(np.asarray(q, np.float64), dense.view(), causal=causal)
        (assert_close if q_dtype == jnp.float32 else assert_close_16_bit)(out, lse, *ref)


def test_tpu_kernel_reads_explicit_query_positions():
    """Positions given per query, some before any key (exact zeros, ``lse = -inf``) and some past the length."""
    rng = np.random.default_rng(1)
    dense, paged_cache = caches(rng, dim=DIM, capacity=128, lengths=[100, 17, 128])
    q_positions = jnp.asarray([[-1, 0, 70, 400], [3, -5, 16, 16], [127, 50, -1, 64]], jnp.int32)
    q = jnp.asarray(randn(rng, 3, 4, 4, DIM))
    ref = float64_reference(q, dense.view(), q_positions=np.asarray(q_positions))
    assert_close(*jax.jit(pallas_attend)(q, dense.view(), q_positions=q_positions), *ref)
    attend = jax.jit(functools.partial(pallas_attend, scale=0.3))
    assert_close(*attend(q, paged_cache.view(), q_positions=q_positions),
                 *float64_reference(q, dense.view(), q_positions=np.asarray(q_positions), scale=0.3))


def test_tpu_interpreter_runs_the_kernel(monkeypatch):
    """Pallas' TPU interpreter proper (``pltpu.InterpretParams``: SMEM, VMEM and the pipeline's copies simulated,
    memory not written reading as NaN) runs the kernel to the same results: int8 pages and their row scales."""
    monkeypatch.setattr(_pallas_tpu, "INTERPRET", pltpu.InterpretParams())
    rng = np.random.default_rng(12)
    dense, paged_cache = caches(rng, dim=DIM, capacity=64, lengths=[64, 21, 0], quantize="int8")
    q = jnp.asarray(randn(rng, 3, 2, 4, DIM))
    out, lse = jax.jit(pallas_attend)(q, paged_cache.view())
    assert_close(out, lse, *float64_reference(q, dense.view()))


def test_tpu_kernel_reads_forked_interleaved_pages():
    """Pages scattered through the pool by turns of growth, a fork's shared pages (slot 2 of slot 0)."""
    rng = np.random.default_rng(2)
    view, dense = interleaved_paged(rng, lengths=(150, 45, 0))
    q = jnp.asarray(randn(rng, 3, 2, 8, DIM))
    assert_close(*jax.jit(pallas_attend)(q, view), *float64_reference(q, dense))


def test_tpu_kernel_compiles_once_for_every_length():
    rng = np.random.default_rng(3)
    k, v = randn(rng, 1, 2, 256, DIM), randn(rng, 1, 2, 256, DIM)
    check_compiles_once("pallas", jnp.asarray(randn(rng, 1, 1, 4, DIM)), k, v, (0, 5, 32, 33, 200, 256))


def test_tpu_kernel_under_vmap_over_caches_matches_float64():
    """A pool's caches under ``vmap``, ragged: the kernel's batched block counts and page tables."""
    rng = np.random.default_rng(4)
    lengths = np.array([[128, 3], [5, 0], [64, 1]], np.int32)
    k, v = randn(rng, 3, 2, 2, 128, DIM), randn(rng, 3, 2, 2, 128, DIM)
    q = randn(rng, 3, 2, 2, 4, DIM)
    positions = np.where(np.arange(128) < lengths[..., None], np.arange(128), -1)
    pooled = pooled_attend("pallas")
    assert KERNEL in str(jax.make_jaxpr(pooled)(q, k, v, lengths, positions))
    out, lse = jax.jit(pooled)(q, k, v, lengths, positions)
    for slot in range(3):
        assert_close(out[slot], lse[slot], *reference(q[slot], k[slot], v[slot], lengths[slot], positions[slot]))


def test_tpu_kernel_under_vmap_over_paged_views():
    rng = np.random.default_rng(11)
    views = [caches(rng, batch=2, dim=DIM, capacity=64, lengths=lengths, quantize="int8")
             for lengths in ([64, 9], [0, 33])]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *(paged.view() for _, paged in views))
    q = jnp.asarray(randn(rng, 2, 2, 1, 4, DIM))
    out, lse = jax.jit(jax.vmap(pallas_attend))(q, stacked)
    for slot, (dense, _) in enumerate(views):
        assert_close(out[slot], lse[slot], *float64_reference(q[slot], dense.view()))


def test_grad_through_tpu_kernel_matches_float64_finite_differences():
    """The kernel has no VJP of its own: ``jax.grad`` takes the bucketed pass's, recomputed."""
    check_grad("pallas", np.random.default_rng(5), dim=DIM)


def test_grad_through_paged_tpu_kernel_matches_the_page_loop():
    """Through float pages too, a fork's shared page summing both slots' gradients."""
    rng = np.random.default_rng(7)
    view, _ = interleaved_paged(rng, lengths=(150, 45, 0))
    q = jnp.asarray(randn(rng, 3, 2, 8, DIM))

    def loss(q, k_pages, v_pages, implementation):
        out = jss.attend(q, view.replace(k_pages=k_pages, v_pages=v_pages), implementation=implementation)
        return jnp.sum(jnp.sin(out))

    grads = {name: jax.jit(jax.grad(functools.partial(loss, implementation=name), argnums=(0, 1, 2)))(
        q, view.k_pages, view.v_pages) for name in ("pallas", "loop")}
    for got, expected in zip(grads["pallas"], grads["loop"]):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    assert float(jnp.abs(grads["pallas"][1][view.page_table[0, 0]]).sum()) > 0


@pytest.mark.parametrize("kind", ["dense bfloat16", "paged float32", "paged int8", "paged fp8"])
def test_pallas_lowers_to_one_mosaic_call_for_tpu(kind, traced_for_tpu):
    """A head dim of 128 (and pages of 32, int8's sublane tile): ``"pallas"`` on TPU is one ``tpu_custom_call`` and
    no loop, its gradient the bucketed pass's (no loop either); ``"auto"`` on TPU still reads buckets."""
    view, _, dtype = view_of(kind, np.random.default_rng(8), dim=128, capacity=256, page_size=32)
    q = jnp.ones((3, 1, 4, 128), dtype)
    tpu = lowered(pallas_attend, "tpu", q, view)
    assert tpu.count("tpu_custom_call") == 1 and "stablehlo.while" not in tpu
    auto = lowered(jss.attend_with_lse, "tpu", q, view)
    assert "custom_call" not in auto and "stablehlo.case" in auto
    if not view.quantized:  # quantized views have no gradients
        grad = lowered(jax.grad(lambda q, view: pallas_attend(q.astype(jnp.float32), view)[0].sum()), "tpu",
                       q.astype(jnp.float32), view)
        assert "stablehlo.while" not in grad  # the backward: the bucketed pass's VJP


@pytest.mark.parametrize("declined", ["head dim 16", "int8 pages of 16"])
def test_pallas_reads_buckets_on_tpu_where_its_tiling_does_not_take_the_view(declined, traced_for_tpu):
    """A head dim not a multiple of 128 lanes, or int8 pages shorter than its sublane tile of 32 rows."""
    dim = DIM if declined == "head dim 16" else 128
    _, paged_cache = caches(np.random.default_rng(9), dim=dim, capacity=64, quantize="int8")
    tpu = lowered(pallas_attend, "tpu", jnp.ones((3, 1, 4, dim)), paged_cache.view())
    assert "custom_call" not in tpu and "stablehlo.case" in tpu
