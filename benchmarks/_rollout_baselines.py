"""The world model's rollout written three other ways, for ``benchmarks/rollout.py``.

Each starts from the same :class:`Snapshot` of a library session and computes
the same frames with the same weights, float32 throughout:

- :func:`raw_rollout`: JAX on raw arrays, hand-written: a tuple of head-major
  K/V arrays written with ``lax.dynamic_update_slice``, the length an int,
  the carry and the recent frames plain arrays; the same projections and the
  same attention function (``jss.attend`` over a view of those arrays).  It
  takes the weights and the conditioning as arguments and runs as many
  steps per loop iteration, as the library's rollout does, so the two
  differ only in how the session is held.
- :func:`nnx_decode_rollout`: the blocks' ``nnx.MultiHeadAttention`` called
  with ``decode=True`` on flax's own cache, one token at a time (its only
  mode); flax attends over the whole cache with a mask.
- :class:`TorchWorldModel`: PyTorch eager, a preallocated head-major cache
  per block written in place with ``copy_``, ``scaled_dot_product_attention``
  over the valid prefix (grouped-query heads, a causal mask for the chunk).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_session_state as jss
from examples.world_model import STEPS_PER_ITERATION, WorldModel


@dataclasses.dataclass
class Snapshot:
    """A session's contents as plain arrays: where every implementation starts.

    Attributes:
      k, v: per block, ``[batch, kv_heads, length, head_dim]`` the valid rows.
      cond_k, cond_v: ``[batch, kv_heads, prompt_tokens, head_dim]``.
      h: ``[batch, d_model]`` the recurrent carry.
      frames: ``[context_frames, batch, H, W, C]`` the recent frames, oldest first.
    """

    k: list[np.ndarray]
    v: list[np.ndarray]
    cond_k: np.ndarray
    cond_v: np.ndarray
    h: np.ndarray
    frames: np.ndarray

    @classmethod
    def of(cls, session: jss.Session, names: list[str]) -> Snapshot:
        views = session.view()
        length = int(views[names[0]].lengths[0])
        cond = views["cond"]
        return cls(
            k=[np.asarray(views[n].k[:, :, :length]) for n in names],
            v=[np.asarray(views[n].v[:, :, :length]) for n in names],
            cond_k=np.asarray(cond.k[:, :, : int(cond.lengths[0])]),
            cond_v=np.asarray(cond.v[:, :, : int(cond.lengths[0])]),
            h=np.asarray(views["carry"]["h"]),
            frames=np.asarray(views["frames"].materialize()),
        )

    @property
    def length(self) -> int:
        return self.k[0].shape[2]

    def padded(self, capacity: int, *, token_major: bool = False) -> tuple[list[jax.Array], list[jax.Array]]:
        """K and V per block in ``capacity``-row arrays (head-major, or token-major for flax)."""

        def pad(x: np.ndarray) -> jax.Array:
            x = np.pad(x, ((0, 0), (0, 0), (0, capacity - x.shape[2]), (0, 0)))
            return jnp.asarray(x.transpose(0, 2, 1, 3) if token_major else x)

        return [pad(k) for k in self.k], [pad(v) for v in self.v]


def cond_view(snapshot: Snapshot) -> jss.KVView:
    """The snapshot's conditioning K/V as a view (every token valid)."""
    lengths = jnp.full((snapshot.cond_k.shape[0],), snapshot.cond_k.shape[2], jnp.int32)
    return jss.KVView(jnp.asarray(snapshot.cond_k), jnp.asarray(snapshot.cond_v), lengths, positions=None)


# ------------------------------------------------------------------ raw JAX
def raw_state(snapshot: Snapshot, capacity: int) -> tuple[Any, ...]:
    """``(ks, vs, length, h, frames)`` on raw arrays."""
    ks, vs = snapshot.padded(capacity)
    return tuple(ks), tuple(vs), jnp.int32(snapshot.length), jnp.asarray(snapshot.h), jnp.asarray(snapshot.frames)


def raw_rollout(graphdef: nnx.GraphDef, params: nnx.State, cond: jss.KVView, state: tuple[Any, ...],
                actions: jax.Array):
    """The rollout hand-written on raw arrays; jit it with ``state`` donated."""
    model = nnx.merge(graphdef, params)
    tokens = model.config.tokens

    def one(state, action):
        ks, vs, length, h, frames = state
        ks, vs = list(ks), list(vs)
        x = model.embed_inputs(frames, action, h)
        for i, block in enumerate(model.blocks):
            q, k, v = block.project(x)
            ks[i] = jax.lax.dynamic_update_slice(ks[i], k.transpose(0, 2, 1, 3), (0, 0, length, 0))
            vs[i] = jax.lax.dynamic_update_slice(vs[i], v.transpose(0, 2, 1, 3), (0, 0, length, 0))
            lengths = jnp.full((x.shape[0],), length + tokens, jnp.int32)
            x = x + block.attn.out(jss.attend(q, jss.KVView(ks[i], vs[i], lengths, positions=None)))
            x = block.finish(x, cond)
        frame, h = model.predict(x, frames[-1], h)
        frames = jnp.concatenate([frames[1:], frame[None]])
        return (tuple(ks), tuple(vs), length + tokens, h, frames), frame

    return jax.lax.scan(one, state, actions, unroll=STEPS_PER_ITERATION)  # as the library's rollout


# ------------------------------------------------------------------ flax nnx decode cache
def nnx_decode_model(model: WorldModel, snapshot: Snapshot, capacity: int) -> WorldModel:
    """A copy of ``model`` whose attention layers hold flax decode caches filled from ``snapshot``."""
    graphdef, params = nnx.split(model)
    decoder = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    ks, vs = snapshot.padded(capacity, token_major=True)
    for block, k, v in zip(decoder.blocks, ks, vs):
        block.attn.init_cache((model.config.batch, capacity, model.config.d_model))
        block.attn.cached_key[...] = k
        block.attn.cached_value[...] = v
        block.attn.cache_index[...] = jnp.int32(snapshot.length)
    return decoder


def nnx_decode_rollout(graphdef: nnx.GraphDef, params: nnx.State, cache: nnx.State, cond: jss.KVView,
                       h: jax.Array, frames: jax.Array, actions: jax.Array):
    """The rollout with every block's self-attention on flax's decode cache, one token per call."""

    def one_frame(carry, action):
        cache, h, frames = carry
        model = nnx.merge(graphdef, params, cache)
        x = model.embed_inputs(frames, action, h)

        def one_token(cache, xt):  # xt: [batch, 1, d_model]
            model = nnx.merge(graphdef, params, cache)
            for block in model.blocks:
                xt = xt + block.attn(block.norm_attn(xt), decode=True)
                xt = block.finish(xt, cond)
            return nnx.state(model, nnx.Cache), xt

        cache, ys = jax.lax.scan(one_token, cache, jnp.moveaxis(x, 1, 0)[:, :, None])
        frame, h = model.predict(jnp.moveaxis(ys[:, :, 0], 0, 1), frames[-1], h)
        return (cache, h, jnp.concatenate([frames[1:], frame[None]])), frame

    return jax.lax.scan(one_frame, (cache, h, frames), actions)


# ------------------------------------------------------------------ PyTorch eager
class TorchWorldModel:
    """The world model in PyTorch eager with the same weights; holds its own state.

    K/V live in a preallocated head-major cache per block, ``[batch,
    kv_heads, capacity, head_dim]``; each step writes its rows in place with
    ``copy_`` and attends with ``scaled_dot_product_attention`` over the valid
    prefix only (``enable_gqa``; a boolean mask makes the chunk causal).  The
    q, k and v projections are one matmul (fewer dispatches, the same math).
    """

    def __init__(self, model: WorldModel, snapshot: Snapshot, capacity: int):
        import torch

        self.torch = torch
        self.config = c = model.config
        t = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
        linear = lambda m: (t(m.kernel[...]).reshape(-1, t(m.kernel[...]).shape[-1]).T.contiguous(),  # noqa: E731
                            None if m.bias is None else t(m.bias[...]))
        general_in = lambda m: t(m.kernel[...]).reshape(c.d_model, -1).T.contiguous()  # noqa: E731
        general_out = lambda m: t(m.kernel[...]).reshape(-1, c.d_model).T.contiguous()  # noqa: E731
        self.embed, self.action, self.carry_in = linear(model.embed), linear(model.action), linear(model.carry_in)
        self.carry_update, self.head = linear(model.carry_update), linear(model.head)
        self.position = t(model.position[...])
        self.norm_out = t(model.norm_out.scale[...])
        self.blocks = [
            {
                "norm_attn": t(b.norm_attn.scale[...]),
                "qkv": torch.cat([general_in(b.attn.query), general_in(b.attn.key), general_in(b.attn.value)]),
                "out": general_out(b.attn.out), "norm_cross": t(b.norm_cross.scale[...]),
                "cross_q": general_in(b.cross_q), "cross_out": general_out(b.cross_out),
                "norm_mlp": t(b.norm_mlp.scale[...]), "mlp_in": linear(b.mlp_in), "mlp_out": linear(b.mlp_out),
            }
            for b in model.blocks
        ]
        self.eps = model.blocks[0].norm_attn.epsilon
        shape = (c.batch, c.kv_heads, capacity, c.head_dim)
        self.k = [torch.zeros(shape) for _ in model.blocks]
        self.v = [torch.zeros(shape) for _ in model.blocks]
        self.restore(snapshot)

    def restore(self, snapshot: Snapshot) -> None:
        """Back to ``snapshot``: its rows, carry and frames (rows past it are never read)."""
        torch = self.torch
        tensor = lambda x: torch.from_numpy(np.array(x))  # noqa: E731  (a writable copy)
        for cache, rows in zip(self.k + self.v, snapshot.k + snapshot.v):
            cache[:, :, : rows.shape[2]].copy_(tensor(rows))
        self.length = snapshot.length
        self.cond_k, self.cond_v = tensor(snapshot.cond_k), tensor(snapshot.cond_v)
        self.h, self.frames = tensor(snapshot.h), tensor(snapshot.frames)

    def _patchify(self, frames: Any) -> Any:
        K, B, H, W, C = frames.shape
        p = self.config.patch
        x = frames.reshape(K, B, H // p, p, W // p, p, C).permute(0, 1, 2, 4, 3, 5, 6)
        return x.reshape(K, B, (H // p) * (W // p), p * p * C)

    def _unpatchify(self, tokens: Any) -> Any:
        H, W, C = self.config.frame_shape
        p = self.config.patch
        x = tokens.reshape(tokens.shape[0], H // p, W // p, p, p, C).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(tokens.shape[0], H, W, C)

    def step(self, action: Any) -> Any:
        """One frame: 16 new K/V rows per block written in place; returns the predicted frame."""
        torch, F, c = self.torch, self.torch.nn.functional, self.config
        B, T, H, Hk, D = c.batch, c.tokens, c.heads, c.kv_heads, c.head_dim
        norm = lambda x, scale: F.rms_norm(x, (c.d_model,), scale, self.eps)  # noqa: E731
        context = torch.cat(list(self._patchify(self.frames)), dim=-1)
        x = (F.linear(context, *self.embed) + self.position + F.linear(action, *self.action)[:, None]
             + F.linear(self.h, *self.carry_in)[:, None])
        start, end = self.length, self.length + T
        causal = torch.arange(end) <= (start + torch.arange(T))[:, None]
        for block, k_cache, v_cache in zip(self.blocks, self.k, self.v):
            q, k, v = F.linear(norm(x, block["norm_attn"]), block["qkv"]).split([H * D, Hk * D, Hk * D], dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)
            k_cache[:, :, start:end].copy_(k.view(B, T, Hk, D).transpose(1, 2))
            v_cache[:, :, start:end].copy_(v.view(B, T, Hk, D).transpose(1, 2))
            attended = F.scaled_dot_product_attention(
                q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=causal, enable_gqa=True
            )
            x = x + F.linear(attended.transpose(1, 2).reshape(B, T, H * D), block["out"])
            q = F.linear(norm(x, block["norm_cross"]), block["cross_q"]).view(B, T, H, D).transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, self.cond_k, self.cond_v, enable_gqa=True)
            x = x + F.linear(attended.transpose(1, 2).reshape(B, T, H * D), block["cross_out"])
            x = x + F.linear(F.silu(F.linear(norm(x, block["norm_mlp"]), *block["mlp_in"])), *block["mlp_out"])
        frame = self.frames[-1] + self._unpatchify(F.linear(norm(x, self.norm_out), *self.head))
        self.h = torch.tanh(F.linear(torch.cat([self.h, x.mean(dim=1)], dim=-1), *self.carry_update))
        self.frames = torch.cat([self.frames[1:], frame[None]])
        self.length = end
        return frame

    def rollout(self, actions: np.ndarray) -> np.ndarray:
        """Steps once per action ``[steps, batch, action_dim]``; returns the frames."""
        with self.torch.inference_mode():
            actions = self.torch.from_numpy(np.asarray(actions, np.float32))
            return self.torch.stack([self.step(a) for a in actions]).numpy()
