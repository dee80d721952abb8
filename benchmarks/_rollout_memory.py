"""Peak resident memory of a donated rollout, measured in a fresh process (see ``benchmarks/rollout.py``).

Compiles the world model's rollout from shapes alone, reads the process's
resident memory (the baseline), allocates a session whose K/V caches hold
``capacity`` tokens, runs the donated rollout, and prints the baseline, the
session's bytes and the peak (``VmHWM``) as JSON.

Run:  sh -c 'exec python -m benchmarks._rollout_memory CAPACITY STEPS'
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import jax_session_state as jss
from examples.world_model import WorldModel, WorldModelConfig, rollout, start_session


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    capacity, steps = int(sys.argv[1]), int(sys.argv[2])
    config = WorldModelConfig(capacity=capacity)
    model = WorldModel(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    prompt = jnp.ones((config.batch, config.prompt_tokens, config.d_model))
    context = jnp.zeros((config.context_frames, config.batch, *config.frame_shape))
    actions = jnp.zeros((steps, config.batch, config.action_dim))

    @functools.partial(jax.jit, donate_argnums=1)
    def run(params, session, actions):
        return rollout(nnx.merge(graphdef, params), session, actions)

    shapes = jax.eval_shape(lambda: start_session(model, prompt, context))
    compiled = run.lower(params, shapes, actions).compile()
    baseline = _status_bytes("VmRSS")
    session = start_session(model, prompt, context)
    session_bytes = session.nbytes
    session, frames = compiled(params, session, actions)
    jax.block_until_ready((session, frames))
    jss.check(session)
    print(json.dumps({
        "baseline": baseline, "session": session_bytes, "peak": _status_bytes("VmHWM"),
        "tokens_written": int(session["kv_0"].committed[0]),
    }))


if __name__ == "__main__":
    main()
