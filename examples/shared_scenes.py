"""Users who share scenes: each scene's conditioning encoded once and read by every session that starts from it.

Every user holds one session of the world model in ``world_model.py`` (ring
K/V caches, a recurrent carry, recent frames) and starts from one of a few
scenes: a long run of scene tokens that a scene encoder (an nnx MLP over
token embeddings) turns into the prompt embedding the model cross-attends
to.  With reuse, the conditioning K/V of a scene lives in a
``jss.SharedStore`` under its content key (the scene's tokens and the
encoders' weights): the first user of a scene
encodes it, every later one maps the same buffers into its session, and each
user's rollout is a jitted step built with ``jss.donate_unshared`` (the
session donated, the shared conditioning not).  Without reuse, every user
encodes and holds its own copy.  Both serve the same users, one after the
other, and every user's frames must be equal bit for bit.

Prints, with and without reuse: the conditioning bytes held, the encodes, and
the median time to first frame (a user's arrival to its first predicted
frame: the conditioning looked up or encoded, the session built, one step).

Run:  python examples/shared_scenes.py [--users 64] [--scenes 4] [--prompt-tokens 4096] [--frames 8]
      [--encoder-layers 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=64, help="users served, one session each")
    p.add_argument("--scenes", type=int, default=4, help="distinct scenes the users start from")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of a scene's conditioning")
    p.add_argument("--frames", type=int, default=8, help="frames each user rolls out")
    p.add_argument("--encoder-layers", type=int, default=4, help="MLP layers of the scene encoder")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None  # --help prints the flags and exits here

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jax_session_state as jss  # noqa: E402

from world_model import WorldModel, WorldModelConfig, make_session, moving_patterns, rollout  # noqa: E402

VOCABULARY = 1024


class SceneEncoder(nnx.Module):
    """Scene tokens ``[1, prompt_tokens]`` to the prompt embedding ``[1, prompt_tokens, d_model]``: an embedding
    and a residual MLP stack, the costly part of starting a session from a scene."""

    def __init__(self, d_model: int, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCABULARY, d_model, rngs=rngs)
        self.layers = nnx.List([nnx.Sequential(nnx.LayerNorm(d_model, rngs=rngs), nnx.Linear(d_model, 4 * d_model,
                                               rngs=rngs), jax.nn.gelu, nnx.Linear(4 * d_model, d_model, rngs=rngs))
                                for _ in range(layers)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return x


def encoder_identity(*modules: nnx.Module) -> str:
    """The encoders' name and a digest of their weights: other weights never match a key."""
    weights = [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(modules))]
    return "shared_scenes.encode@" + jss.content_key(*weights, identity="weights")[:16]


def user_session(config: WorldModelConfig, cond: jss.EncodeOnceKV, context: jax.Array) -> jss.Session:
    """A user's session around conditioning ``cond`` (its own or shared): the model's objects but the prompt."""
    objects = {name: obj for name, obj in make_session(config).objects.items() if name not in ("cond", "prompt")}
    return jss.Session(objects={**objects, "cond": cond}).append(frames=context)


def serve(model: WorldModel, scene_encoder: SceneEncoder, scenes: list[np.ndarray],
          users: list[tuple[int, jax.Array, jax.Array]], *, shared: bool) -> dict:
    """Serves every user in turn, with or without reuse: frames, bytes of conditioning, encodes, times."""
    config = model.config
    spec = jss.EncodeOnceKV.allocate(batch=1, kv_heads=config.kv_heads, head_dim=config.head_dim,
                                     capacity=config.prompt_tokens)
    encode = jax.jit(lambda tokens: spec.empty().commit(model.encode(scene_encoder(tokens))))
    encodes = 0

    def encoded(scene: int) -> jss.EncodeOnceKV:
        nonlocal encodes
        encodes += 1
        return jax.block_until_ready(encode(scenes[scene]))

    step = (jss.donate_unshared(lambda s, a: rollout(model, s, a), shared=["cond"]) if shared else
            jax.jit(lambda s, a: rollout(model, s, a), donate_argnums=0))
    store = jss.SharedStore(jss.SessionStateManager(max_sessions=len(scenes) + 1))
    identity = encoder_identity(scene_encoder, model.cond_k, model.cond_v)
    keys = [jss.content_key(tokens, identity=identity) for tokens in scenes]
    warm = user_session(config, encode(scenes[0]), users[0][1])  # compile both steps before timing
    jax.block_until_ready(step(step(warm, users[0][2][:1])[0], users[0][2][1:]))
    conds, frames, first = [], [], []
    for user, (scene, context, actions) in enumerate(users):
        arrived = time.perf_counter()
        if shared:
            cond = store.acquire(keys[scene], user, lambda scene=scene: encoded(scene))
        else:
            cond = encoded(scene)
        session, head = step(user_session(config, cond, context), actions[:1])
        jax.block_until_ready(head)
        first.append(time.perf_counter() - arrived)
        session, rest = step(session, actions[1:])
        frames.append(np.concatenate([np.asarray(head), np.asarray(rest)]))
        conds.append(session["cond"])
    seen = jss.SeenStorages()
    held = sum(sum(cond.nbytes_by_device(seen).values()) for cond in conds)  # a shared buffer counts once
    return {"frames": frames, "held": held, "one": conds[0].nbytes, "encodes": encodes,
            "first_ms": 1e3 * float(np.median(first)), "store": store.stats() if shared else None}


def main(args: argparse.Namespace) -> None:
    config = WorldModelConfig(prompt_tokens=args.prompt_tokens, window=64, sink=4)
    model = WorldModel(config, rngs=nnx.Rngs(args.seed))
    key = jax.random.key(args.seed)
    scene_encoder = SceneEncoder(config.d_model, args.encoder_layers, nnx.Rngs(args.seed + 1))
    rng = np.random.default_rng(args.seed)
    scenes = [rng.integers(VOCABULARY, size=(1, config.prompt_tokens), dtype=np.int32) for _ in range(args.scenes)]
    users = []
    for user in range(args.users):
        frames, actions = moving_patterns(jax.random.fold_in(key, 1000 + user), config, args.frames, 1)
        users.append((int(rng.integers(args.scenes)), frames[: config.context_frames], actions))
    print(f"{args.users} users over {args.scenes} scenes of {config.prompt_tokens} conditioning tokens, "
          f"{args.frames} frames each")
    results = {name: serve(model, scene_encoder, scenes, users, shared=name == "shared")
               for name in ("own copy", "shared")}
    mib = 2**20
    for name, r in results.items():
        print(f"{name:>9}: conditioning held {r['held'] / mib:8.2f} MiB ({r['held'] / r['one']:5.2f} x one copy), "
              f"{r['encodes']:3d} encodes, median time to first frame {r['first_ms']:7.2f} ms")
    equal = all(np.array_equal(a, b) for a, b in zip(results["own copy"]["frames"], results["shared"]["frames"]))
    store = results["shared"]["store"]
    print(f"store: {store['hits']} hits, {store['misses']} misses, "
          f"{store['bytes_saved'].get('cpu:0', 0) / mib:.2f} MiB saved on cpu:0")
    print(f"every user's frames equal with and without reuse: {'yes' if equal else 'NO'}")
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main(ARGS)
