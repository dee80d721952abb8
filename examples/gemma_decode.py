"""A Gemma 3 model from Google DeepMind's ``gemma`` package decodes greedily with its K/V in a ``jss.Session``.

Every layer's attention state lives in a jss object: the sliding-window (local)
layers in ring ``KVCache``s sized to the layer's window, the global layers in
append caches.  Everything else is the package's own: its ``gm.nn`` modules and
weights for the embedder, norms, projections, QK-norm, RoPE (two bases) and MLP.
Only the attention is glue: project with the layer's einsums, append K/V to the
layer's cache, read it with ``jss.attend``, project back.

The same weights then decode through the package's own path (its prefill, its
cache dict, ``model.apply`` with the sampler's attention mask, as
``gm.text.SamplerLoop`` steps it; and the sampler loop itself for the tokens), and
the demo prints the largest logit difference, whether the greedy tokens agree,
time per token for both and the bytes each holds.

Without a checkpoint the model is a small random-init Gemma 3 (the package's own
``TransformerConfig``, shrunk: 5 local layers to 1 global, GQA, QK-norm, RoPE
bases 10k / 1M).  ``--ckpt`` loads real weights (``--model`` names the class).

Needs the models extra:  pip install '.[models]'

Run:  python examples/gemma_decode.py [--steps 200] [--window 32] [--prompt 16] [--layers 6]
      [--embed-dim 128] [--heads 4] [--kv-heads 2] [--head-dim 32] [--vocab 1024] [--batch 1]
      [--ckpt PATH --model Gemma3_1B]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="tokens to decode after the prompt")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (random ids)")
    p.add_argument("--window", type=int, default=32, help="the local layers' sliding window")
    p.add_argument("--layers", type=int, default=6, help="layers (Gemma 3's pattern: 5 local, then 1 global)")
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--hidden-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads (GQA when fewer than --heads)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None,
                   help="a real Gemma 3 checkpoint (orbax folder); default: random init.  Untried: gm.ckpts does not "
                        "import with gemma 3.3.0 beside kauldron 1.4.2 (the release that runs on jax 0.10.2)")
    p.add_argument("--model", default="Gemma3_1B", help="the gm.nn class of --ckpt (Gemma3_270M, Gemma3_1B, ...)")
    return p.parse_args(argv)


# ------------------------------------------------------------ the jss glue
def allocate_session(config: Any, *, batch: int, capacity: int, max_staged: int,
                     dtype: Any = jnp.float32) -> jss.Session:
    """One K/V cache per layer, from the model's config: a ring for a sliding-window layer, else append mode.

    Args:
      config: the model's ``gm.nn.config.TransformerConfig``.
      batch: batch rows.
      capacity: tokens a global layer holds (prompt + decoded).
      max_staged: the most rows one call appends (the prefill chunk): a ring keeps that many slots
        beyond its window, so a chunk's queries still see their whole window.
      dtype: the K/V dtype (the params' dtype).
    """
    from gemma import gm

    objects = {}
    for i, kind in enumerate(config.attention_types):
        shape = dict(batch=batch, kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
        if kind == gm.nn.AttentionType.LOCAL_SLIDING:
            objects[f"layer_{i}"] = jss.KVCache.allocate(**shape, window=config.sliding_window_size,
                                                         max_staged=max_staged)
        else:
            objects[f"layer_{i}"] = jss.KVCache.allocate(**shape, capacity=capacity)
    return jss.Session(objects=objects)


def attention(attn: Any, x: jax.Array, positions: jax.Array, kv: jss.KVCache) -> tuple[jax.Array, jss.KVCache]:
    """A bound ``gm.nn.Attention``'s forward pass with its K/V in ``kv``: the layer's own weights, jss's state."""
    from gemma import gm

    if attn.use_qkv_einsum:  # as many K/V heads as query heads
        q, k, v = attn.qkv_einsum("BTD,SNDH->SBTNH", x)
    else:
        q = attn.q_einsum("BTD,NDH->BTNH", x)
        k, v = attn.kv_einsum("BSD,CKDH->CBSKH", x)
    if attn.use_qk_norm:
        q, k = attn._query_norm(q), attn._key_norm(k)
    rope = dict(base_frequency=attn.rope_base_frequency, scale_factor=attn.rope_scale_factor)
    q = gm.math.apply_rope(q, positions, **rope)
    k = gm.math.apply_rope(k, positions, **rope)
    kv = kv.append((k, v))  # write: a ring keeps the last `window` positions
    # read: the ring's view masks each query's window by absolute position, as the model's sliding mask does
    out = jss.attend(q, kv.view(), scale=attn.query_pre_attn_scalar, q_positions=positions)
    return attn.attn_vec_einsum("BTNH,NHD->BTD", out), kv


def block(layer: Any, x: jax.Array, positions: jax.Array, kv: jss.KVCache) -> tuple[jax.Array, jss.KVCache]:
    """A bound ``gm.nn.Block``: its norms and MLP around :func:`attention`."""
    attended, kv = attention(layer.attn, layer.pre_attention_norm(x), positions, kv)
    if layer.post_attention_norm is not None:
        attended = layer.post_attention_norm(attended)
    attended += x
    out = layer.mlp(layer.pre_ffw_norm(attended))
    if layer.post_ffw_norm is not None:
        out = layer.post_ffw_norm(out)
    return out + attended, kv


def forward(model: Any, params: Any, session: jss.Session, tokens: jax.Array,
            positions: jax.Array) -> tuple[jax.Array, jss.Session]:
    """Logits ``[batch, T, vocab]`` for ``tokens`` at ``positions``, the session holding every layer's K/V."""
    config = model.config
    if config.attn_logits_soft_cap is not None:
        raise NotImplementedError("attention logit soft-capping (Gemma 2) is not in jss.attend")
    bound = model.bind({"params": params})
    x = bound.embedder.encode(tokens)
    caches = {}
    for i, layer in enumerate(bound.blocks):
        x, caches[f"layer_{i}"] = block(layer, x, positions, session[f"layer_{i}"])
    logits = bound.embedder.decode(bound.final_norm(x))
    if config.final_logit_softcap is not None:
        logits = jnp.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
    return logits, session.with_objects(**caches)


# ------------------------------------------------------------ the two paths
def make_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """A random-init Gemma 3 (the package's config, shrunk) and its params; or ``--ckpt``'s."""
    from gemma import gm

    if args.ckpt:
        model = getattr(gm.nn, args.model)(dtype=jnp.float32)
        params = gm.ckpts.load_params(args.ckpt)
        params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return model, params
    # Gemma 3 1B's config (gemma/gm/nn/_gemma.py: Gemma3_1B), shrunk: its layer pattern (5 local, then 1
    # global), GQA, QK-norm, post-norms, the two RoPE bases, 1/sqrt(head_dim) query scale, no soft-capping.
    # (`gm.nn.Gemma3_1B` itself is not importable here: its module imports `gm.ckpts`, which needs
    # `kauldron.ckpts.AbstractPartialLoader`, gone in kauldron 1.4; kauldron 1.3.0 does not import on jax 0.10.2.)
    local, glob = gm.nn.AttentionType.LOCAL_SLIDING, gm.nn.AttentionType.GLOBAL
    config = gm.nn.config.TransformerConfig(
        num_embed=args.vocab,
        embed_dim=args.embed_dim,
        hidden_dim=args.hidden_dim,
        num_heads=args.heads,
        head_dim=args.head_dim,
        num_kv_heads=args.kv_heads,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=gm.nn.config.make_attention_layers_types((local,) * 5 + (glob,), num_layers=args.layers),
        query_pre_attn_norm=gm.nn.config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        attn_logits_soft_cap=None,
        sliding_window_size=args.window,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        vision_encoder=None,
    )
    model = gm.nn.Transformer(config=config, dtype=jnp.float32)
    tokens = jnp.ones((1, 4), jnp.int32)
    params = model.init(jax.random.key(args.seed), tokens)["params"]
    # Random init leaves the norms' scales at 0 (x1): give them some spread so the layers differ.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(args.seed + 1), len(leaves))
    leaves = [p + 0.1 * jax.random.normal(k, p.shape) if p.ndim == 1 else p for p, k in zip(leaves, keys)]
    return model, jax.tree.unflatten(tree, leaves)


def decode_with_jss(model, params, prompt, steps):
    """Prefill all but the last prompt token, then decode greedily one token a step (as the sampler does)."""
    batch, length = prompt.shape
    session = allocate_session(model.config, batch=batch, capacity=length + steps, max_staged=max(length - 1, 1))
    prefill = jax.jit(functools.partial(forward, model), donate_argnums=(1,))
    positions = jnp.broadcast_to(jnp.arange(length - 1), (batch, length - 1))
    _, session = prefill(params, session, prompt[:, :-1], positions)

    def step(carry, _):
        session, token, position = carry
        logits, session = forward(model, params, session, token[:, None], position[:, None])
        logits = logits[:, 0]
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (session, token, position + 1), (logits, token)

    start = (session, prompt[:, -1], jnp.full((batch,), length - 1, jnp.int32))
    (session, _, _), (logits, tokens), seconds = _timed_scan(step, start, steps)
    return logits, tokens, seconds, session


def decode_with_gemma(model, params, prompt, steps):
    """The package's own path: its prefill, its cache, and ``model.apply`` stepped as ``SamplerLoop`` steps it."""
    from gemma.gm.text import _prefill
    from gemma.gm.utils import _types

    length = prompt.shape[1]
    start = _prefill.prefill(
        model=model, params=params, input=_types.Input(text=prompt, images=None, config=model.config.input_config),
        last_state=None, cache_length=length + steps, max_out_length=steps, rng=jax.random.key(0), sharding=None)

    def step(state, _):  # gm.text.SamplerLoop._sample_step (greedy), keeping the logits
        out = model.apply({"params": params}, tokens=state.last_token[..., None], cache=state.cache,
                          positions=state.last_token_pos[..., None],
                          attention_mask=state.attention_mask_for_step[:, None, :])
        logits = out.logits[:, 0]
        token = jnp.argmax(logits, axis=-1).astype(state.last_token.dtype)
        state = dataclasses.replace(
            state, step=state.step + 1, last_token=token, last_token_pos=state.last_token_pos + 1, cache=out.cache,
            predicted_tokens=state.predicted_tokens.at[:, state.step].set(token))
        return state, (logits, token)

    state, (logits, tokens), seconds = _timed_scan(step, jax.tree.map(jnp.copy, start), steps)
    return logits, tokens, seconds, state, start


def sampler_loop_tokens(model, params, start, steps):
    """The tokens of the package's own ``SamplerLoop`` (its jitted while loop, greedy) from the same prefill."""
    from gemma import gm
    from gemma.gm.text import _sampler_loop

    loop = _sampler_loop.SamplerLoop(model=model, end_tokens=(-1,), forbidden_tokens=None,
                                     sampling=gm.text.Greedy(), cache_length=start.cache["layer_0"]["k"].shape[1],
                                     special_tokens=model.config.input_config.special_tokens)
    state = loop.sample(params=params, init_state=start, max_new_tokens=jnp.asarray(steps))
    return np.asarray(state.predicted_tokens)


def _timed_scan(step, carry, steps, repeats=5):
    """``steps`` steps of ``step`` in one jitted, donated ``lax.scan`` (as the package's sampler loop is one
    jitted loop), compiled first, then run ``repeats`` times from copies of ``carry`` (the best time is kept).
    Returns the last carry, the stacked outputs (batch-major) and seconds per token."""
    run = jax.jit(lambda carry: jax.lax.scan(step, carry, length=steps), donate_argnums=(0,))
    compiled = run.lower(carry).compile()
    best = float("inf")
    for _ in range(repeats):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, carry))
        start = time.perf_counter()
        last, outputs = jax.block_until_ready(compiled(fresh))
        best = min(best, time.perf_counter() - start)
    logits, tokens = outputs
    return last, (jnp.moveaxis(logits, 0, 1), np.asarray(tokens).T), best / steps


def tree_bytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, params = make_model(args)
    config = model.config
    rng = np.random.default_rng(args.seed)
    prompt = jnp.asarray(rng.integers(2, config.num_embed, (args.batch, args.prompt)), jnp.int32)  # 0 pads

    ours, our_tokens, our_time, session = decode_with_jss(model, params, prompt, args.steps)
    theirs, their_tokens, their_time, state, start = decode_with_gemma(model, params, prompt, args.steps)
    sampler_tokens = sampler_loop_tokens(model, params, start, args.steps)

    kinds = ["local" if t.name == "LOCAL_SLIDING" else "global" for t in config.attention_types]
    diff = float(jnp.max(jnp.abs(ours - theirs)))
    scale = float(jnp.max(jnp.abs(theirs)))
    top2 = jax.lax.top_k(theirs, 2)[0]
    margin = float(jnp.min(top2[..., 0] - top2[..., 1]))  # how close greedy came to another token
    result = {
        "max_logit_diff": diff,
        "tokens_agree": bool((our_tokens == their_tokens).all()),
        "sampler_tokens_agree": bool((our_tokens == sampler_tokens).all()),
        "jss_s_per_token": our_time,
        "gemma_s_per_token": their_time,
        "jss_bytes": session.nbytes,
        "gemma_bytes": tree_bytes(state.cache),
    }
    print("Gemma 3 (random init)" if not args.ckpt else f"{args.model} from {args.ckpt}",
          f"{config.num_layers} layers ({kinds.count('local')} local window {config.sliding_window_size}, "
          f"{kinds.count('global')} global), {config.num_heads} query / {config.num_kv_heads} kv heads "
          f"x {config.head_dim}, vocab {config.num_embed}, float32")
    print(f"prompt {args.prompt} tokens, {args.steps} greedy steps, batch {args.batch} "
          f"(positions up to {args.prompt + args.steps - 1}: the local rings wrap)")
    print("session: " + ", ".join(f"{name} {'ring' if obj.window else 'append'} {obj.slots} slots"
                                   for name, obj in sorted(session.objects.items(), key=lambda item: int(
                                       item[0].split("_")[1]))))
    print(f"logits: largest difference from gemma's own cache path {diff:.3g} (largest |logit| {scale:.3g}, "
          f"smallest top-1/top-2 gap {margin:.3g})")
    print(f"greedy tokens identical to gemma's own path: {result['tokens_agree']}; "
          f"to gemma's SamplerLoop: {result['sampler_tokens_agree']}")
    print(f"time per token: jss {our_time * 1e3:.3f} ms, gemma {their_time * 1e3:.3f} ms "
          f"(ratio {our_time / their_time:.2f}x)")
    print(f"bytes held: jss session {result['jss_bytes']:,}, gemma cache {result['gemma_bytes']:,} "
          f"(ratio {result['jss_bytes'] / result['gemma_bytes']:.2f}x)")
    bars = {
        "logits within 1e-4": diff <= 1e-4,
        "tokens identical": result["tokens_agree"] and result["sampler_tokens_agree"],
        "time per token <= 1.0x": our_time <= their_time,
        "bytes <= gemma's cache": result["jss_bytes"] <= result["gemma_bytes"],
    }
    print("bars: " + ", ".join(f"{name}: {'pass' if ok else 'FAIL'}" for name, ok in bars.items()))
    result["bars"] = bars
    return result


if __name__ == "__main__":
    main()
