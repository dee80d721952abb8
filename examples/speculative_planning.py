"""Plans actions by the cross-entropy method over speculative branches of one session.

The world model has watched ``--history`` frames of an episode.  Each CEM
iteration branches the session into ``--candidates`` lanes (``session.branch``):
every lane shares the committed history, stored and read once, and stages
its own ``--horizon`` frames as the model rolls its candidate action
sequence forward under ``jax.vmap`` (``Branches.map``); self-attention reads
the shared prefix and the lane's rows by cascade attention.  The lanes are
scored by how close their last predicted frame comes to the goal (the frame
the episode actually reached), the action distribution is refitted to the
best (elite) lanes, and the best sequence found so far is kept as one of the
next iteration's candidates, so the best score never gets worse.  At the end
the best lane is adopted: its frames are committed to the session, the other
lanes dropped.

Run:  python examples/speculative_planning.py [--candidates 64] [--iterations 8] [--horizon 4]
      [--params out/train/world_model.msgpack] [--out out/planning]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import jax_session_state as jss

from world_model import WorldModel, WorldModelConfig, kv_names, load_params, moving_patterns, rollout, start_session


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidates", type=int, default=64, help="lanes per iteration")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--horizon", type=int, default=4, help="frames each lane rolls forward")
    p.add_argument("--elites", type=int, default=8, help="best lanes the distribution is refitted to")
    p.add_argument("--history", type=int, default=64, help="frames the model watches before planning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params", type=Path, default=None, help="weights saved by train_world_model.py")
    p.add_argument("--out", type=Path, default=Path("out/planning"), help="folder for plan.json")
    args = p.parse_args()
    if not 0 < args.elites < args.candidates:
        p.error("--elites must lie between 0 and --candidates.")
    return args


def mib(nbytes: dict[str, int]) -> str:
    return ", ".join(f"{device}: {n / 2**20:.2f} MiB" for device, n in nbytes.items())


def main() -> None:
    args = parse_args()
    config = dataclasses.replace(WorldModelConfig(), lane_frames=args.horizon)
    model = WorldModel(config, rngs=nnx.Rngs(args.seed))
    if args.params is not None:
        load_params(model, args.params)
    graphdef, params = nnx.split(model)

    # The episode: the model watches `history` frames; the goal is where the episode went next.
    key = jax.random.key(args.seed)
    frames, actions = moving_patterns(key, config, args.history + args.horizon, config.batch)
    context = frames[: config.context_frames]
    seen = frames[config.context_frames: config.context_frames + args.history]
    goal = frames[-1]
    prompt = jax.random.normal(jax.random.fold_in(key, 1), (config.batch, config.prompt_tokens, config.d_model))

    @functools.partial(jax.jit, donate_argnums=1)
    def watch(params, session, actions, observed):
        return rollout(nnx.merge(graphdef, params), session, actions, observed)[0]

    session = watch(params, start_session(model, prompt, context), actions[: args.history], seen)
    lane_window = {**{name: args.horizon * config.tokens for name in kv_names(config)}, "frames": args.horizon}

    @jax.jit
    def evaluate(params, session, candidates):
        """Branches ``session`` into one lane per candidate sequence ``[lanes, horizon, batch, action_dim]``."""
        model = nnx.merge(graphdef, params)

        def imagine(lane: jss.Lane, plan: jax.Array):
            for action in plan:  # `horizon` frames, each staged in the lane's own window
                lane, frame = model.step(lane, action)
            return lane, -jnp.mean((frame - goal) ** 2)

        return session.branch(args.candidates, window=lane_window).map(imagine, candidates)

    print(f"session before branching: {mib(session.nbytes_by_device())}")
    shape = (args.horizon, config.batch, config.action_dim)
    mean, std = jnp.zeros(shape), jnp.ones(shape)
    rng = np.random.default_rng(args.seed)
    best_plan, best_score, history = None, -np.inf, []
    bar = tqdm(range(args.iterations), desc="CEM", unit="iteration")
    for iteration in bar:
        candidates = np.clip(mean + std * rng.standard_normal((args.candidates, *shape)), -1, 1)
        if best_plan is not None:
            candidates[0] = best_plan  # elitism: the best so far competes again
        branches, scores = evaluate(params, session, jnp.asarray(candidates, jnp.float32))
        scores = np.asarray(scores)
        if iteration == 0:
            tqdm.write(f"during branching ({args.candidates} lanes x {args.horizon} frames): "
                       f"{mib(branches.nbytes_by_device())} (the history once, plus each lane's window)")
        order = np.argsort(scores)[::-1]
        elites = candidates[order[: args.elites]]
        mean, std = elites.mean(0), np.maximum(elites.std(0), 0.05)
        if scores[order[0]] >= best_score:
            best_plan, best_score = candidates[order[0]], float(scores[order[0]])
            best_lane, best_branches = order[0], branches
        history.append({"iteration": iteration, "best": best_score, "iteration_best": float(scores[order[0]]),
                        "elite_mean": float(scores[order[: args.elites]].mean())})
        bar.set_postfix(best=f"{best_score:.4f}")
        tqdm.write(f"iteration {iteration}: best score {best_score:.4f}, elite mean {history[-1]['elite_mean']:.4f}")
    bar.close()

    own_actions = jnp.broadcast_to(actions[args.history:], (args.candidates, *shape))
    true_score = float(evaluate(params, session, own_actions)[1][0])
    session = jax.jit(lambda branches, lane: branches.adopt(lane))(best_branches, best_lane)
    jss.check(session)
    written = int(session[kv_names(config)[0]].committed[0])
    print(f"best score {best_score:.4f} (the episode's own actions score {true_score:.4f}); "
          f"adopted lane {best_lane}: {written} tokens now committed, {mib(session.nbytes_by_device())}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps({
        "iterations": history, "best_score": best_score, "true_actions_score": true_score,
        "best_plan": np.asarray(best_plan).tolist(), "tokens_committed": written,
    }, indent=1))
    print(f"wrote {args.out / 'plan.json'}")


if __name__ == "__main__":
    main()
