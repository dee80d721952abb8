"""A Genie-style MaskGIT dynamics model whose temporal K/V live in a session, against recomputing the context.

A small flax nnx model of axial transformer blocks (Genie, Jasmine) predicts
the next frame of discrete tokens from the frames before it and an action:

- spatial attention runs within a frame, over its ``P`` positions
  (bidirectional); temporal attention runs across frames at each position
  (causal), so its K/V are kept per spatial position: each block's
  ``KVCache`` has the batch shape ``(batch, positions)``, one frame a row per step;
- a frame is decoded MaskGIT-style: all its tokens masked, then ``steps``
  passes that each unmask the most confident ones (greedy); every pass
  *stages* the frame's temporal K/V (replacing the last pass's) and the
  finished frame's K/V are *committed* by one more pass: one jitted,
  donated step per frame, whose cost does not grow with the rollout;
- the same model without a session recomputes every frame of its context at
  every pass (as Jasmine's sampler does, over a buffer of the rollout's
  length): the example times both and checks that they decode the same tokens.

The scene is a coloured sprite on an 8 x 8 grid of tokens moved by the
actions (stay, up, down, left, right, round the edges); the model is fitted
to it with optax for a few seconds before the rollout.

Run:  python examples/genie_dynamics.py [--frames 16] [--train-steps 200] [--out out/genie_dynamics]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_session_state as jss

from fitting import fit

MOVES = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]])
"""The actions' moves (row, column): stay, up, down, left, right."""


@dataclasses.dataclass(frozen=True)
class GenieConfig:
    """Sizes of the dynamics model and of its rollout.

    Attributes:
      side: the frame is ``side x side`` token positions.
      vocab: token values (0 is the background; the mask token is ``vocab``).
      d_model: width of the residual stream.
      heads: attention heads (``d_model // heads`` each).
      layers: axial blocks (spatial, then temporal attention), one ``KVCache`` each.
      max_frames: frames a rollout holds (the cache's capacity, and the
        recomputing sampler's buffer), prompt included.
      steps: MaskGIT passes per frame.
      batch: rollouts side by side.
    """

    side: int = 8
    vocab: int = 4
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    max_frames: int = 17
    steps: int = 4
    batch: int = 1

    @property
    def positions(self) -> int:
        """Token positions per frame, ``P``."""
        return self.side * self.side

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.heads


# ------------------------------------------------------------------ the scene
@functools.partial(jax.jit, static_argnums=(1, 2))
def sprite_scene(key: jax.Array, config: GenieConfig, frames: int) -> tuple[jax.Array, jax.Array]:
    """A 2 x 2 sprite of a random colour moved by random actions.

    Returns:
      ``Int[Array, "batch frames P"]`` tokens and ``Int[Array, "batch frames"]``
      actions (action ``t`` moved frame ``t - 1`` to frame ``t``; action 0 of
      the first frame is a stay).
    """
    side = config.side
    k_colour, k_start, k_act = jax.random.split(key, 3)
    colour = jax.random.randint(k_colour, (config.batch,), 1, config.vocab)
    start = jax.random.randint(k_start, (config.batch, 2), 0, side)
    actions = jax.random.randint(k_act, (config.batch, frames), 0, len(MOVES)).at[:, 0].set(0)
    corner = start[:, None] + jnp.cumsum(jnp.asarray(MOVES)[actions], axis=1)  # [batch, frames, 2]
    grid = jnp.arange(side)
    rows = jnp.mod(grid[None, None, :] - corner[..., 0, None], side) < 2
    cols = jnp.mod(grid[None, None, :] - corner[..., 1, None], side) < 2
    inside = rows[..., :, None] & cols[..., None, :]
    tokens = jnp.where(inside, colour[:, None, None, None], 0).astype(jnp.int32)
    return tokens.reshape(config.batch, frames, config.positions), actions


# ------------------------------------------------------------------ the layout
def per_position(x: jax.Array) -> jax.Array:
    """``[B, P, ...]`` -> ``[B, P, 1, ...]``: one frame of every position, a row of the temporal cache each.

    The cache has the batch shape ``(B, P)``: its payloads and queries lead
    with both axes (``[B, P, T, heads, dim]``), so no transpose is needed.
    """
    return x[:, :, None]


def per_frame(x: jax.Array) -> jax.Array:
    """The inverse of :func:`per_position`."""
    return x[:, :, 0]


# ------------------------------------------------------------------ the model
def rotate(x: jax.Array, frame_index: jax.Array) -> jax.Array:
    """Rotary embedding of the frame index (broadcast over ``x``'s leading axes) on ``x`` ``[..., heads, d]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / 10.0 ** (jnp.arange(half, dtype=x.dtype) / half)
    angle = jnp.asarray(frame_index, x.dtype)[..., None, None] * freq
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle), a * jnp.sin(angle) + b * jnp.cos(angle)], -1)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Softmax attention ``[..., T, heads, d]`` over ``[..., S, heads, d]``; ``mask`` ``[T, S]``."""
    scores = jnp.einsum("...thd,...shd->...hts", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("...hts,...shd->...thd", jax.nn.softmax(scores, axis=-1), v)


class AxialBlock(nnx.Module):
    """Spatial attention within the frame, temporal attention across frames at each position, an MLP."""

    def __init__(self, c: GenieConfig, rngs: nnx.Rngs):
        self.norm_space = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.space = nnx.LinearGeneral(c.d_model, (3, c.heads, c.head_dim), use_bias=False, rngs=rngs)
        self.space_out = nnx.LinearGeneral((c.heads, c.head_dim), c.d_model, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.norm_time = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.time = nnx.LinearGeneral(c.d_model, (3, c.heads, c.head_dim), use_bias=False, rngs=rngs)
        self.time_out = nnx.LinearGeneral((c.heads, c.head_dim), c.d_model, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.norm_mlp = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(c.d_model, 4 * c.d_model, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * c.d_model, c.d_model, rngs=rngs)

    def spatial(self, x: jax.Array) -> jax.Array:
        """``x`` ``[..., P, d_model]`` after spatial attention (every position of a frame sees every other)."""
        q, k, v = jnp.moveaxis(self.space(self.norm_space(x)), -3, 0)
        return x + self.space_out(dense_attention(q, k, v))

    def temporal_qkv(self, x: jax.Array, frame_index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Temporal ``q, k, v`` ``[..., heads, head_dim]``, ``q`` and ``k`` rotated by the frame index."""
        q, k, v = jnp.moveaxis(self.time(self.norm_time(x)), -3, 0)
        return rotate(q, frame_index), rotate(k, frame_index), v

    def mlp(self, x: jax.Array) -> jax.Array:
        """The MLP with its residual."""
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm_mlp(x))))


class Dynamics(nnx.Module):
    """MaskGIT dynamics: token logits of a frame from its partly masked tokens, its action and the past frames.

    Example:
      >>> config = GenieConfig(layers=1, max_frames=4)
      >>> model = Dynamics(config, rngs=nnx.Rngs(0))
      >>> session = make_session(config)
      >>> tokens = jnp.zeros((1, config.positions), jnp.int32)
      >>> session, logits = model.frame_step(session, tokens, jnp.zeros((1,), jnp.int32), jnp.asarray(0))
      >>> logits.shape, int(session.commit()["time_0"].committed[0])
      ((1, 64, 4), 1)
    """

    def __init__(self, config: GenieConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab + 1, c.d_model, rngs=rngs)  # the last value is the mask token
        self.action = nnx.Embed(len(MOVES), c.d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (c.positions, c.d_model)))
        self.blocks = nnx.List([AxialBlock(c, rngs) for _ in range(c.layers)])
        self.norm_out = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.head = nnx.Linear(c.d_model, c.vocab, rngs=rngs)

    def inputs(self, tokens: jax.Array, actions: jax.Array) -> jax.Array:
        """``[..., P, d_model]`` from tokens ``[..., P]`` and actions ``[...]``."""
        return self.embed(tokens) + self.position[...] + self.action(actions)[..., None, :]

    def frame_step(self, session: jss.Session, tokens: jax.Array, action: jax.Array,
                   frame_index: jax.Array) -> tuple[jss.Session, jax.Array]:
        """One pass over one frame: stage its temporal K/V in every block's cache, return its logits.

        Args:
          session: what it staged before is replaced.
          tokens: ``Int[Array, "B P"]`` the frame, masked where undecided; ``action``: ``Int[Array, "B"]``.
          frame_index: the frame's index in the rollout (a scalar).

        Returns:
          The session with the frame's K/V staged, and ``Float[Array, "B P vocab"]`` logits.
        """
        x = self.inputs(tokens, action)
        for layer, block in enumerate(self.blocks):
            x = block.spatial(x)
            q, k, v = (per_position(a) for a in block.temporal_qkv(x, frame_index))
            session = session.stage(**{f"time_{layer}": jss.KVChunk(k, v)})
            x = x + block.time_out(per_frame(jss.attend(q, session.view()[f"time_{layer}"])))
            x = block.mlp(x)
        return session, self.head(self.norm_out(x))

    def dense(self, tokens: jax.Array, actions: jax.Array) -> jax.Array:
        """Logits ``[B, F, P, vocab]`` of every frame of ``tokens`` ``[B, F, P]``, each seeing the frames before it."""
        F = tokens.shape[1]
        x = self.inputs(tokens, actions)
        causal = jnp.tril(jnp.ones((F, F), bool))
        for block in self.blocks:
            x = block.spatial(x)
            q, k, v = (jnp.swapaxes(a, 1, 2) for a in block.temporal_qkv(x, jnp.arange(F)[:, None]))  # [B, P, F, ..]
            x = x + block.time_out(jnp.swapaxes(dense_attention(q, k, v, causal), 1, 2))
            x = block.mlp(x)
        return self.head(self.norm_out(x))


# ------------------------------------------------------------------ decoding
def make_session(config: GenieConfig) -> jss.Session:
    """The empty session: every block's temporal K/V, one row per (rollout, position), one slot a frame."""
    return jss.Session(objects={
        f"time_{layer}": jss.KVCache.allocate(batch=(config.batch, config.positions), kv_heads=config.heads,
                                              head_dim=config.head_dim, capacity=config.max_frames)
        for layer in range(config.layers)
    })


def unmask(tokens: jax.Array, logits: jax.Array, step: int, config: GenieConfig) -> jax.Array:
    """MaskGIT's greedy pass: the masked positions fill with their argmax, the most confident first.

    After pass ``step`` of ``steps`` a cosine schedule leaves ``P * cos(pi/2 * (step+1)/steps)`` masked.
    """
    mask_token = config.vocab
    masked = tokens == mask_token
    confidence = jnp.where(masked, jax.nn.softmax(logits, axis=-1).max(axis=-1), -jnp.inf)
    still_masked = math.floor(config.positions * math.cos(math.pi / 2 * (step + 1) / config.steps))
    reveal = jnp.sum(masked, axis=-1, keepdims=True) - still_masked
    rank = jnp.argsort(jnp.argsort(-confidence, axis=-1), axis=-1)
    return jnp.where(masked & (rank < reveal), jnp.argmax(logits, axis=-1).astype(tokens.dtype), tokens)


def decode_frame(model: Dynamics, session: jss.Session, action: jax.Array,
                 frame_index: jax.Array) -> tuple[jss.Session, jax.Array]:
    """One frame with the session: ``steps`` MaskGIT passes (stage, attend), then the frame's K/V committed."""
    c = model.config
    tokens = jnp.full((action.shape[0], c.positions), c.vocab, jnp.int32)
    for step in range(c.steps):
        session, logits = model.frame_step(session, tokens, action, frame_index)
        tokens = unmask(tokens, logits, step, c)
    session, _ = model.frame_step(session, tokens, action, frame_index)
    return session.commit(), tokens


def prompt_session(model: Dynamics, prompt: jax.Array, actions: jax.Array) -> jss.Session:
    """A session holding the temporal K/V of the prompt frames ``[B, F, P]`` (actions ``[B, F]``)."""
    session = make_session(model.config)
    for index in range(prompt.shape[1]):
        session, _ = model.frame_step(session, prompt[:, index], actions[:, index], jnp.asarray(index))
        session = session.commit()
    return session


def rollout_cached(model: Dynamics, prompt: jax.Array, actions: jax.Array, *, on_frame=None):
    """Decodes a frame per action after the prompt with the session, one jitted, donated step per frame.

    Args:
      prompt: ``Int[Array, "B F P"]``; ``actions``: ``Int[Array, "B frames"]``, the first ``F`` the prompt's.
      on_frame: called with each frame's index once it is decoded, or None.

    Returns:
      ``Int[Array, "B frames P"]`` (the prompt, then the decoded frames) and the seconds of every decoded frame.
    """
    graphdef, params = nnx.split(model)
    F = prompt.shape[1]
    session = jax.jit(lambda p, x, a: prompt_session(nnx.merge(graphdef, p), x, a))(params, prompt, actions[:, :F])

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, session, action, index):
        return decode_frame(nnx.merge(graphdef, params), session, action, index)

    frames, seconds = [prompt], []
    for index in range(F, actions.shape[1]):
        start = time.perf_counter()
        session, tokens = step(params, session, actions[:, index], jnp.asarray(index))
        frames.append(tokens.block_until_ready()[:, None])
        seconds.append(time.perf_counter() - start)
        if on_frame is not None:
            on_frame(index)
    jss.check(session)
    return jnp.concatenate(frames, axis=1), np.asarray(seconds)


def recompute_frame(model: Dynamics, buffer: jax.Array, actions: jax.Array,
                    index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One frame without a session: every MaskGIT pass runs the model over the whole buffer.

    Args:
      buffer: ``Int[Array, "B max_frames P"]`` the frames so far (later frames are never seen: causal).
      actions: ``Int[Array, "B max_frames"]``.
      index: the frame to decode.

    Returns:
      The buffer with the frame written, and the frame ``[B, P]``.
    """
    c = model.config
    tokens = jnp.full((buffer.shape[0], c.positions), c.vocab, jnp.int32)
    for step in range(c.steps):
        buffer = jax.lax.dynamic_update_slice_in_dim(buffer, tokens[:, None], index, axis=1)
        logits = jax.lax.dynamic_index_in_dim(model.dense(buffer, actions), index, 1, keepdims=False)
        tokens = unmask(tokens, logits, step, c)
    return jax.lax.dynamic_update_slice_in_dim(buffer, tokens[:, None], index, axis=1), tokens


def recompute_buffers(config: GenieConfig, prompt: jax.Array, actions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The recomputing sampler's buffers of ``max_frames`` frames: the prompt (the rest masked) and the actions."""
    B, F = prompt.shape[:2]
    buffer = jnp.full((B, config.max_frames, config.positions), config.vocab, jnp.int32).at[:, :F].set(prompt)
    return buffer, jnp.zeros((B, config.max_frames), actions.dtype).at[:, :actions.shape[1]].set(actions)


def rollout_recomputed(model: Dynamics, prompt: jax.Array, actions: jax.Array, *, on_frame=None):
    """:func:`rollout_cached` without a session: every pass recomputes every frame of the rollout's buffer."""
    graphdef, params = nnx.split(model)
    buffer, actions_buffer = recompute_buffers(model.config, prompt, actions)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, buffer, index):
        return recompute_frame(nnx.merge(graphdef, params), buffer, actions_buffer, index)

    seconds = []
    for index in range(prompt.shape[1], actions.shape[1]):
        start = time.perf_counter()
        buffer, tokens = step(params, buffer, jnp.asarray(index))
        tokens.block_until_ready()
        seconds.append(time.perf_counter() - start)
        if on_frame is not None:
            on_frame(index)
    return buffer[:, :actions.shape[1]], np.asarray(seconds)


# ------------------------------------------------------------------ training
def train(model: Dynamics, steps: int, clips: int, key: jax.Array, *, on_step=None) -> list[float]:
    """Fits the model to sprite clips with optax: MaskGIT's loss over randomly masked frames."""
    c = model.config
    if steps == 0:
        return []
    graphdef, _ = nnx.split(model)
    optimizer = optax.adamw(optax.cosine_onecycle_schedule(steps, 3e-3), weight_decay=1e-4)
    batch_config = dataclasses.replace(c, batch=clips)

    def loss_fn(params, key):
        tokens, actions = sprite_scene(key, batch_config, c.max_frames)
        k_ratio, k_mask = jax.random.split(jax.random.fold_in(key, 1))
        ratio = jnp.cos(math.pi / 2 * jax.random.uniform(k_ratio, (clips, c.max_frames, 1)))
        masked = (jax.random.uniform(k_mask, tokens.shape) < ratio).at[:, 0].set(False)  # the first frame given
        logits = nnx.merge(graphdef, params).dense(jnp.where(masked, c.vocab, tokens), actions)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
        return jnp.sum(losses * masked) / jnp.maximum(masked.sum(), 1)

    return fit(model, loss_fn, optimizer, steps, key, on_step=on_step)


# ------------------------------------------------------------------ the demo
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=16, help="frames to decode after the prompt frame")
    p.add_argument("--train-steps", type=int, default=200, help="optax steps fitting the model to the scene")
    p.add_argument("--clips", type=int, default=8, help="training clips per step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/genie_dynamics"), help="folder for genie_dynamics.png")
    return p.parse_args()


def plot(path: Path, truth: np.ndarray, decoded: np.ndarray, cached_ms: np.ndarray, recomputed_ms: np.ndarray,
         config: GenieConfig) -> None:
    """The scene and the decoded frames, and the time of every frame both ways."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = min(12, truth.shape[0])
    fig = plt.figure(figsize=(12, 5.5))
    grid = fig.add_gridspec(3, shown, height_ratios=[1, 1, 2.2])
    for row, frames, name in ((0, truth, "scene"), (1, decoded, "decoded")):
        for i in range(shown):
            ax = fig.add_subplot(grid[row, i])
            ax.imshow(frames[i].reshape(config.side, config.side), cmap="tab10", vmin=0, vmax=9)
            ax.set_xticks([]), ax.set_yticks([])
            if i == 0:
                ax.set_ylabel(name, fontsize=7)
            if row == 0:
                ax.set_title(f"frame {i}", fontsize=7)
    ax = fig.add_subplot(grid[2, :])
    first = truth.shape[0] - len(cached_ms)
    frames = np.arange(first, truth.shape[0])
    ax.plot(frames, recomputed_ms, ".-", label="recomputing the context")
    ax.plot(frames, cached_ms, ".-", label="temporal K/V in a session")
    ax.set_yscale("log")
    ax.set_xlabel("frame")
    ax.set_ylabel("ms per frame")
    ax.set_title(f"{config.steps} MaskGIT passes per frame, {config.positions} positions", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    from tqdm import tqdm

    args = parse_args()
    config = GenieConfig(layers=args.layers, d_model=args.d_model, max_frames=args.frames + 1)
    key = jax.random.key(args.seed)
    model = nnx.jit(lambda: Dynamics(config, rngs=nnx.Rngs(args.seed)))()  # one compiled init, not op by op
    with tqdm(total=args.train_steps, unit="step", desc="fitting to the scene") as bar:
        losses = train(model, args.train_steps, args.clips, jax.random.fold_in(key, 1), on_step=lambda i: bar.update())
    tail = max(1, len(losses) // 10)
    if losses:
        print(f"MaskGIT loss: first {np.mean(losses[:tail]):.3f}, last {np.mean(losses[-tail:]):.3f}")

    truth, actions = sprite_scene(jax.random.fold_in(key, 2), config, config.max_frames)
    runs = {}
    for name, rollout in (("session", rollout_cached), ("recompute", rollout_recomputed)):
        with tqdm(total=args.frames, unit="frame", desc=name) as bar:
            runs[name] = rollout(model, truth[:, :1], actions, on_frame=lambda i: bar.update())
    (cached, cached_s), (recomputed, recomputed_s) = runs["session"], runs["recompute"]
    cached_ms, recomputed_ms = cached_s[1:] * 1e3, recomputed_s[1:] * 1e3  # the first compiles
    agree = bool(np.array_equal(np.asarray(cached), np.asarray(recomputed)))
    print(f"per frame after the first: session median {np.median(cached_ms):.2f} ms, recomputing median "
          f"{np.median(recomputed_ms):.2f} ms (at the last frame {cached_ms[-1]:.2f} vs {recomputed_ms[-1]:.2f} ms)")
    print(f"tokens agree: {agree}; decoded tokens equal to the scene's: "
          f"{float(np.mean(np.asarray(cached)[:, 1:] == np.asarray(truth)[:, 1:])):.3f}")
    assert agree, "the session and the recomputing sampler decoded different tokens"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "genie_dynamics.png"
    plot(path, np.asarray(truth[0]), np.asarray(cached[0]), cached_ms, recomputed_ms, config)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
