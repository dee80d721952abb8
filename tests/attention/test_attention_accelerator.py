"""attend() as it reads on TPU, and on GPU where the Pallas kernel does not: one bucketed pass, lowered for them
here and run on CPU explicitly.

On TPU, and on CUDA where no GPU is attached (a CUDA lowering made on a
CPU host), ``implementation="auto"`` reads every append-mode and paged view
(float, 16-bit or quantized, alone or under ``jax.vmap``) in one
``lax.switch`` over static buckets of the valid prefix, and rings in one
static bucket of slots per run (the sinks, and the window that may wrap),
under ``vmap`` too: no loop over key blocks.  Those lowerings
are checked for ``cuda`` and ``tpu`` (JAX lowers for a platform it does
not have); the same code runs on CPU as ``implementation="bucketed"`` and
is checked against the float64 reference, with long buckets read in
chunks (the score budget shrunk so that small caches take that path too),
under ``vmap`` and under ``jax.grad``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _bucketed, _paged, _pallas as _attention_pallas
from tests.support.attention_reference import (
    VIEWS,
    assert_close,
    assert_close_16_bit,
    assert_directional_derivatives,
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

ACCELERATORS = ["cuda", "tpu"]


@pytest.fixture(autouse=True)
def _no_gpu_attached(monkeypatch):
    """``"auto"`` as it reads on TPU, and on CUDA where no GPU is attached (``jax.export`` on a CPU host): buckets.
    Where one is, it reads the Pallas kernel instead (``test_attention_pallas.py``): programs traced with that
    choice are cleared before and after."""
    attached = _attention_pallas.gpu_attached()
    if attached:
        jax.clear_caches()
    monkeypatch.setattr(_attention_pallas, "gpu_attached", lambda: False)
    yield
    if attached:
        jax.clear_caches()


def shrink_score_budget(monkeypatch, q, kv_heads, keys=_bucketed.SMALLEST_BUCKET):
    """Makes ``"bucketed"`` read any bucket longer than ``keys`` in chunks of ``keys`` for queries like ``q``."""
    score_rows = q.shape[0] * q.shape[1] * q.shape[2]  # batch x kv_heads x (T x groups)
    assert kv_heads * (q.shape[2] // kv_heads) == q.shape[2]
    monkeypatch.setattr(_bucketed, "BUCKET_SCORE_BYTES", keys * score_rows * 4)


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("kind", VIEWS)
def test_auto_reads_one_bucketed_pass_off_cpu(kind, platform):
    view, _, dtype = view_of(kind, np.random.default_rng(0))
    q = jnp.ones((3, 1, 4, 8), dtype)
    text = lowered(jss.attend, platform, q, view)
    assert "stablehlo.while" not in text and "stablehlo.case" in text and "custom_call" not in text
    assert "stablehlo.while" in lowered(functools.partial(jss.attend, implementation="loop"), platform, q, view)


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_rings_under_vmap_are_read_in_buckets_off_cpu(platform):
    """A pool's rings: each run in one bucket off CPU, no loop over key blocks (on CPU the native ring kernel where
    it is in use, else a block loop)."""
    rng = np.random.default_rng(7)
    k, v = jnp.asarray(randn(rng, 3, 2, 2, 204, 8)), jnp.asarray(randn(rng, 3, 2, 2, 204, 8))
    lengths = jnp.asarray([[100, 300], [0, 7], [204, 150]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(204, dtype=jnp.int32), (3, 2, 204))  # not read by the lowering
    q = jnp.asarray(randn(rng, 3, 2, 1, 4, 8))

    def pooled(q, k, v, lengths, positions):
        def ring(q, k, v, n, p):
            return jss.attend(q, jss.KVView(k=k, v=v, lengths=n, positions=p, window=200, sink=4))

        return jax.vmap(ring)(q, k, v, lengths, positions)

    text = lowered(pooled, platform, q, k, v, lengths, positions)
    assert "stablehlo.while" not in text and "custom_call" not in text and "stablehlo.case" in text
    on_cpu = lowered(pooled, "cpu", q, k, v, lengths, positions)
    assert (_library.RING_TARGET in on_cpu) if _library.enabled() else ("stablehlo.while" in on_cpu)


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_auto_under_vmap_over_caches_reads_buckets_off_cpu(platform):
    """A pool's caches under ``vmap``: the slots folded into one bucket, or read one by one (a ``lax.map`` over the
    slots, each in its own bucket), picked at run time; never a loop over key blocks."""
    rng = np.random.default_rng(1)
    k, v = jnp.asarray(randn(rng, 2, 2, 2, 512, 8)), jnp.asarray(randn(rng, 2, 2, 2, 512, 8))
    lengths, q = jnp.asarray([[3, 0], [512, 7]], jnp.int32), jnp.asarray(randn(rng, 2, 2, 1, 4, 8))

    def pooled(q, k, v, lengths):
        return jax.vmap(lambda q, k, v, n: jss.attend(q, jss.KVView(k=k, v=v, lengths=n, positions=None)))(
            q, k, v, lengths)

    text = lowered(pooled, platform, q, k, v, lengths)
    assert text.count("stablehlo.while") == 1 and "stablehlo.case" in text and "custom_call" not in text


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_branch_lanes_read_their_shared_prefix_in_buckets_off_cpu(platform):
    """Lanes of a branch under ``vmap`` share one prefix: read once for every lane, in buckets off CPU; on CPU the
    bucketed read gives what ``"auto"`` gives."""
    rng = np.random.default_rng(6)
    prefix, _ = caches(rng, capacity=600)
    k, v = jnp.asarray(randn(rng, 5, 3, 4, 2, 8)), jnp.asarray(randn(rng, 5, 3, 4, 2, 8))  # 5 lanes of 4 rows
    q = jnp.asarray(randn(rng, 5, 3, 4, 4, 8))

    def lanes(prefix, q, k, v, implementation="auto"):
        def lane(q, k, v):
            window = prefix.branch_window(8).append(jss.KVChunk(k, v, jnp.full((3,), 4, jnp.int32)))
            return jss.attend(q, prefix.branch_view(window), implementation=implementation)

        return jax.vmap(lane)(q, k, v)

    text = lowered(lanes, platform, prefix, q, k, v)
    assert "stablehlo.while" not in text and "stablehlo.case" in text and "custom_call" not in text
    bucketed = jax.jit(functools.partial(lanes, implementation="bucketed"))(prefix, q, k, v)
    np.testing.assert_allclose(bucketed, jax.jit(lanes)(prefix, q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", VIEWS)
def test_long_buckets_read_in_chunks_match_float64(kind, monkeypatch):
    """Buckets past the score budget are read in chunks: 448 keys (not a power of two) in chunks of 256, the last
    moved back inside the cache, pages of 16 keys or of 100 (chunks of 200)."""
    rng = np.random.default_rng(2)
    for page_size in (16, 100) if kind.startswith("paged") else (1,):
        view, dense, dtype = view_of(kind, rng, page_size=page_size, lengths=[448, 300, 0])
        for T, causal in ((1, True), (3, False)):
            q = jnp.asarray(3 * randn(rng, 3, T, 4, 8), dtype)
            shrink_score_budget(monkeypatch, q, kv_heads=2)
            attend = jax.jit(functools.partial(jss.attend_with_lse, implementation="bucketed", causal=causal))
            assert "stablehlo.while" in attend.lower(q, view).as_text()  # the long buckets loop over chunks
            out, lse = attend(q, view)
            ref = float64_reference(np.asarray(q, np.float64), dense, causal=causal)
            (assert_close if q.dtype == jnp.float32 else assert_close_16_bit)(out, lse, *ref)


def test_chunked_buckets_compile_once_for_every_length(monkeypatch):
    rng = np.random.default_rng(3)
    q = jnp.asarray(randn(rng, 1, 1, 2, 8))
    shrink_score_budget(monkeypatch, q, kv_heads=2)
    k, v = randn(rng, 1, 2, 2000, 8), randn(rng, 1, 2, 2000, 8)
    check_compiles_once("bucketed", q, k, v, (0, 5, 256, 257, 1500, 2000))


@pytest.mark.parametrize("ragged", [True, False])
def test_bucketed_under_vmap_over_caches_matches_float64(ragged):
    """Ragged slots are read one by one, each in its own bucket; even ones folded into one bucket."""
    rng = np.random.default_rng(4)
    lengths = np.array([[1024, 3], [5, 0], [64, 1], [0, 0]] if ragged else [[700, 650], [690, 1], [640, 700],
                                                                             [700, 0]], np.int32)
    k, v = randn(rng, 4, 2, 2, 1024, 8), randn(rng, 4, 2, 2, 1024, 8)
    q = randn(rng, 4, 2, 3, 4, 8)
    positions = np.where(np.arange(1024) < lengths[..., None], np.arange(1024), -1)
    out, lse = jax.jit(pooled_attend("bucketed"))(q, k, v, lengths, positions)
    for slot in range(4):
        assert_close(out[slot], lse[slot], *reference(q[slot], k[slot], v[slot], lengths[slot], positions[slot]))


def test_grad_through_chunked_buckets_matches_float64_finite_differences(monkeypatch):
    """``jax.grad`` through ``"bucketed"`` with its long buckets in chunks (a loop of static length)."""
    shrink_score_budget(monkeypatch, jnp.zeros((2, 3, 4, 8)), kv_heads=2)  # the queries check_grad makes
    check_grad("bucketed", np.random.default_rng(5), dim=8)


def test_bucketed_paged_views_under_vmap_match_float64():
    """Independent paged caches under ``vmap``: their pools folded into one (page ids offset), or read one by one;
    off CPU ``"auto"`` lowers to that, no loop over key blocks."""
    rng = np.random.default_rng(8)
    views, denses = [], []
    for slot in range(4):
        _, paged = caches(rng, page_size=16, capacity=300, lengths=rng.integers(0, 301, 3) if slot else [300, 0, 9])
        views.append(paged.view())
        denses.append(paged.view().to_dense())
    views = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *views)
    q = jnp.asarray(randn(rng, 4, 3, 2, 4, 8))
    out, lse = jax.jit(jax.vmap(functools.partial(jss.attend_with_lse, implementation="bucketed")))(q, views)
    for slot, dense in enumerate(denses):
        assert_close(out[slot], lse[slot], *reference(q[slot], dense.k, dense.v, dense.lengths, dense.positions))
    for platform in ACCELERATORS:
        text = lowered(jax.vmap(jss.attend), platform, q, views)
        assert text.count("stablehlo.while") == 1 and "stablehlo.case" in text and "custom_call" not in text


def forked_paged_view(rng):
    """Ragged rows in a paged cache of 16-row pages, slot 2 a fork of slot 0 (its full pages shared), grown apart."""
    cache = jss.PagedKVCache.allocate(max_slots=3, kv_heads=2, head_dim=8, page_size=16, num_pages=60)
    k, v = (jnp.asarray(randn(rng, 3, 300, 2, 8)) for _ in range(2))
    cache = cache.append(jss.KVChunk(k, v, jnp.asarray([300, 90, 0], jnp.int32))).fork(0, 2)
    k, v = (jnp.asarray(randn(rng, 3, 40, 2, 8)) for _ in range(2))
    return cache.append(jss.KVChunk(k, v, jnp.asarray([0, 30, 40], jnp.int32))).view()


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_accelerator_backward_is_the_vjp_of_buckets_and_matches_the_flash_backward(paged, monkeypatch):
    """Off CPU ``jax.grad`` of ``attend`` recomputes the bucketed pass and transposes it (paged: its gathers into
    scatter-adds, a shared page summing both slots).  That VJP, run here with long buckets in chunks, matches
    float64 finite differences (dense) and the page loop's flash backward (paged, itself checked against them);
    the gradient's lowering for ``cuda`` and ``tpu`` has no loop over key blocks."""
    rng = np.random.default_rng(9)
    if paged:
        view = forked_paged_view(rng)
        operands = (view.k_pages, view.v_pages)
    else:
        dense, _ = caches(rng, capacity=600, lengths=[600, 130, 0])
        view = dense.view()
        operands = (view.k, view.v)
    q = jnp.asarray(randn(rng, 3, 2, 4, 8))
    weights = jnp.asarray(randn(rng, 3, 2, 4, 8)), jnp.asarray(randn(rng, 3, 2, 4))

    def with_operands(k, v):
        return view.replace(k_pages=k, v_pages=v) if paged else view.replace(k=k, v=v)

    def loss(out, lse):
        return jnp.sum(out * weights[0]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * weights[1], 0.0))

    def flash(q, k, v):  # the page loop's backward, checked against float64 finite differences elsewhere
        return loss(*jss.attend_with_lse(q, with_operands(k, v), implementation="loop"))

    def float64_loss(x):
        lengths = np.asarray(view.lengths)
        positions = np.where(np.arange(600) < lengths[:, None], np.arange(600), -1)
        out, lse = reference(x[0], x[1], x[2], lengths, positions)
        return np.sum(out * np.asarray(weights[0])) + np.sum(np.where(np.isfinite(lse), lse * np.asarray(weights[1]),
                                                                      0.0))

    def buckets(q, k, v):
        kv_view = with_operands(k, v)
        positions = kv_view.lengths[:, None] - 2 + jnp.arange(2)
        if paged:
            return loss(*_paged._bucketed_paged(q, kv_view, positions, True, 8**-0.5))
        return loss(*_bucketed.bucketed_append(q, kv_view.k, kv_view.v, kv_view.lengths, positions,
                                                        causal=True, scale=8**-0.5))

    shrink_score_budget(monkeypatch, q, kv_heads=2)
    got = jax.jit(jax.grad(buckets, argnums=(0, 1, 2)))(q, *operands)
    if paged:
        expected = jax.jit(jax.grad(flash, argnums=(0, 1, 2)))(q, *operands)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(e))))
        assert float(jnp.abs(got[1][view.page_table[0, 0]]).sum()) > 0  # the fork's shared pages: both slots'
    else:
        assert_directional_derivatives(got, [q, *operands], float64_loss, rng)
    monkeypatch.undo()
    for platform in ACCELERATORS:
        text = lowered(jax.grad(lambda q, k, v: loss(*jss.attend_with_lse(q, with_operands(k, v))),
                                argnums=(0, 1, 2)), platform, q, *operands)
        assert "stablehlo.while" not in text and "custom_call" not in text
