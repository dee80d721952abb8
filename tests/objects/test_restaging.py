"""Re-staging: a frame staged once per denoising step, then committed clean, against a plain Python model.

``stage`` replaces what was staged in every growing kind, so the pattern
"stage S times (no discard), commit the clean frame" leaves exactly the
clean frames committed and, between steps, exactly one staged frame: the
mistake of forgetting ``discard`` cannot show two noisy copies.  A refused
re-stage keeps what was staged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss

B, H, D, N, STEPS = 2, 2, 3, 4, 3


def kv_rows(rng, rows=None):
    k = rng.normal(size=(B, rows or N, H, D)).astype(np.float32)
    return k, -k


def denoised(obj, frames, write, how):
    """Each frame staged ``STEPS`` times (noisy), checked after every step, then committed clean."""
    stage = (lambda o, x: o.stage(write(x))) if how == "eager" else jax.jit(lambda o, x: o.stage(write(x)))
    commit = (lambda o, x: o.commit(write(x))) if how == "eager" else jax.jit(lambda o, x: o.commit(write(x)))
    snapshots = []
    for clean in frames:
        for step in range(STEPS):
            noisy = jax.tree_util.tree_map(lambda x, s=step: x + 10.0 * (s + 1), clean)
            obj = stage(obj, noisy)
            snapshots.append((obj, noisy))
        obj = commit(obj, clean)
    return obj, snapshots


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("sizing", [dict(capacity=32), dict(window=6, sink=2, max_staged=N)], ids=["append", "ring"])
def test_kv_cache_denoising_matches_model(how, sizing):
    rng = np.random.default_rng(0)
    frames = [kv_rows(rng) for _ in range(5)]  # 20 rows: the ring wraps
    kv = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, **sizing)
    kv, snapshots = denoised(kv, frames, lambda x: x, how)
    for i, (state, (noisy_k, _)) in enumerate(snapshots):
        f = i // STEPS
        assert state.staged.tolist() == [N] * B and state.committed.tolist() == [f * N] * B
        for b, row in enumerate(state.view().materialize()):  # one staged copy: the last step's, after the history
            np.testing.assert_array_equal(row["positions"][-N:], np.arange(f * N, (f + 1) * N))
            np.testing.assert_array_equal(row["k"][-N:], noisy_k[b])
            assert len(row["positions"]) == len(set(row["positions"].tolist()))
    history = np.concatenate([k for k, _ in frames], axis=1)
    for b, row in enumerate(kv.view(include_staged=False).materialize()):
        keep = row["positions"]
        expected = keep if "capacity" in sizing else [p for p in range(20) if p < 2 or p >= 20 - 6]
        np.testing.assert_array_equal(keep, expected)
        np.testing.assert_array_equal(row["k"], history[b, keep])  # the clean rows, never a noisy one
    assert kv.staged.tolist() == [0] * B


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_paged_cache_denoising_matches_model(how):
    rng = np.random.default_rng(1)
    frames = [kv_rows(rng) for _ in range(3)]
    paged = jss.PagedKVCache.allocate(max_slots=B, kv_heads=H, head_dim=D, page_size=4, num_pages=8)
    paged, snapshots = denoised(paged, frames, lambda x: x, how)
    for i, (state, (noisy_k, _)) in enumerate(snapshots):
        assert state.committed.tolist() == [(i // STEPS) * N] * B and state.staged.tolist() == [N] * B
        for b, row in enumerate(state.view().materialize()):
            np.testing.assert_array_equal(row["k"][-N:], noisy_k[b])
    history = np.concatenate([k for k, _ in frames], axis=1)
    for b, row in enumerate(paged.view(include_staged=False).materialize()):
        np.testing.assert_array_equal(row["k"], history[b])
    assert int(paged.free_count) == 8 - B * 3  # re-staging took no page beyond the frames' own


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("ring", [False, True])
def test_latent_buffer_denoising_matches_model(how, ring):
    rng = np.random.default_rng(2)
    frames = [rng.normal(size=(3,)).astype(np.float32) for _ in range(6)]
    sizing = dict(ring=True, max_staged=1) if ring else {}
    buffer = jss.LatentBuffer.allocate(capacity=4 if ring else 8, item_shape=(3,), **sizing)
    buffer, snapshots = denoised(buffer, frames, jnp.asarray, how)
    for state, noisy in snapshots:
        view = state.view()
        np.testing.assert_array_equal(np.asarray(view.items)[int(view.count) - 1], noisy)
        assert int(state.staged) == 1
    kept = frames[-4:] if ring else frames
    np.testing.assert_array_equal(buffer.view().materialize(), np.stack(kept))


def test_a_refused_restage_keeps_what_was_staged():
    """A re-stage past a ring's margin writes nothing: eagerly it raises, under jit it is flagged; either way
    the frame staged before stays staged, untouched."""
    rng = np.random.default_rng(3)
    kv = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=6, max_staged=N)
    staged_k, staged_v = kv_rows(rng)
    kv = kv.stage((staged_k, staged_v))
    too_many = kv_rows(rng, rows=N + 1)
    with pytest.raises(jss.CapacityError, match="max_staged"):
        kv.stage(too_many)
    flagged = jax.jit(lambda o, x: o.stage(x))(kv, too_many)
    assert bool(flagged.overflowed) and flagged.staged.tolist() == [N] * B
    for b, row in enumerate(flagged.view().materialize()):
        np.testing.assert_array_equal(row["k"], staged_k[b])
    with pytest.raises(jss.CapacityError):
        jss.check(flagged)
