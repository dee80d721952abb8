"""The examples' world model: its session-backed rollout against flax's own decode cache and raw arrays."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_session_state as jss
from benchmarks import _rollout_baselines as baselines
from examples.world_model import WorldModel, WorldModelConfig, kv_names, moving_patterns, rollout, start_session

CONFIG = WorldModelConfig(layers=2, capacity=256)


def started(config, watched, seed=0):
    """A model, a session after ``watched`` teacher-forced frames, and 4 more actions."""
    model = WorldModel(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed)
    frames, actions = moving_patterns(key, config, watched + 4, config.batch)
    prompt = jax.random.normal(key, (config.batch, config.prompt_tokens, config.d_model))
    session = start_session(model, prompt, frames[: config.context_frames])
    seen = frames[config.context_frames: config.context_frames + watched]
    session = jax.jit(functools.partial(rollout, model))(session, actions[:watched], seen)[0]
    return model, session, actions[watched:]


def test_rollout_matches_flax_decode_cache_and_raw_arrays():
    model, session, actions = started(CONFIG, watched=3)
    snapshot = baselines.Snapshot.of(session, kv_names(CONFIG))
    cond = baselines.cond_view(snapshot)
    ours = np.asarray(jax.jit(functools.partial(rollout, model))(session, actions)[1])

    graphdef, params = nnx.split(model)
    raw_rollout = jax.jit(functools.partial(baselines.raw_rollout, graphdef))
    raw = raw_rollout(params, cond, baselines.raw_state(snapshot, 256), actions)[1]
    np.testing.assert_allclose(np.asarray(raw), ours, rtol=1e-5, atol=1e-5)

    # flax's MultiHeadAttention on its own cache, one token per call: an independent attention.
    decoder = baselines.nnx_decode_model(model, snapshot, 256)
    graphdef, params, cache = nnx.split(decoder, nnx.Param, nnx.Cache)
    h, frames = jnp.asarray(snapshot.h), jnp.asarray(snapshot.frames)
    decoded = baselines.nnx_decode_rollout(graphdef, params, cache, cond, h, frames, actions)[1]
    np.testing.assert_allclose(np.asarray(decoded), ours, rtol=1e-4, atol=1e-4)


def test_two_steps_per_loop_iteration_roll_what_one_does_even_for_an_odd_count():
    model, session, actions = started(CONFIG, watched=2)
    runs = {unroll: jax.jit(functools.partial(rollout, model, unroll=unroll))(session.fork(), actions[:3])
            for unroll in (1, 2)}
    (one_session, one_frames), (two_session, two_frames) = runs[1], runs[2]
    np.testing.assert_allclose(np.asarray(two_frames), np.asarray(one_frames), rtol=1e-6, atol=1e-6)
    for name in kv_names(CONFIG):
        assert two_session[name].committed.tolist() == one_session[name].committed.tolist() == [(2 + 3) * CONFIG.tokens]
    np.testing.assert_allclose(
        np.asarray(two_session.view()["carry"]["h"]), np.asarray(one_session.view()["carry"]["h"]), rtol=1e-6, atol=1e-6
    )


def test_donated_rollout_compiles_once_and_writes_in_place():
    model, session, actions = started(dataclasses.replace(CONFIG, layers=1), watched=1)
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    @chex.assert_max_traces(n=1)
    def run(params, session, actions):
        return rollout(nnx.merge(graphdef, params), session, actions)

    reference = session.fork()  # its own buffers: rolled without donation below
    length, end = int(session["kv_0"].committed[0]), (1 + 8) * CONFIG.tokens  # rows [length, end) written below
    held = {name: np.asarray(jnp.copy(getattr(session["kv_0"], name))) for name in ("k", "v")}  # host copies
    before = session["kv_0"].k.unsafe_buffer_pointer()
    session, _ = run(params, session, actions)
    session, frames = run(params, session, actions)
    assert session["kv_0"].k.unsafe_buffer_pointer() == before  # the donated buffer was reused
    assert session["kv_0"].committed.tolist() == [(1 + 8) * CONFIG.tokens] and frames.shape == (4, 1, 8, 8, 4)
    jss.check(session)
    # The same rollout, not donated: what it must have written.
    roll = jax.jit(lambda params, session, actions: rollout(nnx.merge(graphdef, params), session, actions))
    reference, _ = roll(params, reference, actions)
    reference, want_frames = roll(params, reference, actions)
    np.testing.assert_allclose(np.asarray(frames), np.asarray(want_frames), rtol=1e-6, atol=1e-6)
    for name in ("k", "v"):
        got = np.asarray(getattr(session["kv_0"], name))
        np.testing.assert_array_equal(got[:, :, :length], held[name][:, :, :length], err_msg=name)  # kept
        np.testing.assert_allclose(got, np.asarray(getattr(reference["kv_0"], name)), rtol=1e-6, atol=1e-6,
                                   err_msg=name)
        assert np.all(np.any(got[:, :, length:end] != 0, axis=-1)), name  # every row written holds data
        assert not np.any(got[:, :, end:]), name  # nothing past the 8 steps' rows
    np.testing.assert_allclose(np.asarray(session.view()["carry"]["h"]), np.asarray(reference.view()["carry"]["h"]),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("capacity", [None, 256], ids=["ring", "append"])
def test_a_lane_imagines_what_the_session_would_roll(capacity):
    config = dataclasses.replace(CONFIG, layers=1, capacity=capacity, window=32, lane_frames=4)
    model, session, actions = started(config, watched=3)
    plans = jnp.stack([actions, -actions, 0 * actions])  # three candidate action sequences

    def imagine(lane, plan):
        frames = []
        for action in plan:
            lane, frame = model.step(lane, action)
            frames.append(frame)
        return lane, jnp.stack(frames)

    window = {**{name: 4 * config.tokens for name in kv_names(config)}, "frames": 4}
    branches, imagined = jax.jit(lambda s, p: s.branch(3, window=window).map(imagine, p))(session, plans)
    roll = jax.jit(functools.partial(rollout, model))
    for lane in range(3):
        rolled, frames = roll(session, plans[lane])
        # Cascade attention (prefix and lane merged by log-sum-exp) against one pass: float32 rounding.
        np.testing.assert_allclose(np.asarray(imagined[lane]), np.asarray(frames), rtol=1e-4, atol=1e-4)
        adopted = branches.adopt(lane)
        for name in kv_names(config):
            assert adopted[name].committed.tolist() == rolled[name].committed.tolist()
        np.testing.assert_allclose(adopted.view()["carry"]["h"], rolled.view()["carry"]["h"], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(adopted.view()["frames"].items, rolled.view()["frames"].items, rtol=1e-4, atol=1e-4)
