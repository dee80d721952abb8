"""A world model rolls out hundreds of latent frames in one jitted, donated ``lax.scan``.

The session (per-block K/V in a sink + window ring, conditioning K/V written
once, a recurrent carry, the recent frames) is donated to the jitted rollout,
so every write happens in place: the rollout's memory stays at the session's
size however long it runs.  A progress bar follows the frames as the scan
runs: each step calls back to the host (``jax.debug.callback``, ordered),
which also timestamps the steps, so the progress costs one host call per
frame and the rollout stays one compiled program.

With ``--quantize int8`` the K/V caches are stored as int8 (a scale per row
and head): the demo prints their bytes against float32 and how far the
generated frames drift from the float32 rollout of the same model.

Run:  python examples/world_model_rollout.py [--steps 256] [--window 512 | --capacity 8192]
      [--quantize int8] [--seed 0] [--params world_model.msgpack] [--out out/rollout]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from tqdm import tqdm

import jax_session_state as jss

from world_model import (
    STEPS_PER_ITERATION,
    WorldModel,
    WorldModelConfig,
    kv_names,
    load_params,
    make_session,
    moving_patterns,
    rollout,
    start_session,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=256, help="frames to generate (16 tokens each)")
    p.add_argument("--window", type=int, default=512, help="ring mode: tokens each query sees besides the sinks")
    p.add_argument("--capacity", type=int, default=None, help="append mode: tokens the K/V caches hold")
    p.add_argument("--quantize", choices=["int8", "fp8"], default=None,
                   help="store the K/V caches quantized and compare the frames with float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params", type=Path, default=None, help="weights saved by train_world_model.py")
    p.add_argument("--out", type=Path, default=Path("out/rollout"), help="folder for rollout.png")
    args = p.parse_args()
    tokens = WorldModelConfig().tokens
    if args.capacity is not None and args.steps * tokens > args.capacity:
        p.error(f"--steps {args.steps} writes {args.steps * tokens} tokens: more than --capacity {args.capacity}.")
    return args


class Progress:
    """Host side of the per-step callback: a tqdm bar and a timestamp per step."""

    def __init__(self, steps: int):
        self.steps = steps
        self.bar: tqdm | None = None
        self.times = np.zeros(steps)
        self.tokens = np.zeros(steps, np.int64)

    def start(self) -> float:
        """Opens the bar (after compiling); returns the start time."""
        self.bar = tqdm(total=self.steps, unit="frame", desc="rollout")
        return time.perf_counter()

    def __call__(self, index: np.ndarray, lengths: np.ndarray) -> None:
        self.times[int(index)] = time.perf_counter()
        self.tokens[int(index)] = int(lengths[0])
        self.bar.update(1)


def frame_ms(start: float, times: np.ndarray, steps_per_iteration: int = STEPS_PER_ITERATION) -> np.ndarray:
    """Milliseconds per frame from the callbacks' timestamps, each the mean over one iteration of the loop.

    The compiled loop runs ``steps_per_iteration`` steps per iteration and
    their callbacks reach the host together, so the host sees when an
    iteration ends, not each step: timed step by step, the frames of one
    iteration would read a full iteration and nearly nothing in turn.
    """
    ends = np.append(np.arange(steps_per_iteration - 1, len(times) - 1, steps_per_iteration), len(times) - 1)
    durations = np.diff(np.concatenate([[start], times[ends]])) * 1e3
    frames = np.diff(np.concatenate([[-1], ends]))
    return np.repeat(durations / frames, frames)


def kv_bytes_held(config: WorldModelConfig, tokens: np.ndarray) -> np.ndarray:
    """Bytes of K/V rows that later queries can still see, after each step."""
    held = tokens if config.capacity is not None else np.minimum(tokens, config.sink + config.window)
    row = 2 * config.kv_heads * config.head_dim * 4  # k and v, float32
    return held * row * config.layers


def plot(path: Path, config: WorldModelConfig, session: jss.Session, progress: Progress, step_ms: np.ndarray,
         frames: np.ndarray) -> None:
    """Bytes per device and step time (``frame_ms``) over the rollout, and a strip of generated frames."""
    steps = np.arange(1, len(progress.times) + 1)
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [2, 2, 1.2]})
    for device, nbytes in session.nbytes_by_device().items():
        top.plot(steps, np.full(len(steps), nbytes / 2**20), label=f"session bytes on {device} (allocated)")
    top.plot(steps, kv_bytes_held(config, progress.tokens) / 2**20, label="K/V rows still visible")
    top.set_ylabel("MiB")
    top.set_title("session memory over the rollout")
    top.legend(loc="lower right")
    # Points, not a line: iterations that alternate (one fast, one slow) stay visible as two bands.
    middle.plot(steps, step_ms, ".", ms=3, alpha=0.6)
    p10, p50, p90 = np.percentile(step_ms, [10, 50, 90])
    middle.axhline(step_ms.mean(), color="black", ls="-", lw=1, label=f"mean {step_ms.mean():.2f} ms")
    for value, name, style in ((p10, "p10", ":"), (p50, "median", "--"), (p90, "p90", ":")):
        middle.axhline(value, color="gray", ls=style, lw=1, label=f"{name} {value:.2f} ms")
    middle.set_yscale("log")
    middle.legend(loc="upper right")
    middle.set_ylabel("ms per frame")
    middle.set_xlabel("step (one 16-token frame)")
    middle.set_title(f"step time (host timestamps from the in-scan callback, per {STEPS_PER_ITERATION} steps)")
    shown = np.linspace(0, len(frames) - 1, min(16, len(frames))).astype(int)
    strip = np.concatenate([np.pad(frames[i, 0, :, :, 0], ((0, 0), (0, 1)), constant_values=np.nan) for i in shown], 1)
    bottom.imshow(strip, cmap="viridis")
    bottom.set_title(f"generated frames (channel 0), steps {', '.join(str(i + 1) for i in shown)}", fontsize=8)
    bottom.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_with_float32(graphdef: nnx.GraphDef, params: nnx.State, config: WorldModelConfig, session: jss.Session,
                         frames: np.ndarray, prompt: jax.Array, context: jax.Array, actions: jax.Array) -> None:
    """Rolls the same model out with float32 K/V and prints the bytes saved and how far the frames drift."""
    model = nnx.merge(graphdef, params)
    reference = make_session(dataclasses.replace(config, quantize=None))
    reference = reference.append(prompt=prompt, cond=model.encode(prompt), frames=context)
    run = jax.jit(lambda p, s, a: rollout(nnx.merge(graphdef, p), s, a), donate_argnums=1)
    reference, float_frames = run(params, reference, actions)
    float_frames = np.asarray(float_frames)
    names = kv_names(config)
    quantized_bytes = sum(session[name].nbytes for name in names)
    float_bytes = sum(reference[name].nbytes for name in names)
    drift = np.abs(frames - float_frames)
    print(f"K/V caches: {quantized_bytes:,} bytes as {config.quantize} against {float_bytes:,} as float32 "
          f"({quantized_bytes / float_bytes:.2f}x)")
    print(f"frames against the float32 rollout: max |diff| {drift.max():.2e}, mean {drift.mean():.2e}, "
          f"relative (L2) {np.linalg.norm(frames - float_frames) / np.linalg.norm(float_frames):.2e}")


def main() -> None:
    args = parse_args()
    config = WorldModelConfig(window=args.window, capacity=args.capacity, quantize=args.quantize)
    model = WorldModel(config, rngs=nnx.Rngs(args.seed))
    if args.params is not None:
        load_params(model, args.params)
    key = jax.random.key(args.seed)
    episode, actions = moving_patterns(key, config, args.steps, config.batch)
    prompt = jax.random.normal(jax.random.fold_in(key, 1), (config.batch, config.prompt_tokens, config.d_model))
    session = start_session(model, prompt, episode[: config.context_frames])

    progress = Progress(args.steps)
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def run(params: nnx.State, session: jss.Session, actions: jax.Array):
        return rollout(nnx.merge(graphdef, params), session, actions, on_step=progress)

    compile_start = time.perf_counter()
    compiled = run.lower(params, session, actions).compile()
    print(f"compiled the {args.steps}-step rollout in {time.perf_counter() - compile_start:.1f} s")
    start = progress.start()
    session, frames = compiled(params, session, actions)  # the old session's buffers are reused
    frames = np.asarray(frames)
    elapsed = time.perf_counter() - start
    progress.bar.close()
    jss.check(session)  # raises CapacityError if a write overflowed inside the scan

    tokens = args.steps * config.tokens
    step_ms = frame_ms(start, progress.times)
    p10, p50, p90 = np.percentile(step_ms, [10, 50, 90])
    print(f"{args.steps} frames ({tokens} tokens) in {elapsed:.2f} s: {elapsed / args.steps * 1e3:.2f} ms per frame "
          f"on average; per frame (over each {STEPS_PER_ITERATION}-step iteration) p10 {p10:.2f}, median {p50:.2f}, "
          f"p90 {p90:.2f}, max {step_ms.max():.2f} ms")
    print(f"K/V: {int(session[kv_names(config)[0]].committed[0])} tokens written per block, "
          + (f"capacity {config.capacity}" if config.capacity else f"sink {config.sink} + window {config.window} kept"))
    print(jss.summary(session))
    if args.quantize is not None:
        compare_with_float32(graphdef, params, config, session, frames, prompt, episode[: config.context_frames],
                             actions)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rollout.png"
    plot(path, config, session, progress, step_ms, frames)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
