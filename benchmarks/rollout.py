"""The world model's rollout: the library against PyTorch eager, flax nnx's decode cache and raw JAX.

The model is ``examples/world_model.py`` (4 blocks, d_model 64, 4 query and
2 K/V heads of 16, one 16-token frame per step, float32, batch 1) with K/V
caches of capacity 32k tokens (append mode).  From the same state -- a
prefix of P tokens written by a teacher-forced rollout -- each side rolls
the same frames with the same weights (checked: the frames agree).  The
sides run in interleaved rounds, back to back in alternating order; a time
is the best of its rounds (on a shared machine a slower run measures the
neighbours) and a ratio is the median over rounds of the two sides' times
in that round, which cancels the machine's slow phases (the ratio of the
two best times, reported beside it, swung from 1.00 to 1.15 between runs
of the same code when one side caught a quiet moment the other missed):

- library: the whole rollout is one jitted ``lax.scan`` over
  ``WorldModel.step`` with the ``jss.Session`` donated, two steps per loop
  iteration (``STEPS_PER_ITERATION``); attention reads the valid prefix
  only (``jss.attend``).  Timed: 256 frames from an empty
  session (the demo's rollout), and 16 frames after prefixes of 1k and 4k
  tokens (and 16k with ``--full``);
- raw JAX: the same scan hand-written on raw arrays (K/V written with
  ``lax.dynamic_update_slice``, the same projections and ``jss.attend``),
  jitted the same way: the weights and the conditioning are arguments and
  a loop iteration runs two steps, as in the library's rollout; bar:
  library <= 1.05 x raw (the abstraction costs nothing);
- PyTorch eager: a preallocated head-major cache per block written in place
  with ``copy_``, ``scaled_dot_product_attention`` over the valid prefix
  (grouped-query heads, a causal mask for the chunk), under
  ``inference_mode``, with the faster of 1 and 2 threads (tried first);
  bar: library <= 1.0 x PyTorch at capacity 32k;
- flax nnx: the blocks' ``nnx.MultiHeadAttention`` on its own decode cache,
  one token per call (its only mode), the frames scanned in one jitted
  call; flax attends over the whole capacity with a mask; bar: library per
  token <= 0.1 x nnx per token;
- peak resident memory of a donated rollout with a 1 GiB session, in a
  fresh process launched through ``sh -c``: peak <= 1.25 x (session bytes +
  the process's resident memory before allocating it, after compiling).

Where the time goes: with a short valid prefix a step is dozens of small
ops, which PyTorch dispatches one by one and XLA runs as one program -- the
library wins there.  Past a few thousand valid tokens the step is bound by
attention, where XLA:CPU's blockwise ``jss.attend`` (its K/V block copies,
matmuls and softmax passes, broken down in ``benchmarks/attention.py``,
part d) runs below PyTorch's fused attention kernel, and PyTorch wins.

Run:  python -m benchmarks.rollout [--full] [--out PATH]
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_session_state as jss
from benchmarks import _rollout_baselines as baselines
from benchmarks._common import cli, timed_rounds
from examples.world_model import WorldModel, WorldModelConfig, kv_names, moving_patterns, rollout, start_session

CAPACITY = 32 * 1024
NNX_FRAMES = 2  # frames per timed flax decode rollout (32 tokens, one call each)
MEMORY_CAPACITY = 1024 * 1024  # tokens: 4 blocks x 1 KiB per token = a 1 GiB session
BARS = {"library_over_torch": 1.0, "library_over_nnx_per_token": 0.1, "library_over_raw": 1.05,
        "peak_over_session_plus_baseline": 1.25}


class Setup:
    """The model, a session holding ``prefix`` tokens, its snapshot and ``frames`` actions to time."""

    def __init__(self, prefix: int, frames: int):
        self.config = config = WorldModelConfig(capacity=CAPACITY)
        self.model = WorldModel(config, rngs=nnx.Rngs(0))
        self.graphdef, self.params = nnx.split(self.model)
        watched = prefix // config.tokens
        key = jax.random.key(1)
        episode, actions = moving_patterns(key, config, watched + frames, config.batch)
        prompt = jax.random.normal(key, (config.batch, config.prompt_tokens, config.d_model))
        session = start_session(self.model, prompt, episode[: config.context_frames])
        seen = episode[config.context_frames: config.context_frames + watched]
        self.rollout = jax.jit(self._rollout, donate_argnums=1)
        self.session = self.rollout(self.params, session, actions[:watched], seen)[0]
        self.actions = actions[watched:]
        self.snapshot = baselines.Snapshot.of(self.session, kv_names(config))

    def _rollout(self, params: nnx.State, session: jss.Session, actions: jax.Array, observed: Any = None):
        return rollout(nnx.merge(self.graphdef, params), session, actions, observed)


def _blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args: jax.block_until_ready(fn(*args))


def step_times(prefix: int, frames: int, *, rounds: int
               ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds per frame of the library, raw JAX and PyTorch rolling ``frames`` frames after ``prefix`` tokens.

    Returns:
      The best times; the ratios of the library to raw JAX and to PyTorch,
      each the median over rounds of the round's two times; and the ratios
      of the best times.
    """
    s = Setup(prefix, frames)
    cond = baselines.cond_view(s.snapshot)
    raw = jax.jit(functools.partial(baselines.raw_rollout, s.graphdef), donate_argnums=2)
    library = _blocking(lambda session: s.rollout(s.params, session, s.actions))
    raw_run = _blocking(lambda state: raw(s.params, cond, state, s.actions))
    outputs = {
        "library": library(s.session.fork())[1],
        "raw JAX": raw_run(baselines.raw_state(s.snapshot, CAPACITY))[1],
    }
    candidates = {
        "library": (s.session.fork, library),
        "raw JAX": (lambda: baselines.raw_state(s.snapshot, CAPACITY), raw_run),
    }
    try:
        import torch
    except ImportError:
        print("torch is not installed: the PyTorch rows are skipped (pip install torch).")
    else:
        model = baselines.TorchWorldModel(s.model, s.snapshot, CAPACITY)
        actions = np.asarray(s.actions)
        outputs["PyTorch eager"] = model.rollout(actions)

        def torch_setup(threads: int) -> Callable[[], None]:
            def setup() -> None:
                torch.set_num_threads(threads)
                model.restore(s.snapshot)
            return setup

        # PyTorch runs with the faster of 1 and 2 threads (on a busy machine 2 threads can be far slower).
        trial = {threads: (torch_setup(threads), lambda _: model.rollout(actions)) for threads in (1, 2)}
        threads = min(trial, key=lambda n: min(timed_rounds({n: trial[n]}, rounds=3)[n]))
        candidates[f"PyTorch eager ({threads} thread{'s' if threads > 1 else ''})"] = trial[threads]
    for name, got in outputs.items():  # every side computes the same frames
        np.testing.assert_allclose(np.asarray(got), np.asarray(outputs["library"]), rtol=2e-3, atol=2e-3, err_msg=name)
    for setup, run in candidates.values():  # warm up
        run(setup())
    samples = {name: np.asarray(t) for name, t in timed_rounds(candidates, rounds=rounds).items()}
    others = [name for name in samples if name != "library"]
    paired = {name: float(np.median(samples["library"] / samples[name])) for name in others}
    of_best = {name: float(samples["library"].min() / samples[name].min()) for name in others}
    return {name: t.min() / frames for name, t in samples.items()}, paired, of_best


def nnx_token_time(*, rounds: int) -> tuple[float, float]:
    """Seconds per token of flax's decode cache, and of the library over the same frames."""
    s = Setup(1024, NNX_FRAMES)
    decoder = baselines.nnx_decode_model(s.model, s.snapshot, CAPACITY)
    graphdef, params, cache = nnx.split(decoder, nnx.Param, nnx.Cache)
    cond = baselines.cond_view(s.snapshot)
    h, context, actions = jnp.asarray(s.snapshot.h), jnp.asarray(s.snapshot.frames), s.actions
    decode = jax.jit(functools.partial(baselines.nnx_decode_rollout, graphdef, params), donate_argnums=0)
    decode_run = _blocking(lambda cache: decode(cache, cond, h, context, actions))
    library = _blocking(lambda session: s.rollout(s.params, session, actions))
    copy_cache = lambda: jax.tree.map(jnp.copy, cache)  # noqa: E731
    np.testing.assert_allclose(np.asarray(decode_run(copy_cache())[1]), np.asarray(library(s.session.fork())[1]),
                               rtol=2e-3, atol=2e-3, err_msg="flax nnx decode")
    samples = timed_rounds({"nnx": (copy_cache, decode_run), "library": (s.session.fork, library)}, rounds=rounds)
    tokens = NNX_FRAMES * s.config.tokens
    return min(samples["nnx"]) / tokens, min(samples["library"]) / tokens


def peak_memory(capacity: int, steps: int) -> dict[str, int]:
    """Baseline, session and peak resident bytes of a donated rollout in a fresh process."""
    command = f"exec {shlex.quote(sys.executable)} -m benchmarks._rollout_memory {capacity} {steps}"
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(*, full: bool) -> list[dict[str, Any]]:
    """Rows of step times, ratios against the bars, and the memory figures."""
    print(__doc__.split("\n\n", 1)[1].split("Run:")[0])
    rounds = 160 if full else 80  # for 16-frame rollouts (a time is the best of its rounds); fewer for longer ones
    rows: list[dict[str, Any]] = []
    cases = [(0, 256), (1024, 16), (4096, 16)] + ([(16384, 16)] if full else [])
    for prefix, frames in cases:
        case = f"{frames} frames from empty" if prefix == 0 else f"{frames} frames after {prefix} tokens"
        # A 256-frame round takes ~0.2 s a side, so 24 of them are cheap; the best of 9 moved by 5% between runs.
        times, ratios, of_best = step_times(prefix, frames, rounds=max(24, rounds * 16 // frames))
        for name, seconds in times.items():
            rows.append({"measure": f"step, {case}: {name} (ms/frame)", "value": seconds * 1e3,
                         "figure": "rollout_step", "implementation": name, "case": case})
        for name, ratio in ratios.items():
            bar = "library_over_raw" if name == "raw JAX" else "library_over_torch"
            rows.append(_ratio(f"library / {name}, {case}", ratio, bar))
            rows.append({"measure": f"ratio of the best times, library / {name}, {case}", "value": of_best[name]})
    nnx_token, library_token = nnx_token_time(rounds=max(3, rounds // 4))
    tokens = WorldModelConfig().tokens
    rows += [
        {"measure": "flax nnx decode cache, one token per call (ms/token)", "value": nnx_token * 1e3},
        {"measure": f"step, {NNX_FRAMES} frames after 1024 tokens: flax nnx decode, {tokens} calls (ms/frame)",
         "value": nnx_token * tokens * 1e3, "figure": "rollout_step", "implementation": "flax nnx decode",
         "case": "flax nnx decode: any prefix"},
        {"measure": f"library, same frames, {tokens} tokens per step (ms/token)", "value": library_token * 1e3},
        _ratio("library / flax nnx decode, per token", library_token / nnx_token, "library_over_nnx_per_token"),
    ]
    memory = peak_memory(MEMORY_CAPACITY, 64)
    bound = memory["session"] + memory["baseline"]
    rows += [
        {"measure": "memory: baseline resident before allocating (MiB)", "value": memory["baseline"] / 2**20,
         "figure": "rollout_memory", "part": "baseline"},
        {"measure": "memory: session, logical bytes (MiB)", "value": memory["session"] / 2**20,
         "figure": "rollout_memory", "part": "session"},
        {"measure": "memory: peak resident of the donated rollout (MiB)", "value": memory["peak"] / 2**20,
         "figure": "rollout_memory", "part": "peak"},
        _ratio("peak / (session + baseline)", memory["peak"] / bound, "peak_over_session_plus_baseline"),
    ]
    return rows


def _ratio(measure: str, value: float, bar: str) -> dict[str, Any]:
    return {"measure": f"ratio {measure}", "value": value, "bar": f"≤ {BARS[bar]}", "holds": value <= BARS[bar]}


if __name__ == "__main__":
    cli("rollout", run, __doc__)
