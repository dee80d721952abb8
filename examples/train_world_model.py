"""Trains the world model on moving patterns by truncated back-propagation through time.

Each episode is a batch of synthetic sequences (a periodic pattern moved by
random actions).  The model is trained window by window: within a window of
``--window-frames`` frames the loss back-propagates through every step,
including the K/V rows the window wrote into the session and the recurrent
carry; between windows the session (the K/V ring and the carry) is carried
forward as data, with ``jax.lax.stop_gradient`` marking the truncation, so
the next window attends to the history without differentiating through it.
One jitted call trains a whole episode (a ``lax.scan`` over its windows, one
optax update per window).

Run:  python examples/train_world_model.py [--episodes 50] [--out out/train]
Then: python examples/world_model_rollout.py --params out/train/world_model.msgpack
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jax_session_state as jss

from world_model import WorldModel, WorldModelConfig, moving_patterns, rollout, save_params, start_session


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=50, help="batches of fresh sequences")
    p.add_argument("--windows", type=int, default=4, help="training windows per episode")
    p.add_argument("--window-frames", type=int, default=8, help="frames per window (the truncation length)")
    p.add_argument("--batch", type=int, default=8, help="sequences per episode")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/train"), help="folder for loss.png, metrics.json, weights")
    return p.parse_args()


def window_loss(model: WorldModel, session: jss.Session, actions: jax.Array, targets: jax.Array):
    """Mean squared error of the next-frame predictions over one window, teacher-forced.

    Returns:
      ``(loss, session)``: the session after the window, with the observed
      frames (not the predictions) written as context.
    """
    session, predictions = rollout(model, session, actions, observed=targets)
    return jnp.mean((predictions - targets) ** 2), session


def make_train_episode(graphdef: nnx.GraphDef, config: WorldModelConfig, optimizer: optax.GradientTransformation,
                       windows: int, window_frames: int):
    """The jitted function that trains on one fresh episode; returns the loss of every window."""
    steps = windows * window_frames

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_episode(params: nnx.State, opt_state: optax.OptState, key: jax.Array):
        frames, actions = moving_patterns(key, config, steps, config.batch)
        context, targets = frames[: config.context_frames], frames[config.context_frames:]
        prompt = jax.random.normal(jax.random.fold_in(key, 1), (config.batch, config.prompt_tokens, config.d_model))
        session = start_session(nnx.merge(graphdef, params), prompt, context)
        by_window = lambda x: x.reshape(windows, window_frames, *x.shape[1:])  # noqa: E731

        def train_window(carry, xs):
            params, opt_state, session = carry
            session = jax.lax.stop_gradient(session)  # the truncation: history enters as data
            loss_fn = lambda p: window_loss(nnx.merge(graphdef, p), session, *xs)  # noqa: E731
            (loss, session), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state, session), loss

        (params, opt_state, session), losses = jax.lax.scan(
            train_window, (params, opt_state, session), (by_window(actions), by_window(targets))
        )
        # Predicting "nothing moves" (the last frame again): the loss to beat.
        copy_loss = jnp.mean((targets - frames[config.context_frames - 1:-1]) ** 2)
        return params, opt_state, losses, copy_loss

    return train_episode


def plot(path: Path, losses: np.ndarray, copy_loss: float, windows: int) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8, label="next-frame MSE per training window")
    if len(losses) >= 2 * windows:
        smooth = np.convolve(losses, np.ones(2 * windows) / (2 * windows), mode="valid")
        ax.plot(np.arange(2 * windows, len(losses) + 1), smooth, label="moving average")
    ax.axhline(copy_loss, color="gray", ls="--", label=f"repeat the last frame ({copy_loss:.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step (one window)")
    ax.set_ylabel("MSE")
    ax.set_title("truncated BPTT, session carried across windows")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    # The K/V ring keeps one window of history besides the sinks, so a window's
    # first frames attend to the previous window's rows.
    config = dataclasses.replace(
        WorldModelConfig(), batch=args.batch, window=args.window_frames * WorldModelConfig().tokens
    )
    model = WorldModel(config, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr))
    opt_state = optimizer.init(params)
    train_episode = make_train_episode(graphdef, config, optimizer, args.windows, args.window_frames)

    losses, copy_losses = [], []
    bar = tqdm(range(args.episodes), unit="episode", desc="training")
    for episode in bar:
        key = jax.random.key(args.seed * 100_003 + episode)
        params, opt_state, episode_losses, copy_loss = train_episode(params, opt_state, key)
        losses += np.asarray(episode_losses).tolist()
        copy_losses.append(float(copy_loss))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()

    first, last = np.mean(losses[: args.windows]), np.mean(losses[-args.windows:])
    print(f"loss: first episode {first:.4f}, last episode {last:.4f} ({first / last:.1f}x lower); "
          f"repeating the last frame scores {np.mean(copy_losses):.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(args.out / "loss.png", np.asarray(losses), float(np.mean(copy_losses)), args.windows)
    metrics = {"losses": losses, "copy_last_frame_loss": float(np.mean(copy_losses))}
    (args.out / "metrics.json").write_text(json.dumps(metrics))
    nnx.update(model, params)
    save_params(model, args.out / "world_model.msgpack")
    print(f"wrote {args.out / 'loss.png'}, {args.out / 'metrics.json'}, {args.out / 'world_model.msgpack'}")


if __name__ == "__main__":
    main()
