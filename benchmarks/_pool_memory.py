"""Peak resident memory of a donated pool rollout, measured in a fresh process (see ``benchmarks/pool.py``).

Compiles a rollout of ``steps`` pool steps of the world model (one
``lax.scan`` over :meth:`SessionPool.map`, the pool donated) from shapes
alone, reads the process's resident memory (the baseline), allocates a pool
of ``slots`` sessions whose K/V caches hold ``capacity`` tokens, fills every
slot, runs the rollout, and prints the baseline, the pool's bytes and the
peak (``VmHWM``) as JSON.

Run:  sh -c 'exec python -m benchmarks._pool_memory SLOTS CAPACITY STEPS'
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import jax_session_state as jss
from benchmarks._rollout_memory import _status_bytes
from examples.world_model import (
    WorldModel,
    WorldModelConfig,
    make_session,
    start_session,
)


def main() -> None:
    slots, capacity, steps = (int(arg) for arg in sys.argv[1:4])
    config = WorldModelConfig(capacity=capacity)
    model = WorldModel(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    prompt = jnp.ones((config.batch, config.prompt_tokens, config.d_model))
    context = jnp.zeros((config.context_frames, config.batch, *config.frame_shape))
    actions = jnp.zeros((steps, slots, config.batch, config.action_dim))

    def one(params: nnx.State, session: jss.Session, action: jax.Array) -> tuple[jss.Session, jax.Array]:
        staged, frame = nnx.merge(graphdef, params).step(session, action)
        return staged.commit(), frame

    @functools.partial(jax.jit, donate_argnums=1)
    def rollout(params: nnx.State, pool: jss.SessionPool, actions: jax.Array):
        return jax.lax.scan(lambda p, a: p.map(functools.partial(one, params), a), pool, actions)

    @functools.partial(jax.jit, donate_argnums=0)
    def insert(pool: jss.SessionPool, slot: jax.Array) -> jss.SessionPool:
        return pool.insert(slot, start_session(model, prompt, context))

    shapes = jax.eval_shape(lambda: jss.SessionPool.allocate(make_session(config), slots=slots))
    compiled = rollout.lower(params, shapes, actions).compile()
    insert_compiled = insert.lower(shapes, jnp.int32(0)).compile()
    baseline = _status_bytes("VmRSS")
    pool = jss.SessionPool.allocate(make_session(config), slots=slots)
    for slot in range(slots):
        pool = insert_compiled(pool, jnp.int32(slot))
    pool_bytes = pool.nbytes
    jax.block_until_ready(pool)
    filled = _status_bytes("VmHWM")
    pool, frames = compiled(params, pool, actions)
    jax.block_until_ready((pool, frames))
    pool.check()
    print(json.dumps({
        "baseline": baseline, "pool": pool_bytes, "peak": _status_bytes("VmHWM"), "filled": filled,
        "tokens_written": int(pool.sessions["kv_0"].committed[0, 0]),
    }))


if __name__ == "__main__":
    main()
