"""Frames: block-causal attention (``attend(frame=N)`` / ``KVCache.allocate(frame=N)``) on every view.

Each query of a frame of ``N`` tokens (frame ``f`` holds positions
``[f*N, (f+1)*N)``) sees its whole frame and everything before it.  Every
result is checked against a float64 numpy reference whose mask is written
from frame indices (``key // N <= query // N``), not from the library's
"frame's last position" rule, over the rows a plain Python model says were
written.  A ring sized in frames is checked against Self-Forcing's rolling
cache: a frame ``f`` sees frame ``g <= f`` when ``g < sink_frames`` or
``f - g < window_frames - sink_frames`` (its ``local_attn_size`` counts the
sink frames and the current frame).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from tests.support.attention_reference import assert_directional_derivatives, randn

N = 4  # tokens per frame
H, GROUPS, D = 2, 2, 8  # kv heads, query heads per kv head (GQA), head dim
TOL = 1e-5


# ------------------------------------------------------------------ reference
def block_causal(frame):
    return lambda q, k: k // frame <= q // frame


def self_forcing(frame, window_frames, sink_frames):
    """Self-Forcing's visibility rule, in frames."""

    def visible(q, k):
        f, g = q // frame, k // frame
        return (g <= f) & ((g < sink_frames) | (f - g < window_frames - sink_frames))

    return visible


def reference(q, rows, q_positions, visible):
    """Float64 attention of each batch row's queries over ``rows[b] = (positions, k, v)`` where
    ``visible(query_position, key_position)``; zeros and -inf where a query sees nothing."""
    q = np.asarray(q, np.float64)
    B, T, q_heads, dim = q.shape
    out, lse = np.zeros(q.shape), np.full((B, T, q_heads), -np.inf)
    for b, (positions, k, v) in enumerate(rows):
        k, v = (np.repeat(np.asarray(x, np.float64), q_heads // x.shape[1], axis=1) for x in (k, v))
        mask = visible(np.asarray(q_positions[b])[:, None], np.asarray(positions)[None, :])  # [T, n]
        scores = np.einsum("thd,nhd->thn", q[b], k) / np.sqrt(dim)
        scores = np.where(mask[:, None, :], scores, -np.inf)
        top = scores.max(-1, keepdims=True, initial=-np.inf)
        seen = np.isfinite(top)
        weights = np.exp(scores - np.where(seen, top, 0.0))
        total = weights.sum(-1, keepdims=True)
        out[b] = np.einsum("thn,nhd->thd", weights / np.where(seen, total, 1.0), v)
        lse[b] = np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
    return out, lse


def assert_close(got, want, tol=TOL):
    (out, lse), (ref_out, ref_lse) = got, want
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.max(np.abs(out - ref_out)) <= tol * max(np.max(np.abs(ref_out)), 1e-30)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0) <= tol * max(1.0, np.abs(ref_lse[finite]).max())


def last_positions(lengths, T):
    """The default query positions: each row's last ``T``."""
    return np.asarray(lengths)[:, None] - T + np.arange(T)


def written_rows(k, v, lengths, quantize=None):
    """What a model of an append-mode cache holds per batch row: ``(positions, k, v)`` of its first
    ``lengths[b]`` rows (rounded as the cache stores them where quantized)."""
    if quantize is not None:
        stored = jss.KVCache.allocate(batch=k.shape[0], kv_heads=H, head_dim=D, capacity=k.shape[1],
                                      quantize=quantize).append((jnp.asarray(k), jnp.asarray(v)))
        k, v = (np.asarray(x.astype(jnp.float32) * s).transpose(0, 2, 1, 3)
                for x, s in ((stored.k, stored.k_scale), (stored.v, stored.v_scale)))
    return [(np.arange(n), k[b, :n], v[b, :n]) for b, n in enumerate(np.asarray(lengths))]


def attend_fn(how, **static):
    f = functools.partial(jss.attend_with_lse, **static)
    return jax.jit(f) if how == "jit" else f


# ------------------------------------------------------------------ append mode
@pytest.mark.parametrize(("how", "implementation", "quantize"), [
    ("eager", "auto", None), ("jit", "auto", None), ("jit", "loop", None), ("jit", "bucketed", None),
    ("jit", "auto", "int8"), ("eager", "loop", "fp8"),
])
def test_append_view_frames_against_float64(how, implementation, quantize):
    """Ragged rows (one ending mid-frame, one empty), queries spanning two frames, GQA, float and int8 / fp8."""
    rng = np.random.default_rng(0)
    B, capacity, T = 4, 40, N + 3
    lengths = np.array([37, 14, T, 0]) if quantize is None else np.array([37, 14, T, 9])
    k, v = randn(rng, B, capacity, H, D), randn(rng, B, capacity, H, D)
    kv = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=capacity, quantize=quantize)
    kv = kv.append(jss.KVChunk(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32)))
    q = randn(rng, B, T, H * GROUPS, D)
    got = attend_fn(how, frame=N, implementation=implementation)(q, kv.view())
    want = reference(q, written_rows(k, v, lengths, quantize), last_positions(lengths, T), block_causal(N))
    assert_close(got, want, TOL if quantize is None else 1e-4)
    token_causal = jss.attend_with_lse(q, kv.view(), implementation=implementation)
    assert not np.allclose(token_causal[0][:2], got[0][:2], atol=1e-3)  # the frame mask is another mask


def test_explicit_query_positions_are_read_at_their_frames_last():
    rng = np.random.default_rng(1)
    k, v = randn(rng, 1, 24, H, D), randn(rng, 1, 24, H, D)
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=24).append((jnp.asarray(k), jnp.asarray(v)))
    q = randn(rng, 1, 5, H, D)
    q_positions = np.array([[0, 5, 9, 13, -1]])  # frames 0, 1, 2, 3; -1 sees nothing
    got = jss.attend_with_lse(q, kv.view(), frame=N, q_positions=jnp.asarray(q_positions, jnp.int32))
    want = reference(q, written_rows(k, v, [24]), q_positions, lambda qp, kp: (qp >= 0) & block_causal(N)(qp, kp))
    assert_close(got, want)
    assert np.isneginf(np.asarray(got[1])[0, -1]).all()


def test_a_cache_allocated_in_frames_carries_the_mask():
    """``allocate(frame=N)``: the default call is block-causal; ``frame=N`` again is the same; another raises."""
    rng = np.random.default_rng(2)
    k, v = randn(rng, 1, 2 * N, H, D), randn(rng, 1, 2 * N, H, D)
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=16, frame=N)
    kv = kv.append((jnp.asarray(k), jnp.asarray(v)))
    q = randn(rng, 1, N, H, D)
    assert kv.view().frame == N
    want = reference(q, written_rows(k, v, [2 * N]), last_positions([2 * N], N), block_causal(N))
    assert_close(jss.attend_with_lse(q, kv.view()), want)
    assert_close(jss.attend_with_lse(q, kv.view(), frame=N), want)
    with pytest.raises(ValueError, match="allocated with frame=4"):
        jss.attend(q, kv.view(), frame=2)


# ------------------------------------------------------------------ ring: Self-Forcing's rolling cache
def denoise(kv, frames, steps, q, how):
    """The documented denoising pattern, frame by frame: stage the frame ``steps`` times (noisy rows), attend
    each time, then commit the clean frame.  Returns the last step's attention per frame."""

    def step(kv, k, v, q):
        kv = kv.stage((k, v))
        return kv, jss.attend_with_lse(q, kv.view())

    def commit(kv, k, v):
        return kv.commit((k, v))

    if how == "jit":
        step, commit = jax.jit(step, donate_argnums=0), jax.jit(commit, donate_argnums=0)
    results = []
    for f, (k, v) in enumerate(frames):
        for s in range(steps):  # noisy: the clean rows plus noise that shrinks; never discarded
            noise = (steps - s) * 0.5
            kv, result = step(kv, jnp.asarray(k + noise), jnp.asarray(v - noise), jnp.asarray(q[f]))
        results.append(result)
        kv = commit(kv, jnp.asarray(k), jnp.asarray(v))
    return kv, results


@pytest.mark.parametrize(("how", "window_frames", "sink_frames", "quantize"), [
    ("eager", 4, 1, None), ("jit", 4, 1, None), ("jit", 3, 0, None), ("jit", 5, 2, "int8"), ("eager", 4, 1, "fp8"),
])
def test_ring_in_frames_is_self_forcing_rolling_cache(how, window_frames, sink_frames, quantize):
    """Ten frames through a ring of ``window_frames`` (it wraps), each denoised in 3 steps without discard: each
    step reads the frame's last staging (one copy) and the clean frames Self-Forcing's cache would hold."""
    rng = np.random.default_rng(3)
    B, frames, steps = 2, 10, 3
    kv = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, frame=N, window_frames=window_frames,
                              sink_frames=sink_frames, quantize=quantize)
    assert (kv.window, kv.sink, kv.max_staged) == ((window_frames - sink_frames) * N, sink_frames * N, N)
    rows = [(randn(rng, B, N, H, D), randn(rng, B, N, H, D)) for _ in range(frames)]
    q = [randn(rng, B, N, H * GROUPS, D) for _ in range(frames)]
    _, results = denoise(kv, rows, steps, q, how)
    for f, result in enumerate(results):
        k = np.concatenate([r[0] for r in rows[:f + 1]], axis=1)
        v = np.concatenate([r[1] for r in rows[:f + 1]], axis=1)
        k[:, f * N:], v[:, f * N:] = k[:, f * N:] + 0.5, v[:, f * N:] - 0.5  # the last step's noisy frame
        model = written_rows(k, v, [(f + 1) * N] * B, quantize)
        want = reference(q[f], model, last_positions([(f + 1) * N] * B, N),
                         self_forcing(N, window_frames, sink_frames))
        assert_close(result, want, TOL if quantize is None else 1e-4)


def test_ring_in_tokens_read_in_frames():
    """A ring sized in tokens (a window that is no multiple of the frame) read with ``frame=``: the window
    counts back from the frame's last position, the sinks stay."""
    rng = np.random.default_rng(4)
    window, sink, T = 10, 3, 2 * N
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, window=window, sink=sink, max_staged=T)
    total = 7 * T
    k, v = randn(rng, 1, total, H, D), randn(rng, 1, total, H, D)
    for start in range(0, total, T):
        kv = kv.append((jnp.asarray(k[:, start:start + T]), jnp.asarray(v[:, start:start + T])))
    q = randn(rng, 1, T, H * GROUPS, D)

    def visible(qp, kp):
        last = (qp // N + 1) * N - 1
        return (kp <= last) & ((kp < sink) | (last - kp < window))

    want = reference(q, written_rows(k, v, [total]), last_positions([total], T), visible)
    assert_close(jax.jit(functools.partial(jss.attend_with_lse, frame=N))(q, kv.view()), want)


def test_a_ring_step_compiles_once():
    """The donated denoising step and the commit trace once over frames that wrap the ring."""
    chex.clear_trace_counter()

    @chex.assert_max_traces(n=1)
    def step(kv, k, v, q):
        kv = kv.stage((k, v))
        return kv, jss.attend(q, kv.view())

    step = jax.jit(step, donate_argnums=0)
    commit = jax.jit(lambda kv, k, v: kv.commit((k, v)), donate_argnums=0)
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, frame=N, window_frames=3, sink_frames=1)
    rng = np.random.default_rng(5)
    for _ in range(6):
        k, v, q = (jnp.asarray(randn(rng, 1, N, H, D)) for _ in range(3))
        for _ in range(2):
            kv, out = step(kv, k, v, q)
        kv = commit(kv, k, v)
    assert np.isfinite(np.asarray(out)).all()


# ------------------------------------------------------------------ paged and branch views
@pytest.mark.parametrize(("how", "implementation", "quantize"), [
    ("eager", "auto", None), ("jit", "loop", None), ("jit", "bucketed", None), ("jit", "auto", "int8"),
])
def test_paged_view_frames(how, implementation, quantize):
    rng = np.random.default_rng(6)
    slots, T = 3, N + 2
    lengths = np.array([23, T, 11])
    k, v = randn(rng, slots, 24, H, D), randn(rng, slots, 24, H, D)
    paged = jss.PagedKVCache.allocate(max_slots=slots, kv_heads=H, head_dim=D, page_size=8, num_pages=12,
                                      quantize=quantize)
    paged = paged.append(jss.KVChunk(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32)))
    q = randn(rng, slots, T, H * GROUPS, D)
    got = attend_fn(how, frame=N, implementation=implementation)(q, paged.view())
    want = reference(q, written_rows(k, v, lengths, quantize), last_positions(lengths, T), block_causal(N))
    assert_close(got, want, TOL if quantize is None else 1e-4)


@pytest.mark.parametrize("ring", [False, True])
def test_branch_view_frames(ring):
    """Lanes over a frame-carrying cache: each lane stages its own next frame (twice: re-staged) and reads it
    block-causally with the shared prefix."""
    rng = np.random.default_rng(7)
    lanes, prefix = 3, 5 * N
    sizing = dict(window_frames=3, sink_frames=1) if ring else dict(capacity=64)
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, frame=N, **sizing)
    k, v = randn(rng, 1, prefix, H, D), randn(rng, 1, prefix, H, D)
    for start in range(0, prefix, N):
        kv = kv.append((jnp.asarray(k[:, start:start + N]), jnp.asarray(v[:, start:start + N])))
    branches = jss.Session(objects={"kv": kv}).branch(lanes, window=N)
    lane_k, lane_v = randn(rng, lanes, 1, N, H, D), randn(rng, lanes, 1, N, H, D)
    q = randn(rng, lanes, 1, N, H * GROUPS, D)

    def read(lane, k, v, q):
        lane = lane.stage(kv=(k, v))
        return lane, jss.attend_with_lse(q, lane.view()["kv"])

    _, (out, lse) = jax.jit(lambda b, k, v, q: b.map(read, k, v, q))(branches, lane_k, lane_v, q)
    visible = self_forcing(N, 3, 1) if ring else block_causal(N)
    for lane in range(lanes):
        rows = written_rows(np.concatenate([k, lane_k[lane]], 1), np.concatenate([v, lane_v[lane]], 1),
                            [prefix + N])
        want = reference(q[lane], rows, last_positions([prefix + N], N), visible)
        assert_close((out[lane], lse[lane]), want)


# ------------------------------------------------------------------ transformations
def test_frames_under_vmap():
    """Caches stacked along a leading slot axis (as a pool holds them), read under ``jax.vmap``."""
    rng = np.random.default_rng(8)
    slots, T = 3, N
    lengths = [[2 * N], [N + 1], [3 * N]]
    k, v = randn(rng, slots, 1, 16, H, D), randn(rng, slots, 1, 16, H, D)
    caches = [jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=16, frame=N).append(
        jss.KVChunk(jnp.asarray(k[s]), jnp.asarray(v[s]), jnp.asarray(lengths[s], jnp.int32))) for s in range(slots)]
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *caches)
    q = randn(rng, slots, 1, T, H * GROUPS, D)
    out, lse = jax.jit(jax.vmap(lambda q, kv: jss.attend_with_lse(q, kv.view())))(q, stacked)
    for s in range(slots):
        want = reference(q[s], written_rows(k[s], v[s], lengths[s]), last_positions(lengths[s], T), block_causal(N))
        assert_close((out[s], lse[s]), want)


@pytest.mark.parametrize("implementation", ["auto", "loop"])
def test_frames_grad_against_float64(implementation):
    """The gradient of a loss through a frame read, against float64 central differences of the reference."""
    rng = np.random.default_rng(9)
    length, T = 3 * N + 2, N + 2
    k, v = randn(rng, 1, 16, H, D), randn(rng, 1, 16, H, D)
    q, weights = randn(rng, 1, T, H * GROUPS, D), randn(rng, 1, T, H * GROUPS, D)

    def loss(q, k, v):  # a view of 16 slots holding ``length`` rows, storage head-major
        view = jss.KVView(k=k.transpose(0, 2, 1, 3), v=v.transpose(0, 2, 1, 3), lengths=jnp.array([length]),
                          positions=jnp.where(jnp.arange(16) < length, jnp.arange(16), -1)[None])
        return jnp.sum(jss.attend(q, view, frame=N, implementation=implementation) * weights)

    def reference_loss(point):
        q, k, v = point
        rows = [(np.arange(length), k[0, :length], v[0, :length])]
        return np.sum(reference(q, rows, last_positions([length], T), block_causal(N))[0] * weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert_directional_derivatives(grads, [q, k, v], reference_loss, rng)


# ------------------------------------------------------------------ mistakes
def test_causal_false_on_a_ring_raises():
    """``causal=False`` would give each query its own sliding window, not the frame mask: refused, eagerly and
    under jit, on ring views and on branch views of rings."""
    rng = np.random.default_rng(10)
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, window=8, sink=2, max_staged=N)
    kv = kv.append((jnp.asarray(randn(rng, 1, N, H, D)),) * 2)
    q = jnp.asarray(randn(rng, 1, N, H, D))
    for read in (functools.partial(jss.attend, causal=False), jax.jit(functools.partial(jss.attend, causal=False))):
        with pytest.raises(ValueError, match=r"causal=False on a ring view .* pass frame=N"):
            read(q, kv.view())
    lane = jss.Session(objects={"kv": kv}).branch(2, window=N).lane(0).stage(kv=(q, q))
    with pytest.raises(ValueError, match="causal=False on a ring view"):
        jss.attend(q, lane.view()["kv"], causal=False)


def test_frame_arguments_are_checked():
    kv = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=8).append((jnp.ones((1, 2, H, D)),) * 2)
    q = jnp.ones((1, 2, H, D))
    for bad in (0, -4, True, 2.0, "4"):
        with pytest.raises(TypeError, match="frame must be a positive int"):
            jss.attend(q, kv.view(), frame=bad)
    with pytest.raises(ValueError, match="causal=False contradicts it"):
        jss.attend(q, kv.view(), frame=2, causal=False)
    allocate = functools.partial(jss.KVCache.allocate, batch=1, kv_heads=H, head_dim=D)
    with pytest.raises(TypeError, match="needs frame="):
        allocate(window_frames=4)
    with pytest.raises(TypeError, match="not both"):
        allocate(frame=N, window_frames=4, window=8)
    with pytest.raises(ValueError, match="must exceed sink_frames=4"):
        allocate(frame=N, window_frames=4, sink_frames=4)
    with pytest.raises(TypeError, match="sink_frames= applies only with window_frames="):
        allocate(frame=N, capacity=8, sink_frames=1)
    with pytest.raises(TypeError, match="frame must be an int"):
        allocate(frame=1.5, capacity=8)
