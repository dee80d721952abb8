"""attend() under jax.vmap over independent caches (a pool's slots), against a float64 reference.

Each slot has its own cache and its own valid length.  The pure loop folds
the slots into its batch (one loop, one slice per block read, no gather) or
reads them one by one, each to its own block count, when the lengths are
ragged enough (``_attention_pooled.cheapest_reading``); ring views are read
by their runs under plain ``vmap``; paged views fold their pools.
Every choice runs in one compiled function, picked at run time.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _append, _operands, _pooled as _attention_pooled
from tests.support.attention_reference import assert_close, assert_directional_derivatives, randn, reference

SLOTS, BATCH, KV_HEADS, GROUPS, DIM, T = 6, 2, 2, 2, 8, 3
CAPACITY = 1024  # 16 blocks of 64


def append_view(k, v, lengths):
    """An append-mode view of traced arrays (the loop never reads its positions)."""
    iota = jnp.arange(k.shape[2])
    return jss.KVView(k=k, v=v, lengths=lengths, positions=jnp.where(iota < lengths[:, None], iota, -1))


def ring_positions(length, capacity, sink):
    positions = np.full(capacity, -1, np.int32)
    for p in range(length):
        positions[p if p < sink else sink + (p - sink) % (capacity - sink)] = p
    return positions


def pooled_attend(implementation):
    return jax.jit(jax.vmap(lambda q, k, v, n: jss.attend_with_lse(q, append_view(k, v, n),
                                                                   implementation=implementation)))


def slot_blocks(lengths, capacity=CAPACITY, n=jss.attention.BLOCK_SIZE):
    return jnp.max((jnp.clip(jnp.asarray(lengths), 0, capacity) + n - 1) // n, axis=1)


RAGGED = np.array([[CAPACITY, 3], [5, 0], [64, 1], [0, 0], [17, 40], [2, 9]], np.int32)  # one long slot
EVEN = np.array([[700, 650], [690, 1], [640, 700], [700, 0], [660, 700], [700, 700]], np.int32)
RING = (4, 150, 200)  # sink, window, slots
RING_LENGTHS = {  # some rings wrapped, some filling up, some empty
    "ragged": np.minimum(RAGGED, 400),
    "filling up": np.array([[100, 128], [120, 70], [99, 0], [128, 128], [65, 128], [100, 110]], np.int32),
    "even": np.minimum(EVEN, 400),
}


def inputs(seed, capacity=CAPACITY):
    rng = np.random.default_rng(seed)
    q = randn(rng, SLOTS, BATCH, T, KV_HEADS * GROUPS, DIM)
    k, v = (randn(rng, SLOTS, BATCH, KV_HEADS, capacity, DIM) for _ in range(2))
    return q, k, v


def dirty(k, lengths):
    """``k`` with huge values past each row's length: a read past it would show."""
    past = np.arange(k.shape[3])[None, None, None, :, None] >= np.asarray(lengths)[:, :, None, None, None]
    return np.where(past, 1e4, k).astype(np.float32)


def test_the_cost_model_reads_ragged_slots_one_by_one_and_even_ones_together():
    pooled = _attention_pooled
    assert int(pooled.cheapest_reading(slot_blocks(RAGGED))) == pooled.APART
    assert int(pooled.cheapest_reading(slot_blocks(EVEN))) == pooled.TOGETHER
    # 16 slots, one at 8192 tokens and 15 at 256 (the pool benchmark): one by one
    assert int(pooled.cheapest_reading(jnp.asarray([128] + [4] * 15))) == pooled.APART


@pytest.mark.parametrize("implementation", ["loop", "native"])
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_append_mode_under_vmap_over_independent_caches_matches_float64(implementation):
    if implementation == "native" and not _library.enabled():
        pytest.skip(f"the native kernel is not in use here: {_library.status()}")
    q, k, v = inputs(1)
    f = pooled_attend(implementation)
    for lengths in (RAGGED, EVEN):
        out, lse = f(q, dirty(k, lengths), v, lengths)
        for slot in range(SLOTS):
            positions = np.where(np.arange(CAPACITY) < lengths[slot][:, None], np.arange(CAPACITY), -1)
            assert_close(out[slot], lse[slot], *reference(q[slot], k[slot], v[slot], lengths[slot], positions))


def test_the_pooled_loop_compiles_once_for_both_choices_and_has_no_gather():
    """One compiled function serves ragged and even lengths; its block reads are slices, never gathers."""
    q, k, v = inputs(2)
    traced = []

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v, n):
        traced.append(1)
        return jax.vmap(lambda q, k, v, n: jss.attend_with_lse(q, append_view(k, v, n), implementation="loop"))(
            q, k, v, n)

    for lengths in (RAGGED, EVEN, RAGGED[::-1].copy()):
        out, lse = f(q, k, v, lengths)
        for slot in (0, SLOTS - 1):
            positions = np.where(np.arange(CAPACITY) < lengths[slot][:, None], np.arange(CAPACITY), -1)
            assert_close(out[slot], lse[slot], *reference(q[slot], k[slot], v[slot], lengths[slot], positions))
    assert len(traced) == 1
    hlo = f.lower(q, k, v, RAGGED).compile().as_text()
    assert " gather(" not in hlo and "conditional(" in hlo
    # plain vmap of the same loop (a batched trip count) reads every block by a gather of the whole cache
    plain = jax.jit(jax.vmap(lambda q, k, v, n: _append.read_blocks(
        q, _operands.default_positions(q, n, None), {"k": k, "v": v, "lengths": n}, None,
        causal=True, scale=DIM ** -0.5, n=64)))
    assert " gather(" in plain.lower(q, k, v, RAGGED).compile().as_text()


@pytest.mark.parametrize("reading", list(RING_LENGTHS))
def test_ring_views_under_vmap_read_each_slots_filled_slots(reading):
    sink, window, capacity = RING
    q, k, v = inputs(3, capacity)
    lengths = RING_LENGTHS[reading]
    positions = np.stack([[ring_positions(int(n), capacity, sink) for n in slot] for slot in lengths])
    f = jax.jit(jax.vmap(lambda q, k, v, n, p: jss.attend_with_lse(
        q, jss.KVView(k=k, v=v, lengths=n, positions=p, window=window, sink=sink))))
    k_dirty = np.where((positions < 0)[:, :, None, :, None], 1e4, k).astype(np.float32)  # empty slots
    out, lse = f(q, k_dirty, v, lengths, positions)
    for slot in range(SLOTS):
        ref = reference(q[slot], k[slot], v[slot], lengths[slot], positions[slot], window=window, sink=sink)
        assert_close(out[slot], lse[slot], *ref)


def test_grad_through_vmapped_ring_attention_matches_float64_finite_differences():
    """Ring views stay reverse-differentiable under vmap (training steps a batch of them).

    Some rings wrapped, some filling up: the gradient of ``sum(sin(out))``
    against central differences of the float64 reference along random
    directions of q, k and v.
    """
    sink, window, capacity = 2, 40, 64
    q, k, v = (x[:, :1] for x in inputs(4, capacity))
    lengths = np.array([[3], [64], [100], [20], [1], [70]], np.int32)
    positions = np.stack([[ring_positions(int(n), capacity, sink) for n in slot] for slot in lengths])

    def ring(k, v, n, p):
        return jss.KVView(k=k, v=v, lengths=n, positions=p, window=window, sink=sink)

    def loss(q, k, v):
        out = jax.vmap(lambda q, k, v, n, p: jss.attend(q, ring(k, v, n, p)))(q, k, v, lengths, positions)
        return jnp.sum(jnp.sin(out))

    def reference_loss(x):
        return sum(np.sum(np.sin(reference(x[0][s], x[1][s], x[2][s], lengths[s], positions[s], window=window,
                                           sink=sink)[0])) for s in range(SLOTS))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert_directional_derivatives(got, (q, k, v), reference_loss, np.random.default_rng(40))
    unfilled = np.broadcast_to((positions < 0)[:, :, None, :, None], k.shape)  # ring slots not written yet
    assert unfilled.any() and np.all(np.asarray(got[1])[unfilled] == 0) and np.all(np.asarray(got[2])[unfilled] == 0)
    assert float(jnp.max(jnp.abs(got[1]))) > 0 and float(jnp.max(jnp.abs(got[2]))) > 0


def test_grad_of_the_loop_outside_vmap_is_the_dense_softmax_gradient_jitted_or_not():
    """The loop's VJP (the flash backward of ``_append._float_append``) under ``jit``, where its trip count is
    traced, and outside it."""
    q, k, v = (jnp.asarray(x[0]) for x in inputs(5, 200))
    lengths = jnp.asarray([150, 7], jnp.int32)
    positions = np.where(np.arange(200) < np.asarray(lengths)[:, None], np.arange(200), -1)

    def loss(q, k, v, lengths):
        return jnp.sum(jss.attend(q, append_view(k, v, lengths), implementation="loop") ** 2)

    def reference_loss(q, k, v):  # a dense masked softmax in float32
        qg = q.reshape(BATCH, T, KV_HEADS, GROUPS, DIM)
        s = jnp.einsum("btkgd,bknd->btkgn", qg, k) / np.sqrt(DIM)
        qp = np.asarray(lengths)[:, None] - T + np.arange(T)
        visible = (positions[:, None, :] >= 0) & (positions[:, None, :] <= qp[:, :, None])
        s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
        out = jnp.einsum("btkgn,bknd->btkgd", jax.nn.softmax(s, axis=-1), v)
        return jnp.sum(out ** 2)

    want = jax.grad(reference_loss, argnums=(0, 1, 2))(q, k, v)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    for grads in (grad(q, k, v, lengths), jax.jit(grad)(q, k, v, lengths)):
        for got, expected in zip(grads, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def stacked_paged(rng, slots, page_size, num_pages):
    """Per slot, a paged cache of BATCH sequences with random ragged rows; stacked, and each slot's dense view."""
    caches, denses = [], []
    for slot in range(slots):
        paged = jss.PagedKVCache.allocate(max_slots=BATCH, kv_heads=KV_HEADS, head_dim=DIM, page_size=page_size,
                                          num_pages=num_pages)
        for _ in range(1 + 2 * slot):  # ragged across slots too
            rows = randn(rng, 2, BATCH, 9, KV_HEADS, DIM)
            counts = jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)
            paged = paged.append(jss.KVChunk(rows[0], rows[1], counts))
        caches.append(paged.view())
        denses.append(paged.view().to_dense())
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *caches), denses


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_views_under_vmap_fold_their_pools(page_size):
    rng = np.random.default_rng(6)
    views, denses = stacked_paged(rng, SLOTS, page_size, num_pages=6 * -(-99 // page_size))
    q = randn(rng, SLOTS, BATCH, T, KV_HEADS * GROUPS, DIM)
    f = jax.jit(jax.vmap(lambda q, view: jss.attend_with_lse(q, view, implementation="loop")))
    out, lse = f(q, views)
    for slot, dense in enumerate(denses):
        assert_close(out[slot], lse[slot], *reference(q[slot], dense.k, dense.v, dense.lengths, dense.positions))
    hlo = f.lower(q, views).compile().as_text()
    pool_rows = SLOTS * views.k_pages.shape[1] * page_size
    for shape in re.findall(r"= \w+\[([\d,]*)\]\S* gather\(", hlo):  # one block of pages per read, never a pool
        rows = np.prod([int(d) for d in shape.split(",") if d]) // (KV_HEADS * DIM)
        assert rows <= SLOTS * BATCH * max(jss.attention.PAGED_BLOCK_SIZE, page_size) < pool_rows


@pytest.mark.skipif(not _library.AVAILABLE, reason="the native kernel is not built here")
@pytest.mark.usefixtures("kernel_takes_every_step")
def test_native_kernel_folds_independent_caches_into_one_call_with_every_slot_in_its_batch():
    q, k, v = inputs(7)
    with _library.use(True):
        hlo = pooled_attend("native").lower(q, k, v, RAGGED).compile().as_text()
    calls = re.findall(r"= \((f32\[[\d,]+\])[^\n]*custom_call_target=\"" + _library.TARGET + '"', hlo)
    assert len(calls) == 1 and calls[0] == f"f32[{SLOTS * BATCH},{T},{KV_HEADS * GROUPS},{DIM}]"


@pytest.mark.parametrize("ring", [False, True], ids=["append", "ring"])
def test_quantized_caches_under_vmap_match_their_dequantized_values(ring):
    rng = np.random.default_rng(8)
    kind = {"window": 40, "sink": 2, "max_staged": 9} if ring else {"capacity": 2000}
    caches = []
    for _slot, steps in enumerate([1, 200, 3, 0, 7, 2]):  # one long slot: read one by one
        cache = jss.KVCache.allocate(batch=1, kv_heads=KV_HEADS, head_dim=DIM, quantize="int8", **kind)
        for _ in range(steps):
            rows = randn(rng, 2, 1, 9, KV_HEADS, DIM)
            cache = cache.append(jss.KVChunk(rows[0], rows[1]))
        caches.append(cache)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *caches)
    q = randn(rng, SLOTS, 1, T, KV_HEADS * GROUPS, DIM)
    out, lse = jax.jit(jax.vmap(lambda q, cache: jss.attend_with_lse(q, cache.view())))(q, stacked)
    for slot, cache in enumerate(caches):
        view = cache.view()
        k, v = (np.asarray(x, np.float64) * np.asarray(s) for x, s in ((view.k, view.k_scale), (view.v, view.v_scale)))
        ref = reference(q[slot], k, v, view.lengths, view.positions, window=view.window, sink=view.sink)
        assert_close(out[slot], lse[slot], *ref)


def test_lanes_sharing_each_slots_cache_inside_a_pool_read_it_once_and_without_a_gather():
    """vmap over slots of vmap over lanes that share the slot's cache: the lanes become query rows."""
    lanes = 3
    q, k, v = inputs(9)
    q = np.stack([q * (lane + 1) for lane in range(lanes)], axis=1)  # [slots, lanes, batch, T, heads, dim]
    lane_positions = RAGGED[:, None, :, None] - 1 - np.arange(lanes)[None, :, None, None] * 2 - np.arange(T)

    def per_slot(q, k, v, n, p):
        return jax.vmap(lambda q, p: jss.attend_with_lse(q, append_view(k, v, n), q_positions=p,
                                                         implementation="loop"))(q, p)

    f = jax.jit(jax.vmap(per_slot))
    out, lse = f(q, dirty(k, RAGGED), v, RAGGED, lane_positions)
    for slot in range(SLOTS):
        positions = np.where(np.arange(CAPACITY) < RAGGED[slot][:, None], np.arange(CAPACITY), -1)
        for lane in range(lanes):
            ref = reference(q[slot, lane], k[slot], v[slot], RAGGED[slot], positions,
                            q_positions=lane_positions[slot, lane])
            assert_close(out[slot, lane], lse[slot, lane], *ref)
    assert " gather(" not in f.lower(q, k, v, RAGGED, lane_positions).compile().as_text()
