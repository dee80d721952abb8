"""A small autoregressive world model in flax nnx whose state lives in a ``jss.Session``.

Latent frames in, latent frames out, conditioned on actions and a prompt.  One
step reads the last ``context_frames`` frames and the action, and predicts the
next frame, 16 tokens at a time (one token per 2x2 patch of an 8x8x4 latent):

- every block's self-attention writes its K/V rows into a ``KVCache`` (a sink +
  window ring by default, append mode when ``capacity`` is given) and reads it
  with ``jss.attend``: token-causal, grouped-query heads;
- every block cross-attends to the prompt's K/V, an ``EncodeOnceKV`` written
  once per session and recomputable from the prompt embedding (``FixedState``);
- a recurrent carry (``FixedState``) summarises each frame and feeds the next;
- a ``LatentBuffer`` ring keeps the recent frames the next step reads.

``WorldModel.step`` only *stages* its writes, so one function serves a rollout
(stage, then ``commit()``), training (the same, with the observed frame written
instead of the prediction) and speculative planning, where it runs on a
``jss.Lane`` of ``session.branch(n)`` under ``jax.vmap``.

Used by ``world_model_rollout.py``, ``train_world_model.py``,
``speculative_planning.py`` and ``benchmarks/rollout.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, serialization

import jax_session_state as jss

__all__ = [
    "STEPS_PER_ITERATION",
    "WorldModel",
    "WorldModelConfig",
    "cross_attend",
    "load_params",
    "make_session",
    "moving_patterns",
    "patchify",
    "rollout",
    "save_params",
    "start_session",
    "unpatchify",
]


STEPS_PER_ITERATION = 2
"""Steps :func:`rollout` runs per iteration of its compiled loop.

A step of this model is a few hundred small XLA:CPU operations, a few dozen
of them the session's bookkeeping (counts, flags) and the copies XLA makes
of loop-carried values.  With two steps per iteration XLA fuses the
bookkeeping of one step's commit into the next step's writes and copies the
carried state half as often (measured: half the extra operations per
frame).  The compiled loop is about twice as large; it compiles no slower
here.
"""


@dataclasses.dataclass(frozen=True)
class WorldModelConfig:
    """Sizes of the model and of its session.

    Attributes:
      frame_shape: one latent frame ``(height, width, channels)``.
      patch: side of the square patch that makes one token.
      context_frames: recent frames each step reads (the ``LatentBuffer``'s length).
      action_dim: size of one action.
      d_model: width of the residual stream.
      heads: query heads; ``kv_heads`` K/V heads (grouped-query attention).
      kv_heads: K/V heads, a divisor of ``heads``.
      layers: attention blocks.
      mlp_ratio: hidden width of each block's MLP over ``d_model``.
      prompt_tokens: tokens of the prompt embedding the model cross-attends to.
      batch: rollouts run side by side.
      window: ring mode: the last ``window`` tokens each query sees, besides the sinks.
      sink: ring mode: the first ``sink`` tokens, kept for ever.
      capacity: append mode: tokens the cache holds (``window`` and ``sink`` are then unused).
      lane_frames: the most frames a speculative lane may stage.
      quantize: store the self-attention K/V quantized (``"int8"`` or
        ``"fp8"``), or None for float32.
      tiers: the quantized forms a float32 cache may be demoted to when a
        session manager is short of memory (e.g. ``("int8",)``).
    """

    frame_shape: tuple[int, int, int] = (8, 8, 4)
    patch: int = 2
    context_frames: int = 2
    action_dim: int = 2
    d_model: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 4
    mlp_ratio: int = 4
    prompt_tokens: int = 8
    batch: int = 1
    window: int = 512
    sink: int = 16
    capacity: int | None = None
    lane_frames: int = 8
    quantize: str | None = None
    tiers: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        """Tokens per frame (one chunk of K/V rows per step)."""
        height, width, _ = self.frame_shape
        return (height // self.patch) * (width // self.patch)

    @property
    def token_dim(self) -> int:
        """Latent values per token."""
        return self.patch * self.patch * self.frame_shape[2]

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.heads


def kv_names(config: WorldModelConfig) -> list[str]:
    """The session names of the blocks' K/V caches."""
    return [f"kv_{i}" for i in range(config.layers)]


# ------------------------------------------------------------------ latent frames
def patchify(frames: jax.Array, patch: int) -> jax.Array:
    """``Float[Array, "... H W C"]`` -> ``Float[Array, "... tokens patch*patch*C"]``, row-major patches."""
    *lead, height, width, channels = frames.shape
    x = frames.reshape(*lead, height // patch, patch, width // patch, patch, channels)
    x = jnp.moveaxis(x, -4, -3)  # [..., H/p, W/p, p, p, C]
    return x.reshape(*lead, (height // patch) * (width // patch), patch * patch * channels)


def unpatchify(tokens: jax.Array, frame_shape: tuple[int, int, int], patch: int) -> jax.Array:
    """The inverse of :func:`patchify`."""
    height, width, channels = frame_shape
    *lead, _, _ = tokens.shape
    x = tokens.reshape(*lead, height // patch, width // patch, patch, patch, channels)
    x = jnp.moveaxis(x, -3, -4)
    return x.reshape(*lead, height, width, channels)


def moving_patterns(key: jax.Array, config: WorldModelConfig, steps: int, batch: int) -> tuple[jax.Array, jax.Array]:
    """Synthetic episodes: a random periodic pattern per channel, moved by each action.

    Frame ``t + 1`` is frame ``t``'s pattern shifted by action ``t`` (a velocity
    in pixels, each component in ``[-1, 1]``), so a model that reads the last
    frame and the action can predict the next one.

    Returns:
      ``frames``: ``Float[Array, "steps+context batch H W C"]`` (the first
      ``context_frames`` are the context before any action) and ``actions``:
      ``Float[Array, "steps batch action_dim"]``.
    """
    height, width, channels = config.frame_shape
    k_freq, k_phase, k_start, k_act = jax.random.split(key, 4)
    freq = jax.random.randint(k_freq, (batch, 2, channels), 1, 3).astype(jnp.float32)  # cycles per frame side
    phase = jax.random.uniform(k_phase, (batch, channels), maxval=2 * math.pi)
    actions = jax.random.uniform(
        k_act, (steps + config.context_frames - 1, batch, config.action_dim), minval=-1, maxval=1
    )
    start = jax.random.uniform(k_start, (1, batch, 2), maxval=float(height))
    offsets = jnp.concatenate([start, start + jnp.cumsum(actions[..., :2], axis=0)])  # [T, batch, 2]
    y = jnp.arange(height, dtype=jnp.float32)[:, None, None]
    x = jnp.arange(width, dtype=jnp.float32)[None, :, None]

    def frame(offset: jax.Array) -> jax.Array:  # offset [batch, 2] -> [batch, H, W, C]
        oy, ox = offset[:, 0, None, None, None], offset[:, 1, None, None, None]
        arg = freq[:, None, None, 0] * (y - oy) / height + freq[:, None, None, 1] * (x - ox) / width
        return jnp.sin(2 * math.pi * arg + phase[:, None, None])

    return jax.vmap(frame)(offsets), actions[config.context_frames - 1:]


# ------------------------------------------------------------------ session
def make_session(config: WorldModelConfig) -> jss.Session:
    """The empty session of a model of this config."""
    c = config
    if c.capacity is None:
        kv = dict(window=c.window, sink=c.sink, max_staged=c.tokens)
    else:
        kv = dict(capacity=c.capacity)
    caches = {
        name: jss.KVCache.allocate(
            batch=c.batch, kv_heads=c.kv_heads, head_dim=c.head_dim, quantize=c.quantize, tiers=c.tiers, **kv
        )
        for name in kv_names(c)
    }
    return jss.Session(
        objects={
            **caches,
            "cond": jss.EncodeOnceKV.allocate(
                batch=c.batch, kv_heads=c.kv_heads, head_dim=c.head_dim, capacity=c.prompt_tokens,
                recompute_source="prompt",
            ),
            "prompt": jss.FixedState.allocate(shapes=(c.batch, c.prompt_tokens, c.d_model)),
            "carry": jss.FixedState.allocate(shapes={"h": (c.batch, c.d_model)}),
            "frames": jss.LatentBuffer.allocate(
                capacity=c.context_frames, item_shape=(c.batch, *c.frame_shape), ring=True, max_staged=c.lane_frames
            ),
        }
    )


def start_session(model: WorldModel, prompt: jax.Array, context: jax.Array) -> jss.Session:
    """A session with the prompt and its conditioning K/V written, and the first frames.

    Args:
      model: the model (its config sizes the session).
      prompt: ``Float[Array, "batch prompt_tokens d_model"]`` the prompt embedding.
      context: ``Float[Array, "context_frames batch H W C"]`` the frames before the first action.
    """
    session = make_session(model.config)
    return session.append(prompt=prompt, cond=model.encode(prompt), frames=context)


# ------------------------------------------------------------------ the model
def cross_attend(q: jax.Array, view: jss.KVView) -> jax.Array:
    """Attention of ``q`` ``[B, T, heads, D]`` over a short conditioning view, in one dense pass.

    The prompt is a handful of tokens, so a masked product is cheapest, and
    unlike a loop over blocks it is reverse-differentiable (training needs it).
    """
    B, T, heads, D = q.shape
    groups = heads // view.k.shape[1]
    qg = q.reshape(B, T, view.k.shape[1], groups, D)
    scores = jnp.einsum("btkgd,bknd->bkgtn", qg, view.k) / math.sqrt(D)
    valid = jnp.arange(view.k.shape[2]) < view.lengths[:, None, None, None, None]
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    weights = jnp.where(jnp.any(valid, axis=-1, keepdims=True), weights, 0.0)  # nothing to see: zeros
    return jnp.einsum("bkgtn,bknd->btkgd", weights, view.v).reshape(q.shape)


class Block(nnx.Module):
    """Self-attention over the session's K/V, cross-attention to the prompt, an MLP.

    ``attn`` is flax's own ``MultiHeadAttention``: the library path uses its
    projections and replaces its attention by ``jss.attend`` over the cache
    (``project`` then ``attn.out``); called with ``decode=True`` it runs on
    flax's own decode cache instead, with the same weights.
    """

    def __init__(self, c: WorldModelConfig, rngs: nnx.Rngs):
        self.norm_attn = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=c.heads, num_kv_heads=c.kv_heads, in_features=c.d_model, use_bias=False, decode=False,
            rngs=rngs,
        )
        self.norm_cross = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.cross_q = nnx.LinearGeneral(c.d_model, (c.heads, c.head_dim), use_bias=False, rngs=rngs)
        self.cross_out = nnx.LinearGeneral((c.heads, c.head_dim), c.d_model, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.norm_mlp = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(c.d_model, c.mlp_ratio * c.d_model, rngs=rngs)
        self.mlp_out = nnx.Linear(c.mlp_ratio * c.d_model, c.d_model, rngs=rngs)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Self-attention ``q`` ``[B, T, heads, D]`` and ``k, v`` ``[B, T, kv_heads, D]``."""
        h = self.norm_attn(x)
        return self.attn.query(h), self.attn.key(h), self.attn.value(h)

    def finish(self, x: jax.Array, cond: jss.KVView) -> jax.Array:
        """Cross-attention to the conditioning and the MLP, each with its residual."""
        x = x + self.cross_out(cross_attend(self.cross_q(self.norm_cross(x)), cond))
        return x + self.mlp_out(jax.nn.silu(self.mlp_in(self.norm_mlp(x))))


class WorldModel(nnx.Module):
    """Predicts the next latent frame from the recent frames, an action and the session.

    Example:
      >>> model = WorldModel(WorldModelConfig(layers=1), rngs=nnx.Rngs(0))
      >>> c = model.config
      >>> context = jnp.zeros((c.context_frames, c.batch, *c.frame_shape))
      >>> session = start_session(model, jnp.ones((c.batch, c.prompt_tokens, c.d_model)), context)
      >>> staged, frame = model.step(session, jnp.zeros((c.batch, c.action_dim)))
      >>> session = staged.commit()
      >>> frame.shape, session.view()["kv_0"].lengths
      ((1, 8, 8, 4), Array([16], dtype=int32))
    """

    def __init__(self, config: WorldModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Linear(c.context_frames * c.token_dim, c.d_model, rngs=rngs)
        self.action = nnx.Linear(c.action_dim, c.d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (c.tokens, c.d_model)))
        self.carry_in = nnx.Linear(c.d_model, c.d_model, rngs=rngs)
        self.carry_update = nnx.Linear(2 * c.d_model, c.d_model, rngs=rngs)
        self.cond_k = nnx.LinearGeneral(c.d_model, (c.kv_heads, c.head_dim), use_bias=False, rngs=rngs)
        self.cond_v = nnx.LinearGeneral(c.d_model, (c.kv_heads, c.head_dim), use_bias=False, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.norm_out = nnx.RMSNorm(c.d_model, rngs=rngs)
        self.head = nnx.Linear(c.d_model, c.token_dim, rngs=rngs)

    def encode(self, prompt: jax.Array) -> jss.KVChunk:
        """The conditioning K/V of a prompt embedding ``[B, prompt_tokens, d_model]``."""
        return jss.KVChunk(self.cond_k(prompt), self.cond_v(prompt))

    def embed_inputs(self, context: jax.Array, action: jax.Array, h: jax.Array) -> jax.Array:
        """Tokens ``[B, tokens, d_model]`` from the recent frames ``[K, B, H, W, C]``, the action and the carry."""
        c = self.config
        tokens = patchify(context, c.patch)  # [K, B, N, token_dim]
        tokens = jnp.concatenate(list(tokens), axis=-1)  # oldest first
        return self.embed(tokens) + self.position[...] + self.action(action)[:, None] + self.carry_in(h)[:, None]

    def predict(self, x: jax.Array, last: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The next frame (the last one plus a predicted change) and the next carry."""
        c = self.config
        change = self.head(self.norm_out(x))
        frame = last + unpatchify(change, c.frame_shape, c.patch)
        h = jnp.tanh(self.carry_update(jnp.concatenate([h, x.mean(axis=1)], axis=-1)))
        return frame, h

    def step(self, state: Any, action: jax.Array, observed: jax.Array | None = None) -> tuple[Any, jax.Array]:
        """One frame: stage every write into ``state`` and return the predicted frame.

        Args:
          state: a :class:`jss.Session` holding no staged data, or a
            :class:`jss.Lane` (a speculative branch); both ``stage`` and ``view``.
          action: ``Float[Array, "batch action_dim"]``.
          observed: ``Float[Array, "batch H W C"]`` the true next frame, to
            write instead of the prediction (teacher forcing), or None.

        Returns:
          ``state`` with this frame's K/V rows, carry and frame staged (commit a
          session; a lane keeps staging), and the predicted frame ``[B, H, W, C]``.
        """
        views = state.view()
        context, h = views["frames"].items, views["carry"]["h"]
        x = self.embed_inputs(context, action, h)
        for name, block in zip(kv_names(self.config), self.blocks):
            q, k, v = block.project(x)
            state = state.stage(**{name: jss.KVChunk(k, v)})
            x = x + block.attn.out(jss.attend(q, state.view()[name]))
            x = block.finish(x, views["cond"])
        frame, h = self.predict(x, context[-1], h)
        written = frame if observed is None else observed
        return state.stage(carry={"h": h}, frames=written), frame


def rollout(
    model: WorldModel,
    session: jss.Session,
    actions: jax.Array,
    observed: jax.Array | None = None,
    *,
    on_step: Callable[..., None] | None = None,
    unroll: int = STEPS_PER_ITERATION,
) -> tuple[jss.Session, jax.Array]:
    """Steps the model once per action in one ``lax.scan``; jit it with the session donated.

    Args:
      model: the model.
      session: a started session (see :func:`start_session`).
      actions: ``Float[Array, "steps batch action_dim"]``.
      observed: ``Float[Array, "steps batch H W C"]`` true frames to write
        instead of the predictions (teacher forcing), or None.
      on_step: called on the host after every step with the step's index and
        the tokens written so far (``jax.debug.callback``, in order), e.g. to
        drive a progress bar; None for no callback.  Each call is a round
        trip to the host: on XLA:CPU an empty one costs about 0.3-0.5 ms, more
        than half of this model's step at 4k tokens.
      unroll: steps per iteration of the compiled loop (``lax.scan``'s
        ``unroll``); see :data:`STEPS_PER_ITERATION`.

    Returns:
      The session after the last step and the predicted frames ``[steps, batch, H, W, C]``.
    """
    first = kv_names(model.config)[0]

    def one(session: jss.Session, xs: tuple[jax.Array, ...]) -> tuple[jss.Session, jax.Array]:
        index, action, *frame_seen = xs
        staged, frame = model.step(session, action, *frame_seen)
        session = staged.commit()
        if on_step is not None:
            jax.debug.callback(on_step, index, session[first].committed, ordered=True)
        return session, frame

    xs = (jnp.arange(actions.shape[0]), actions) + (() if observed is None else (observed,))
    return jax.lax.scan(one, session, xs, unroll=unroll)


def save_params(model: WorldModel, path: Path) -> None:
    """Writes the model's parameters (msgpack)."""
    path.write_bytes(serialization.to_bytes(nnx.state(model, nnx.Param).to_pure_dict()))


def load_params(model: WorldModel, path: Path) -> None:
    """Loads parameters written by :func:`save_params` into ``model`` (same config)."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, serialization.from_bytes(state.to_pure_dict(), path.read_bytes()))
    nnx.update(model, state)
