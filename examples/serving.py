"""Continuous batching: 64 users of a world model served by a 16-slot pool under a byte budget.

Every user holds one session of the world model in ``world_model.py`` (ring
K/V caches, conditioning K/V recomputed from the prompt, a recurrent carry,
recent frames) and wants a rollout of some dozens of frames.  Users arrive
over time and are served in turns: a scheduler checks a waiting user's
session out of the ``SessionStateManager`` into a free slot of a
``SessionPool``, one jitted call steps every live slot at once
(``pool.map``), and after its turn of a few frames the session is checked
back in, mid-rollout, to wait for its next turn -- or leaves when its
rollout is done.  The manager holds the waiting sessions under a ``cpu:0``
budget that fits the pool and a few more sessions: it evicts conditioning
K/V (recomputed at the next checkout) and parks the rest in pinned host
memory.  At the end one user's frames, served this way, are compared with
the same user's rollout stepped alone.

Shows throughput (frames per second), a progress bar, and a plot over time
of the live slots, the bytes held per device and the step time.

Run:  python examples/serving.py [--users 64] [--slots 16] [--frames 24 64] [--turn 4 16]
      [--room 8] [--layers 4] [--seed 0] [--plot out/serving.png]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=64, help="users served, one session each")
    p.add_argument("--slots", type=int, default=16, help="slots of the pool: sessions stepped at once")
    p.add_argument("--frames", type=int, nargs=2, default=(24, 64), metavar=("MIN", "MAX"),
                   help="frames a user's rollout asks for (uniform in [MIN, MAX])")
    p.add_argument("--turn", type=int, nargs=2, default=(4, 16), metavar=("MIN", "MAX"),
                   help="frames a user is stepped per turn before it gives up its slot")
    p.add_argument("--arrivals", type=float, default=4.0, help="users arriving per pool step, on average")
    p.add_argument("--room", type=int, default=8, help="cpu:0 budget beyond the pool, in sessions")
    p.add_argument("--layers", type=int, default=4, help="attention blocks of the world model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=Path("out/serving.png"), help="where to write the plot")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None  # --help prints the flags and exits here

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_session_state as jss  # noqa: E402

from world_model import (  # noqa: E402
    WorldModel,
    WorldModelConfig,
    make_session,
    moving_patterns,
    start_session,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEVICE = jss.device_key(jax.devices()[0])


class Users:
    """Every user's episode (context frames and actions), prompt and how far its rollout has got."""

    def __init__(self, config: WorldModelConfig, args: argparse.Namespace):
        rng = np.random.default_rng(args.seed)
        self.wants = rng.integers(args.frames[0], args.frames[1] + 1, args.users)
        self.turns = rng.integers(args.turn[0], args.turn[1] + 1, args.users)
        key = jax.random.key(args.seed)
        frames, actions = moving_patterns(key, config, int(self.wants.max()), args.users)
        self.context = np.asarray(frames[: config.context_frames])  # [K, users, H, W, C]
        self.actions = np.asarray(actions)  # [steps, users, action_dim]
        prompt_shape = (args.users, config.batch, config.prompt_tokens, config.d_model)
        self.prompts = np.asarray(jax.random.normal(key, prompt_shape))
        self.done = np.zeros(args.users, int)  # frames stepped so far
        self.arrive_at = np.cumsum(rng.exponential(1 / args.arrivals, args.users)).astype(int)

    def action(self, user: int) -> np.ndarray:
        """The action of the user's next frame, ``[batch, action_dim]``."""
        return self.actions[self.done[user], user][None]


def main(args: argparse.Namespace) -> None:
    config = WorldModelConfig(layers=args.layers)
    model = WorldModel(config, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    users = Users(config, args)

    def step(params: nnx.State, session: jss.Session, action: jax.Array) -> tuple[jss.Session, jax.Array]:
        staged, frame = nnx.merge(graphdef, params).step(session, action)
        return staged.commit(), frame

    pool_step = jax.jit(lambda params, pool, actions: pool.map(functools.partial(step, params), actions),
                        donate_argnums=1)
    step_alone = jax.jit(step, donate_argnums=1)
    start = jax.jit(lambda params, prompt, context: start_session(nnx.merge(graphdef, params), prompt, context))

    @jax.jit
    def encode(params: nnx.State, spec: jss.EncodeOnceKV, prompt: jax.Array) -> jss.EncodeOnceKV:
        return spec.empty().commit(nnx.merge(graphdef, params).encode(prompt))

    def new_session(user: int) -> jss.Session:
        return start(params, users.prompts[user], users.context[:, user: user + 1])

    pool = jss.SessionPool.allocate(make_session(config), slots=args.slots)
    one = new_session(0).nbytes_by_device()[DEVICE]
    budget = pool.nbytes_by_device()[DEVICE] + args.room * one
    manager = jss.SessionStateManager(max_sessions=args.users, byte_budget={DEVICE: budget},
                                      park_memory_kind="pinned_host")
    manager.register_recompute("cond", lambda s: encode(params, s["cond"], s["prompt"].view()))
    print(f"{args.users} users, {args.slots} slots; a session is {one / 2**10:.0f} KiB, the pool "
          f"{pool.nbytes / 2**20:.1f} MiB; {DEVICE} budget {budget / 2**20:.1f} MiB "
          f"(the pool and {args.room} sessions)")

    # Warm up: compile the pool step and the slot operations once, on a pool and a manager thrown away.
    warm, scratch = jss.SessionPool.allocate(make_session(config), slots=args.slots), jss.SessionStateManager()
    scratch.create("warm", new_session(0))
    warm = scratch.checkout("warm", warm, 0)
    warm, _ = pool_step(params, warm, jnp.zeros((args.slots, config.batch, config.action_dim)))
    jax.block_until_ready(scratch.checkin("warm", warm, 0))
    del warm, scratch

    waiting: collections.deque[int] = collections.deque()  # users with a session in the manager, in turn order
    in_slot: dict[int, int] = {}  # slot -> user
    turn_left: dict[int, int] = {}  # user -> frames left in this turn
    frames_of = {0: []}  # the watched user's frames, as served
    history = collections.defaultdict(list)
    arrived, served, t = 0, 0, 0
    total = int(users.wants.sum())
    bar = tqdm(total=total, unit="frame", desc="serving")
    clock = time.perf_counter()
    while served < total:
        while arrived < args.users and users.arrive_at[arrived] <= t:  # users joining
            manager.create(arrived, new_session(arrived))
            waiting.append(arrived)
            arrived += 1
        for slot in range(args.slots):  # free slots take the next waiting users
            if slot not in in_slot and waiting:
                user = waiting.popleft()
                pool = manager.checkout(user, pool, slot)
                in_slot[slot], turn_left[user] = user, int(users.turns[user])
        actions = np.zeros((args.slots, config.batch, config.action_dim), np.float32)
        for slot, user in in_slot.items():
            actions[slot] = users.action(user)
        begin = time.perf_counter()
        pool, frames = pool_step(params, pool, jnp.asarray(actions))
        frames = jax.block_until_ready(frames)
        history["step_ms"].append((time.perf_counter() - begin) * 1e3)
        for slot, user in list(in_slot.items()):  # leaving: done, or the turn is over
            if user == 0:
                frames_of[0].append(np.asarray(frames[slot]))
            users.done[user] += 1
            turn_left[user] -= 1
            if users.done[user] == users.wants[user] or turn_left[user] == 0:
                pool = manager.checkin(user, pool, slot)
                del in_slot[slot]
                if users.done[user] < users.wants[user]:
                    waiting.append(user)
                elif user != 0:
                    manager.release(user)  # its rollout is done
        bytes_now = manager.nbytes_by_device()
        history["live"].append(len(in_slot))
        history["waiting"].append(len(waiting))
        for key in (DEVICE, f"{DEVICE}/pinned_host"):
            history[key].append(bytes_now.get(key, 0) / 2**20)
        assert bytes_now.get(DEVICE, 0) <= budget
        served = int(users.done.sum())
        bar.update(served - bar.n)
        t += 1
    seconds = time.perf_counter() - clock
    bar.close()
    pool.check()

    stats = manager.stats()
    print(f"\nserved {total} frames to {args.users} users in {t} pool steps, {seconds:.2f} s: "
          f"{total / seconds:,.0f} frames/s ({np.mean(history['live']):.1f} slots live per step on average)")
    print(", ".join(f"{key} {stats[key]}" for key in ("parks", "restores", "evictions", "recomputes", "preemptions")))

    alone = new_session(0)
    frames_alone = []
    for f in range(int(users.wants[0])):
        alone, frame = step_alone(params, alone, jnp.asarray(users.actions[f, 0][None]))
        frames_alone.append(np.asarray(frame))
    served_frames, alone_frames = np.stack(frames_of[0]), np.stack(frames_alone)
    error = float(np.max(np.abs(served_frames - alone_frames)) / np.max(np.abs(alone_frames)))
    same = error <= 1e-5
    print(f"user 0's {len(served_frames)} frames, served in turns through the pool, equal its rollout alone: "
          f"{same} (max relative difference {error:.1e})")
    plot(history, args.plot, budget)
    print(f"wrote {args.plot}")
    assert same


def plot(history: dict[str, list[float]], path: Path, budget: int) -> None:
    """Live slots, bytes per device and step time against the pool step."""
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(history["live"], label="live slots")
    axes[0].plot(history["waiting"], label="users waiting in the manager")
    axes[0].set_ylabel("sessions")
    axes[0].legend()
    for key, values in history.items():
        if key.startswith(DEVICE):
            axes[1].plot(values, label=key)
    axes[1].axhline(budget / 2**20, color="grey", linestyle="--", label=f"{DEVICE} budget")
    axes[1].set_ylabel("MiB held by the manager")
    axes[1].legend()
    axes[2].plot(history["step_ms"])
    axes[2].set_ylabel("pool step (ms)")
    axes[2].set_xlabel("pool step")
    fig.suptitle("Continuous batching: a SessionPool fed by a SessionStateManager")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(ARGS)
