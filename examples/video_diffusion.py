"""Self-Forcing-style autoregressive video diffusion: frames denoised in a few steps over a rolling K/V cache.

A small flax nnx model generates a video of moving shapes frame by frame,
the way Self-Forcing and CausVid generate over Wan:

- a latent frame is ``N`` tokens (one per patch); its tokens see each other
  and every earlier frame in the window (block-causal);
- each block keeps its K/V in a ``KVCache`` allocated in frames: a rolling
  cache of ``window_frames`` frames, the first ``sink_frames`` kept for ever
  (Self-Forcing's ``local_attn_size`` and ``sink_size``);
- a frame is denoised in ``S`` steps: each step *stages* the noisy frame's K/V
  (replacing the last step's), attends and predicts the clean frame; then the
  clean frame runs once more at noise level 0 and its K/V are *committed*:
  all of it one jitted step with the sessions donated, written in place;
- classifier-free guidance runs two streams, conditioned on the shape and
  unconditioned, forked (``Session.fork``) from one history: the prompt
  frames, encoded once.

The model is fitted with optax for a few seconds to the synthetic scene
(a disc or a square rolling across the frame), teacher-forced over whole clips with
the same block-causal, rolling mask in one dense pass (``Model.dense``), the
pass that :func:`sample_without_cache` recomputes for every step.

Run:  python examples/video_diffusion.py [--frames 24] [--train-steps 600] [--out out/video_diffusion]
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

NULL_LABEL = 0
"""The label of the unconditioned stream and of the prompt frames (shapes are 1: disc, 2: square)."""


@dataclasses.dataclass(frozen=True)
class VideoConfig:
    """Sizes of the model, its scene and its rolling cache.

    Attributes:
      size: side of a square grayscale frame, in pixels.
      patch: side of the square patch that makes one token.
      d_model: width of the residual stream.
      heads: attention heads (``d_model // heads`` each).
      layers: attention blocks, one ``KVCache`` each.
      window_frames: the frames each frame sees, counting the sink frames and
        itself (Self-Forcing's ``local_attn_size``).
      sink_frames: the first frames every frame sees (``sink_size``).
      prompt_frames: true frames the video starts from, encoded once.
      steps: denoising steps per frame.
      guidance: classifier-free guidance scale (1: the conditioned stream alone).
      clip_frames: frames of one training clip.
      dtype: parameters, activations and caches.
    """

    size: int = 16
    patch: int = 4
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    window_frames: int = 4
    sink_frames: int = 1
    prompt_frames: int = 2
    steps: int = 4
    guidance: float = 1.5
    clip_frames: int = 6
    dtype: str = "float32"

    @property
    def tokens(self) -> int:
        """Tokens per frame, ``N``."""
        return (self.size // self.patch) ** 2

    @property
    def token_dim(self) -> int:
        """Pixels per token."""
        return self.patch * self.patch

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.heads

    def noise_levels(self) -> jax.Array:
        """The noise level of each denoising step, from pure noise down: ``[1, 0.75, 0.5, 0.25]`` for 4."""
        return 1.0 - jnp.arange(self.steps, dtype=self.dtype) / self.steps


# ------------------------------------------------------------------ the scene
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def moving_shapes(key: jax.Array, config: VideoConfig, batch: int, frames: int) -> tuple[jax.Array, jax.Array]:
    """Clips of a disc or a square rolling to the right, one patch a frame, round the frame's edges.

    Returns:
      ``Float[Array, "batch frames size size"]`` in ``[-1, 1]`` and the shape
      labels ``Int[Array, "batch"]`` (1: disc, 2: square).
    """
    size, radius = config.size, config.size / 5
    k_label, k_start = jax.random.split(key)
    labels = jax.random.randint(k_label, (batch,), 1, 3)
    start = jax.random.uniform(k_start, (batch, 2), maxval=size)
    x_centre = start[:, 1, None] + config.patch * jnp.arange(frames, dtype=jnp.float32)  # [batch, frames]
    grid = jnp.arange(size, dtype=jnp.float32)
    dy = grid[None, None, :, None] - start[:, 0, None, None, None]
    dx = grid[None, None, None, :] - x_centre[..., None, None]
    dy, dx = (jnp.mod(d + size / 2, size) - size / 2 for d in (dy, dx))  # round the edges (a torus)
    distance = jnp.where(labels[:, None, None, None] == 1, jnp.hypot(dy, dx), jnp.maximum(abs(dy), abs(dx)))
    return (2 * jax.nn.sigmoid(3.0 * (radius - distance)) - 1).astype(config.dtype), labels


def patchify(frames: jax.Array, patch: int) -> jax.Array:
    """``Float[Array, "... size size"]`` -> ``Float[Array, "... tokens patch*patch"]``, row-major patches."""
    *lead, height, width = frames.shape
    x = frames.reshape(*lead, height // patch, patch, width // patch, patch)
    return jnp.swapaxes(x, -3, -2).reshape(*lead, (height // patch) * (width // patch), patch * patch)


def unpatchify(tokens: jax.Array, config: VideoConfig) -> jax.Array:
    """The inverse of :func:`patchify`."""
    side = config.size // config.patch
    x = tokens.reshape(*tokens.shape[:-2], side, side, config.patch, config.patch)
    return jnp.swapaxes(x, -3, -2).reshape(*tokens.shape[:-2], config.size, config.size)


# ------------------------------------------------------------------ the model
def rotate(x: jax.Array, position: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of ``position`` (``[T]``) on ``x`` ``[B, T, heads, d]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / base ** (jnp.arange(half, dtype=x.dtype) / half)
    angle = position.astype(x.dtype)[:, None] * freq  # [T, half]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rope(x: jax.Array, frame_index: jax.Array, side: int) -> jax.Array:
    """3-D rotary embedding, as Wan's: half of each head by the frame index, a quarter each by row and column.

    ``x`` is ``[B, T, heads, head_dim]``, ``T`` whole frames of ``side x side``
    tokens, ``frame_index`` ``[T]``.  Stored keys are rotated already, so a
    cached key and a recomputed one are the same numbers.
    """
    d = x.shape[-1]
    token = jnp.arange(x.shape[1]) % (side * side)
    return jnp.concatenate([rotate(x[..., : d // 2], frame_index, 10.0),
                            rotate(x[..., d // 2: 3 * d // 4], token // side, 10.0),
                            rotate(x[..., 3 * d // 4:], token % side, 10.0)], axis=-1)


def noise_embedding(t: jax.Array, width: int) -> jax.Array:
    """Sinusoidal features ``[..., width]`` of noise levels ``t`` in ``[0, 1]``."""
    freq = 2.0 ** jnp.arange(width // 2, dtype=t.dtype)
    angle = math.pi * t[..., None] * freq
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


class Block(nnx.Module):
    """Self-attention (block-causal over the frames in the window) and an MLP, pre-norm."""

    def __init__(self, c: VideoConfig, rngs: nnx.Rngs):
        kw = dict(param_dtype=c.dtype, dtype=c.dtype, rngs=rngs)
        self.side = c.size // c.patch
        self.norm_attn = nnx.RMSNorm(c.d_model, **kw)
        self.qkv = nnx.LinearGeneral(c.d_model, (3, c.heads, c.head_dim), use_bias=False, **kw)
        self.out = nnx.LinearGeneral((c.heads, c.head_dim), c.d_model, axis=(-2, -1), use_bias=False, **kw)
        self.norm_mlp = nnx.RMSNorm(c.d_model, **kw)
        self.mlp_in = nnx.Linear(c.d_model, 4 * c.d_model, **kw)
        self.mlp_out = nnx.Linear(4 * c.d_model, c.d_model, **kw)

    def project(self, x: jax.Array, frame_index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q, k, v`` ``[B, T, heads, head_dim]``, ``q`` and ``k`` rotated by their frame, row and column."""
        q, k, v = jnp.moveaxis(self.qkv(self.norm_attn(x)), -3, 0)
        return rope(q, frame_index, self.side), rope(k, frame_index, self.side), v

    def finish(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        """The attention's output projection and the MLP, each with its residual."""
        x = x + self.out(attended)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm_mlp(x))))


class Model(nnx.Module):
    """Predicts a clean frame from a noisy one, its noise level, a label and the frames before it.

    Example:
      >>> config = VideoConfig(layers=1)
      >>> model = Model(config, rngs=nnx.Rngs(0))
      >>> session = make_session(config, batch=1)
      >>> sessions, frame = denoise_frame(model, (session,), jnp.array([1]), jnp.asarray(0),
      ...                                 jax.random.key(0), guidance=1.0)
      >>> frame.shape, int(sessions[0]["kv_0"].committed[0])
      ((1, 16, 16), 16)
    """

    def __init__(self, config: VideoConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(param_dtype=c.dtype, dtype=c.dtype, rngs=rngs)
        self.embed = nnx.Linear(c.token_dim, c.d_model, **kw)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (c.tokens, c.d_model), c.dtype))
        self.noise = nnx.Linear(32, c.d_model, **kw)
        self.label = nnx.Embed(3, c.d_model, param_dtype=c.dtype, dtype=c.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.norm_out = nnx.RMSNorm(c.d_model, **kw)
        self.head = nnx.Linear(c.d_model, c.token_dim, **kw)

    def inputs(self, frames: jax.Array, t: jax.Array, labels: jax.Array) -> jax.Array:
        """Tokens ``[B, F, N, d_model]`` of frames ``[B, F, size, size]`` at noise levels and labels ``[B, F]``."""
        x = self.embed(patchify(frames, self.config.patch)) + self.position[...]
        return x + (self.noise(noise_embedding(t, 32)) + self.label(labels))[:, :, None]

    def outputs(self, x: jax.Array) -> jax.Array:
        """Clean frames ``[B, F, size, size]`` from tokens ``[B, F, N, d_model]``."""
        return unpatchify(self.head(self.norm_out(x)), self.config)

    # -- with the session: one frame at a time
    def frame_step(self, session: jss.Session, frame: jax.Array, t: jax.Array, label: jax.Array,
                   frame_index: jax.Array) -> tuple[jss.Session, jax.Array]:
        """One pass of one frame: stage its K/V in every block's cache, attend, predict the clean frame.

        Args:
          session: the stream's session; what it staged before is replaced.
          frame: ``Float[Array, "B size size"]`` the frame at noise level ``t`` (``[B]``).
          label: ``Int[Array, "B"]``.
          frame_index: the frame's index in the video (a scalar).

        Returns:
          The session with the frame's K/V staged, and the predicted clean frame.
        """
        x = self.inputs(frame[:, None], t[:, None], label[:, None])[:, 0]
        index = jnp.full((x.shape[1],), frame_index)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.project(x, index)
            session = session.stage(**{f"kv_{layer}": jss.KVChunk(k, v)})
            x = block.finish(x, jss.attend(q, session.view()[f"kv_{layer}"]))
        return session, self.outputs(x[:, None])[:, 0]

    # -- without the session: a whole clip in one dense pass
    def dense(self, clean: jax.Array, clean_index: jax.Array, clean_labels: jax.Array, noisy: jax.Array,
              t: jax.Array, noisy_labels: jax.Array, noisy_index: jax.Array) -> jax.Array:
        """Clean-frame predictions for noisy frames, with every clean frame before them recomputed.

        The sequence holds clean frames (noise level 0) at the increasing
        frame indices ``clean_index`` and noisy frames at ``noisy_index``; a
        clean frame sees the clean frames of its window up to itself, a noisy
        frame the clean frames of its window before it and itself: the mask
        the cache gives.

        Args:
          clean: ``Float[Array, "B F size size"]`` at ``Int[Array, "F"]`` indices; ``clean_labels`` ``[B, F]``.
          noisy: ``Float[Array, "B G size size"]`` at noise levels ``t`` ``[B, G]``, labels ``[B, G]``.
          noisy_index: ``Int[Array, "G"]`` the frame index of each noisy frame.

        Returns:
          ``Float[Array, "B G size size"]``: the predicted clean frames.
        """
        c, (B, F), G = self.config, clean.shape[:2], noisy.shape[1]
        x = jnp.concatenate([self.inputs(clean, jnp.zeros((B, F), clean.dtype), clean_labels),
                             self.inputs(noisy, t, noisy_labels)], axis=1).reshape(B, (F + G) * c.tokens, c.d_model)
        frame_of = jnp.repeat(jnp.concatenate([clean_index, noisy_index]), c.tokens)
        noisy_of = jnp.repeat(jnp.arange(F + G) >= F, c.tokens)
        block_of = jnp.repeat(jnp.arange(F + G), c.tokens)
        qf, kf = frame_of[:, None], frame_of[None, :]
        in_window = (kf < c.sink_frames) | (qf - kf < c.window_frames - c.sink_frames)
        sees_clean = ~noisy_of[None, :] & in_window & jnp.where(noisy_of[:, None], kf < qf, kf <= qf)
        mask = sees_clean | (noisy_of[:, None] & (block_of[:, None] == block_of[None, :]))
        for block in self.blocks:
            q, k, v = block.project(x, frame_of)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c.head_dim)
            weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
            x = block.finish(x, jnp.einsum("bhqk,bkhd->bqhd", weights, v))
        return self.outputs(x.reshape(B, F + G, c.tokens, c.d_model)[:, F:])


# ------------------------------------------------------------------ sessions and sampling
def make_session(config: VideoConfig, batch: int) -> jss.Session:
    """One stream's empty session: a rolling cache per block, counted in frames."""
    return jss.Session(objects={
        f"kv_{layer}": jss.KVCache.allocate(
            batch=batch, kv_heads=config.heads, head_dim=config.head_dim, dtype=config.dtype,
            frame=config.tokens, window_frames=config.window_frames, sink_frames=config.sink_frames,
        )
        for layer in range(config.layers)
    })


def encode_prompt(model: Model, session: jss.Session, frames: jax.Array) -> jss.Session:
    """Commits the clean K/V of the prompt frames ``[B, P, size, size]`` (unconditioned), one frame a pass."""
    B = frames.shape[0]
    for index in range(frames.shape[1]):
        session, _ = model.frame_step(session, frames[:, index], jnp.zeros((B,), frames.dtype),
                                      jnp.full((B,), NULL_LABEL), jnp.asarray(index))
        session = session.commit()
    return session


def guided(predictions: list[jax.Array], guidance: float) -> jax.Array:
    """Classifier-free guidance over the streams' predictions, conditioned first."""
    if len(predictions) == 1:
        return predictions[0]
    conditioned, unconditioned = predictions
    return unconditioned + guidance * (conditioned - unconditioned)


def stream_labels(label: jax.Array, streams: int) -> list[jax.Array]:
    """Each stream's label: the shape, then (with guidance) the null label."""
    return [label, jnp.full_like(label, NULL_LABEL)][:streams]


def denoise_frame(model: Model, sessions: tuple[jss.Session, ...], label: jax.Array, frame_index: jax.Array,
                  key: jax.Array, *, guidance: float | None = None) -> tuple[tuple[jss.Session, ...], jax.Array]:
    """One frame: ``steps`` denoising steps (stage, attend) in every stream, then the clean frame committed.

    Args:
      sessions: the streams' sessions (conditioned, and unconditioned with guidance), nothing staged.
      label: ``Int[Array, "B"]`` the shape to draw.
      frame_index: the frame's index in the video.
      key: the noise of this frame.
      guidance: the guidance scale (with two streams); default the config's.

    Returns:
      The sessions with the clean frame committed, and the frame ``[B, size, size]``.
    """
    c = model.config
    levels = c.noise_levels()
    B = label.shape[0]
    labels = stream_labels(label, len(sessions))
    keys = jax.random.split(key, c.steps)
    x = jax.random.normal(keys[0], (B, c.size, c.size), c.dtype)

    def denoising_step(step: jax.Array, carry: tuple) -> tuple:
        sessions, x, _ = carry
        t = jnp.full((B,), levels[step])
        staged, predictions = [], []
        for session, stream_label in zip(sessions, labels):
            session, predicted = model.frame_step(session, x, t, stream_label, frame_index)
            staged.append(session)
            predictions.append(predicted)
        clean = guided(predictions, c.guidance if guidance is None else guidance)
        lower = levels[jnp.minimum(step + 1, c.steps - 1)]  # re-noise the prediction to the next level
        x = (1 - lower) * clean + lower * jax.random.normal(keys[jnp.minimum(step + 1, c.steps - 1)], x.shape, c.dtype)
        return tuple(staged), x, clean

    sessions, _, clean = jax.lax.fori_loop(0, c.steps, denoising_step, (tuple(sessions), x, x))
    sessions = list(sessions)
    zero = jnp.zeros((B,), c.dtype)
    for i, session in enumerate(sessions):
        session, _ = model.frame_step(session, clean, zero, labels[i], frame_index)
        sessions[i] = session.commit()  # the clean frame's K/V in place of the last noisy ones
    return tuple(sessions), clean


def frame_keys(key: jax.Array, frames: int) -> jax.Array:
    """The noise key of each generated frame."""
    return jax.random.split(key, frames)


def sample(model: Model, prompt: jax.Array, label: jax.Array, frames: int, key: jax.Array, *,
           guidance: float | None = None, on_frame=None) -> np.ndarray:
    """Generates ``frames`` frames after the prompt with the sessions, one jitted, donated step per frame.

    Args:
      prompt: ``Float[Array, "B prompt_frames size size"]``; ``label``: ``Int[Array, "B"]``.
      guidance: the guidance scale (1 runs the conditioned stream alone); default the config's.
      on_frame: called with each frame's index once it is ready (a progress bar, a clock), or None.

    Returns:
      ``Float[Array, "B frames size size"]``, as numpy.
    """
    c = model.config
    guidance = c.guidance if guidance is None else guidance
    graphdef, params = nnx.split(model)
    session = jax.jit(lambda p, s, x: encode_prompt(nnx.merge(graphdef, p), s, x), donate_argnums=1)(
        params, make_session(c, prompt.shape[0]), prompt)
    sessions = (session,) if guidance == 1 else (session, session.fork())  # two streams over one history

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, sessions, index, key):
        return denoise_frame(nnx.merge(graphdef, params), sessions, label, index, key, guidance=guidance)

    out = []
    for i, frame_key in enumerate(frame_keys(key, frames)):
        sessions, frame = step(params, sessions, jnp.asarray(prompt.shape[1] + i), frame_key)
        out.append(np.asarray(frame))
        if on_frame is not None:
            on_frame(i)
    jss.check(sessions)
    return np.stack(out, axis=1)


def sample_without_cache(model: Model, prompt: jax.Array, label: jax.Array, frames: int, key: jax.Array, *,
                         guidance: float | None = None) -> np.ndarray:
    """:func:`sample` with no session: every denoising step recomputes every frame before it (``Model.dense``).

    The video is a buffer of all its frames, the ones not generated yet
    included: the mask hides them from the frame being denoised (it sees only
    the clean frames before it), so one compiled step serves every frame.
    """
    c = model.config
    guidance = c.guidance if guidance is None else guidance
    streams = 1 if guidance == 1 else 2
    levels = c.noise_levels()
    B, P = prompt.shape[:2]
    total = P + frames
    history = jnp.arange(total)

    @jax.jit
    def predict(video: jax.Array, x: jax.Array, t: jax.Array, index: jax.Array) -> jax.Array:
        predictions = []
        for label_i in stream_labels(label, streams):
            history_labels = jnp.where(history < P, NULL_LABEL, label_i[:, None])
            predictions.append(model.dense(video, history, history_labels, x[:, None], jnp.full((B, 1), t),
                                           label_i[:, None], index[None])[:, 0])
        return guided(predictions, guidance)

    video = jnp.zeros((B, total, c.size, c.size), c.dtype).at[:, :P].set(prompt)
    for index, frame_key in enumerate(frame_keys(key, frames), start=P):
        keys = jax.random.split(frame_key, c.steps)
        x = jax.random.normal(keys[0], (B, c.size, c.size), c.dtype)
        for step in range(c.steps):
            clean = predict(video, x, levels[step], jnp.asarray(index))
            if step + 1 < c.steps:
                x = (1 - levels[step + 1]) * clean + levels[step + 1] * jax.random.normal(keys[step + 1], x.shape,
                                                                                          c.dtype)
        video = video.at[:, index].set(clean)
    return np.asarray(video[:, P:])


# ------------------------------------------------------------------ training
def clip_loss(model: Model, clips: jax.Array, labels: jax.Array, key: jax.Array) -> jax.Array:
    """Teacher-forced denoising loss of every frame after the prompt, each at its own noise level.

    The frames after the sinks are indexed as if the clip were a window late
    in a long video (a random offset), as sampling indexes them.
    """
    c = model.config
    B, F = clips.shape[:2]
    k_t, k_noise, k_drop, k_late = jax.random.split(key, 4)
    late = jax.random.randint(k_late, (), 0, 4 * c.clip_frames)
    index = jnp.where(jnp.arange(F) < c.sink_frames, jnp.arange(F), jnp.arange(F) + late)
    t = jax.random.uniform(k_t, (B, F), clips.dtype)
    noisy = (1 - t[..., None, None]) * clips + t[..., None, None] * jax.random.normal(k_noise, clips.shape, clips.dtype)
    label = jnp.where(jax.random.uniform(k_drop, (B,)) < 0.15, NULL_LABEL, labels)  # guidance needs both
    frame_labels = jnp.where(jnp.arange(F) < c.prompt_frames, NULL_LABEL, label[:, None])
    predicted = model.dense(clips, index, frame_labels, noisy, t, frame_labels, index)
    return jnp.mean((predicted - clips)[:, c.prompt_frames:] ** 2)


def train(model: Model, steps: int, batch: int, key: jax.Array, *, on_step=None) -> list[float]:
    """Fits the model to fresh moving-shape clips with optax (adamw); returns the loss of every step."""
    c = model.config
    if steps == 0:
        return []
    graphdef, _ = nnx.split(model)
    optimizer = optax.adamw(optax.cosine_onecycle_schedule(steps, 3e-3), weight_decay=1e-4)

    def loss_fn(params, key):
        clips, labels = moving_shapes(key, c, batch, c.clip_frames)
        return clip_loss(nnx.merge(graphdef, params), clips, labels, jax.random.fold_in(key, 1))

    return fit(model, loss_fn, optimizer, steps, key, on_step=on_step)


# ------------------------------------------------------------------ the demo
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=24, help="frames to generate after the prompt")
    p.add_argument("--train-steps", type=int, default=600, help="optax steps fitting the model to the scene")
    p.add_argument("--batch", type=int, default=8, help="training clips per step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--size", type=int, default=16, help="frame side in pixels (patches of 4: size^2/16 tokens)")
    p.add_argument("--guidance", type=float, default=1.5, help="classifier-free guidance scale (1: off)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="parameters, activations and caches (float64 needs JAX_ENABLE_X64=1)")
    p.add_argument("--compare", action="store_true",
                   help="also sample without the sessions (every step recomputes the past) and print the difference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/video_diffusion"), help="folder for video_diffusion.png")
    return p.parse_args()


def plot(path: Path, truth: np.ndarray, generated: np.ndarray, frame_ms: np.ndarray, config: VideoConfig) -> None:
    """The true continuation and the generated frames of each video, and the time of every frame."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    videos, shown = generated.shape[0], min(12, generated.shape[1])
    fig = plt.figure(figsize=(12, 1.1 * 2 * videos + 2.5))
    grid = fig.add_gridspec(2 * videos + 1, shown, height_ratios=[1] * (2 * videos) + [2.2])
    for v in range(videos):
        for row, frames, name in ((2 * v, truth[v], "scene"), (2 * v + 1, generated[v], "generated")):
            for i in range(shown):
                ax = fig.add_subplot(grid[row, i])
                ax.imshow(frames[i], cmap="magma", vmin=-1, vmax=1)
                ax.set_xticks([]), ax.set_yticks([])
                if i == 0:
                    ax.set_ylabel(f"{name} {v}", fontsize=7)
                if row == 0:
                    ax.set_title(f"frame {config.prompt_frames + i}", fontsize=7)
    ax = fig.add_subplot(grid[-1, :])
    first = config.prompt_frames + generated.shape[1] - len(frame_ms)
    ax.plot(np.arange(first, first + len(frame_ms)), frame_ms, ".-")
    ax.axhline(np.median(frame_ms), color="gray", ls="--", lw=1, label=f"median {np.median(frame_ms):.1f} ms")
    ax.set_xlabel("frame")
    ax.set_ylabel("ms per frame")
    ax.set_title(f"{config.steps} denoising steps x {2 if config.guidance != 1 else 1} streams + a commit per frame, "
                 f"rolling cache of {config.window_frames} frames ({config.sink_frames} sink)", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    from tqdm import tqdm

    args = parse_args()
    config = VideoConfig(size=args.size, layers=args.layers, d_model=args.d_model, guidance=args.guidance,
                         dtype=args.dtype)
    key = jax.random.key(args.seed)
    model = nnx.jit(lambda: Model(config, rngs=nnx.Rngs(args.seed)))()  # one compiled init, not op by op

    with tqdm(total=args.train_steps, unit="step", desc="fitting to the scene") as bar:
        losses = train(model, args.train_steps, args.batch, jax.random.fold_in(key, 1), on_step=lambda i: bar.update())
    tail = max(1, len(losses) // 10)
    if losses:
        print(f"denoising loss: first {np.mean(losses[:tail]):.4f}, last {np.mean(losses[-tail:]):.4f}")

    videos = 2
    truth, labels = moving_shapes(jax.random.fold_in(key, 2), config, videos, config.prompt_frames + args.frames)
    prompt, stamps = truth[:, :config.prompt_frames], []
    with tqdm(total=args.frames, unit="frame", desc="generating") as bar:
        def on_frame(i: int) -> None:
            stamps.append(time.perf_counter())
            bar.update()

        start = time.perf_counter()
        generated = sample(model, prompt, labels, args.frames, jax.random.fold_in(key, 3), on_frame=on_frame)
    frame_ms = np.diff([start, *stamps]) * 1e3
    error = np.mean((generated - np.asarray(truth[:, config.prompt_frames:])) ** 2)
    print(f"{args.frames} frames of {config.tokens} tokens: median {np.median(frame_ms[1:]):.1f} ms per frame "
          f"after the first (which compiles: {frame_ms[0]:.0f} ms); mean squared error against the scene {error:.4f}")
    if args.compare:
        recomputed = sample_without_cache(model, prompt, labels, args.frames, jax.random.fold_in(key, 3))
        print(f"without the sessions: largest difference {np.max(np.abs(generated - recomputed)):.3e} "
              f"(frames up to {np.max(np.abs(recomputed)):.2f})")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "video_diffusion.png"
    plot(path, np.asarray(truth[:, config.prompt_frames:]), generated, frame_ms[1:], config)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
