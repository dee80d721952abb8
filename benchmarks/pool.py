"""Many sessions in one jitted step: ``SessionPool`` against one jitted call per session.

The model is ``examples/world_model.py`` at its default size (4 blocks,
d_model 64, sink 16 + window 512 ring caches, one 16-token frame per step,
float32, batch 1).  Sixteen sessions, each at its own point of its rollout
(ragged lengths, their own prompts and actions), are stepped:

- pool: one jitted, donated ``pool.map`` over 16 slots (``jax.vmap`` of the
  one-session step); single: the same step jitted for one session, called
  16 times, each donated.  A ratio is the median over rounds of the two
  sides' times in that round; bar: pool / 16 singles <= 0.5 (goal 0.25);
- insert and extract (jitted, the pool donated, a traced slot) at 64 slots
  against 8 slots (bar <= 1.3: one session's bytes whatever the pool's
  size), and each against a jitted copy of one session (bar <= 2);
- equality: one session stepped 32 frames in the pool beside 15 others
  against the same session stepped alone (bar <= 1e-5 relative);
- peak resident memory of a donated rollout of a 16-slot pool of append-mode
  sessions (capacity 16k tokens, 256 MiB in all), in a fresh process: peak
  <= 1.25 x (pool bytes + the process's resident memory before allocating).

Attention under the pool (no bar; target pooled / singles <= 1): one
attention-only step over 16 append-mode caches, one holding 8192 tokens
and 15 holding 256 (ragged), and all 16 holding 1024 (even), pooled against
16 single calls, with the native kernel (its batching rule folds the slots
into its batch) and with the pure-JAX loop (its batching rule reads ragged
slots one by one, each to its own length, and folds even ones into one loop).

Run:  python -m benchmarks.pool [--full] [--out PATH]
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_session_state as jss
from benchmarks._common import cli
from examples.world_model import (
    WorldModel,
    WorldModelConfig,
    make_session,
    moving_patterns,
    start_session,
)
from jax_session_state._core import _library

SESSIONS = 16
EQUAL_FRAMES = 32
BARS = {"pool_over_singles": 0.5, "large_over_small": 1.3, "over_copy": 2.0, "relative_error": 1e-5,
        "peak_over_pool_plus_baseline": 1.25}


def _ratio(measure: str, value: float, bar: str) -> dict[str, Any]:
    return {"measure": f"ratio {measure}", "value": value, "bar": f"≤ {BARS[bar]}", "holds": value <= BARS[bar]}


def _paired(candidates: dict[str, Callable[[], Any]], *, rounds: int, repeat: int) -> dict[str, np.ndarray]:
    """Seconds per call of each candidate in every round (round-robin, alternating order)."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(repeat):
                candidates[name]()
            samples[name].append((time.perf_counter() - start) / repeat)
    return {name: np.asarray(times) for name, times in samples.items()}


class World:
    """The model, its one-session step, and 16 started sessions at different points of their rollouts."""

    def __init__(self) -> None:
        self.config = c = WorldModelConfig()
        self.model = WorldModel(c, rngs=nnx.Rngs(0))
        self.graphdef, self.params = nnx.split(self.model)
        key = jax.random.key(1)
        frames, self.actions = moving_patterns(key, c, 64, SESSIONS)  # [64, 16, 2]
        prompts = jax.random.normal(key, (SESSIONS, c.batch, c.prompt_tokens, c.d_model))
        single = jax.jit(self.step, donate_argnums=1)
        self.sessions = []
        for i in range(SESSIONS):
            session = start_session(self.model, prompts[i], frames[: c.context_frames, i: i + 1])
            for t in range(i % 5 * 3):  # sessions that joined earlier are further along
                session, _ = single(self.params, session, self.actions[t, i: i + 1])
            self.sessions.append(session)
        self.single = single
        self.pooled = jax.jit(lambda params, pool, actions: pool.map(functools.partial(self.step, params), actions),
                              donate_argnums=1)

    def step(self, params: nnx.State, session: jss.Session, action: jax.Array) -> tuple[jss.Session, jax.Array]:
        staged, frame = nnx.merge(self.graphdef, params).step(session, action)
        return staged.commit(), frame

    def pool(self, slots: int = SESSIONS) -> jss.SessionPool:
        pool = jss.SessionPool.allocate(make_session(self.config), slots=slots)
        insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
        for slot, session in enumerate(self.sessions):
            pool = insert(pool, slot, session.fork())
        return pool


def step_rows(world: World, *, rounds: int) -> list[dict[str, Any]]:
    """One pool step of 16 sessions against 16 single-session steps."""
    state = {"pool": world.pool(), "singles": [s.fork() for s in world.sessions]}
    actions = world.actions[0][:, None]  # [16, batch 1, 2]

    def pool_step() -> None:
        state["pool"], out = world.pooled(world.params, state["pool"], actions)
        jax.block_until_ready(out)

    def single_steps() -> None:
        outs = []
        for i in range(SESSIONS):
            state["singles"][i], out = world.single(world.params, state["singles"][i], actions[i])
            outs.append(out)
        jax.block_until_ready(outs)

    for _ in range(3):  # compile and warm up
        pool_step()
        single_steps()
    samples = _paired({"pool": pool_step, "singles": single_steps}, rounds=rounds, repeat=4)
    ratio = float(np.median(samples["pool"] / samples["singles"]))
    return [
        {"measure": "step of 16 sessions: one pool step (ms)", "value": samples["pool"].min() * 1e3},
        {"measure": "step of 16 sessions: 16 single-session steps (ms)", "value": samples["singles"].min() * 1e3},
        _ratio("one pool step / 16 single-session steps (goal ≤ 0.25)", ratio, "pool_over_singles"),
    ]


def slot_rows(world: World, *, rounds: int) -> list[dict[str, Any]]:
    """Insert and extract at 8 and 64 slots, and a copy of one session."""
    session = world.sessions[3]
    insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
    release = jax.jit(jss.SessionPool.release, donate_argnums=0)
    extract = jax.jit(jss.SessionPool.extract)
    copy = jax.jit(lambda s: jax.tree_util.tree_map(jnp.copy, s))
    pools = {slots: jss.SessionPool.allocate(make_session(world.config), slots=slots) for slots in (8, 64)}
    pools = {slots: insert(pool, 1, session) for slots, pool in pools.items()}  # slot 1 live for extract
    slot = jnp.int32(5)
    names = ("insert 8", "insert 64", "extract 8", "extract 64", "copy")
    samples: dict[str, list[float]] = {name: [] for name in names}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        samples[name].append(time.perf_counter() - start)
        return result

    for round_ in range(rounds + 3):
        for slots in (8, 64) if round_ % 2 == 0 else (64, 8):
            pools[slots] = timed(f"insert {slots}", lambda s=slots: insert(pools[s], slot, session))
            pools[slots] = jax.block_until_ready(release(pools[slots], slot))
            timed(f"extract {slots}", lambda s=slots: extract(pools[s], jnp.int32(1)))
        timed("copy", lambda: copy(session))
    best = {name: min(times[3:]) for name, times in samples.items()}  # the first rounds compile
    median = {name: float(np.median(times[3:])) for name, times in samples.items()}
    nbytes = session.nbytes
    rows = [{"measure": f"{name} (µs, best; one session = {nbytes / 2**10:.0f} KiB)", "value": best[name] * 1e6}
            for name in samples]
    for op in ("insert", "extract"):
        rows.append(_ratio(f"{op} at 64 slots / at 8 slots (medians)", median[f"{op} 64"] / median[f"{op} 8"],
                           "large_over_small"))
        rows.append(_ratio(f"{op} at 64 slots / a copy of one session (medians)", median[f"{op} 64"] / median["copy"],
                           "over_copy"))
    return rows


def equality_rows(world: World) -> list[dict[str, Any]]:
    """One session's frames stepped in the pool beside 15 others against stepped alone."""
    pool, watched = world.pool(), 7
    alone, frames_alone, frames_pooled = world.sessions[watched].fork(), [], []
    for t in range(EQUAL_FRAMES):
        pool, out = world.pooled(world.params, pool, world.actions[t][:, None])
        alone, frame = world.single(world.params, alone, world.actions[t, watched: watched + 1])
        frames_pooled.append(out[watched])
        frames_alone.append(frame)
    pool.check()
    pooled, single = np.asarray(jnp.stack(frames_pooled)), np.asarray(jnp.stack(frames_alone))
    error = float(np.max(np.abs(pooled - single)) / np.max(np.abs(single)))
    state = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0) / max(np.max(np.abs(np.asarray(b))), 1e-30))
        for a, b in zip(jax.tree_util.tree_leaves(pool.extract(watched)), jax.tree_util.tree_leaves(alone))
        if jnp.issubdtype(a.dtype, jnp.floating)
    )
    return [
        _ratio(f"{EQUAL_FRAMES} frames of a session in the pool vs alone: max relative error", error, "relative_error"),
        _ratio("its state after them: max relative error over leaves", state, "relative_error"),
    ]


def memory_rows(slots: int, capacity: int, steps: int) -> list[dict[str, Any]]:
    command = f"exec {shlex.quote(sys.executable)} -m benchmarks._pool_memory {slots} {capacity} {steps}"
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    bound = memory["pool"] + memory["baseline"]
    return [
        {"measure": "memory: baseline resident before allocating (MiB)", "value": memory["baseline"] / 2**20},
        {"measure": f"memory: pool of {slots} sessions, capacity {capacity}, logical bytes (MiB)",
         "value": memory["pool"] / 2**20},
        {"measure": f"memory: peak resident of a donated {steps}-step pool rollout (MiB)",
         "value": memory["peak"] / 2**20},
        _ratio("peak / (pool + baseline)", memory["peak"] / bound, "peak_over_pool_plus_baseline"),
    ]


def attention_rows(*, rounds: int, long: int = 8192, short: int = 256, even: int = 1024) -> list[dict[str, Any]]:
    """Attention-only steps over 16 append-mode caches: pooled against 16 single calls.

    Ragged: one cache holding ``long`` tokens and 15 holding ``short``; even:
    every cache holding ``even`` tokens (the pure loop folds them into one loop).
    """
    c = WorldModelConfig()
    key = jax.random.key(2)
    q = jax.random.normal(key, (SESSIONS, 1, c.tokens, c.heads, c.head_dim))
    cases = {f"1 x {long} + 15 x {short} tokens": [long] + [short] * (SESSIONS - 1),
             f"16 x {even} tokens": [even] * SESSIONS}
    rows_out = []
    for case, lengths in cases.items():
        caches = []
        for i, length in enumerate(lengths):
            rows = jax.random.normal(jax.random.fold_in(key, i), (2, 1, length, c.kv_heads, c.head_dim))
            caches.append(jss.KVCache.allocate(batch=1, kv_heads=c.kv_heads, head_dim=c.head_dim, capacity=long)
                          .append(jss.KVChunk(rows[0], rows[1])))
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *caches)
        for native in ([True, False] if _library.AVAILABLE else [False]):
            with _library.use(native):
                one = jax.jit(lambda cache, q: jss.attend(q, cache.view()))
                pooled = jax.jit(jax.vmap(lambda cache, q: jss.attend(q, cache.view())))
                jax.block_until_ready((pooled(stacked, q), [one(cache, q[i]) for i, cache in enumerate(caches)]))
            samples = _paired({
                "pool": lambda pooled=pooled, stacked=stacked: jax.block_until_ready(pooled(stacked, q)),
                "singles": lambda one=one, caches=caches: jax.block_until_ready(
                    [one(cache, q[i]) for i, cache in enumerate(caches)]),
            }, rounds=rounds, repeat=3)
            name = "native kernel" if native else "pure-JAX loop"
            rows_out += [
                {"measure": f"attention, {case}, {name}: pooled (ms)", "value": samples["pool"].min() * 1e3},
                {"measure": f"attention, {case}, {name}: 16 single calls (ms)",
                 "value": samples["singles"].min() * 1e3},
                {"measure": f"ratio attention pooled / 16 single calls, {case}, {name} (no bar)",
                 "value": float(np.median(samples["pool"] / samples["singles"]))},
            ]
    return rows_out


def run(*, full: bool) -> list[dict[str, Any]]:
    """Rows of step, slot-operation, equality and memory figures."""
    print(__doc__.split("\n\n", 1)[1].split("Run:")[0])
    world = World()
    rounds = 60 if full else 30
    rows = step_rows(world, rounds=rounds)
    rows += slot_rows(world, rounds=rounds * 2)
    rows += equality_rows(world)
    rows += memory_rows(SESSIONS, 16384 * (4 if full else 1), 16)
    rows += attention_rows(rounds=max(5, rounds // 3))
    return rows


if __name__ == "__main__":
    cli("pool", run, __doc__)
