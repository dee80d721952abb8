"""Serving 20 world-model sessions under a byte budget that holds 5.

Each session holds a prompt embedding, conditioning K/V rebuilt from it, a
recurrent carry and a growing self-attention K/V cache.  Requests arrive for
random sessions; each runs a few steps of a small flax nnx world model
through ``manager.update`` (a jitted, donating step).  The manager keeps
``cpu:0`` within budget by dropping conditioning K/V (rebuilt on the next
request) and parking the rest in pinned host memory (copied back on the next
request); every event is printed.  At the end one session's rollout is
compared with the same rollout run without a manager: equal bit for bit.

Run:  python examples/serving.py
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_session_state as jss

BATCH, HEADS, HEAD_DIM, PROMPT, CAPACITY = 1, 2, 16, 8, 64
WIDTH = HEADS * HEAD_DIM
SESSIONS, RESIDENT, REQUESTS, STEPS = 20, 5, 40, 4


class WorldModel(nnx.Module):
    """A tiny latent world model: self-attention over its history, cross-attention to the prompt, a carry."""

    def __init__(self, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs)
        self.cond_kv = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.cell = nnx.Linear(3 * WIDTH, WIDTH, rngs=rngs)
        self.out = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def condition(self, prompt: jax.Array) -> jss.KVChunk:
        """Conditioning K/V ``[batch, prompt, heads, head_dim]`` of a prompt embedding."""
        k, v = jnp.split(self.cond_kv(prompt), 2, axis=-1)
        shape = (BATCH, PROMPT, HEADS, HEAD_DIM)
        return jss.KVChunk(k.reshape(shape), v.reshape(shape))

    def __call__(self, session: jss.Session, latent: jax.Array) -> tuple[jss.Session, jax.Array]:
        """One step: write this latent's K/V, attend to history and prompt, update the carry."""
        q, k, v = (x.reshape(BATCH, 1, HEADS, HEAD_DIM) for x in jnp.split(self.qkv(latent), 3, axis=-1))
        session = session.append(kv=(k, v))
        history = _attend(q, session["kv"].view())
        prompt = _attend(q, session["cond"].view())
        h = jnp.tanh(self.cell(jnp.concatenate([session["carry"].view(), history, prompt], axis=-1)))
        return session.commit(carry=h), self.out(h)


def _attend(q: jax.Array, view: jss.KVView) -> jax.Array:
    """One query per row over the visible slots of a head-major view; ``[batch, heads * head_dim]``."""
    scores = jnp.einsum("bhd,bhcd->bhc", q[:, 0], view.k) / np.sqrt(HEAD_DIM)
    scores = jnp.where(view.positions[:, None, :] >= 0, scores, -jnp.inf)
    return jnp.einsum("bhc,bhcd->bhd", jax.nn.softmax(scores, axis=-1), view.v).reshape(BATCH, WIDTH)


model = WorldModel(nnx.Rngs(0))
graphdef, params = nnx.split(model)


@functools.partial(jax.jit, donate_argnums=0)
def rollout(session: jss.Session, params: nnx.State) -> jss.Session:
    """``STEPS`` steps from the session's last latent, each output fed back in; donates the session."""
    world = nnx.merge(graphdef, params)
    latent = session.attrs["latent"]
    for _ in range(STEPS):
        session, latent = world(session, latent)
    return session.with_attrs(latent=latent)


@jax.jit
def _condition(spec: jss.EncodeOnceKV, params: nnx.State, prompt: jax.Array) -> jss.EncodeOnceKV:
    return spec.empty().commit(nnx.merge(graphdef, params).condition(prompt))


def rebuild_condition(session: jss.Session) -> jss.EncodeOnceKV:
    """What the manager calls to rebuild a dropped ``cond`` from the session's prompt embedding."""
    return _condition(session["cond"], params, session["prompt"].view())


def new_session(seed: int) -> jss.Session:
    prompt = jax.random.normal(jax.random.key(seed), (BATCH, PROMPT, WIDTH))
    cond = jss.EncodeOnceKV.allocate(
        batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=PROMPT, recompute_source="prompt"
    )
    return jss.Session(
        objects={
            "prompt": jss.FixedState.allocate(shapes=(BATCH, PROMPT, WIDTH)).commit(prompt),
            "cond": _condition(cond, params, prompt),
            "carry": jss.FixedState.allocate(shapes=(BATCH, WIDTH)),
            "kv": jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=CAPACITY),
        },
        attrs={"latent": jnp.zeros((BATCH, WIDTH))},
    )


def serve_one(session: jss.Session) -> jss.Session:
    """A request: a few steps (what ``manager.update`` runs)."""
    return rollout(session, params)


def show(what: str, events: list[jss.ManagerEvent]) -> None:
    """One line per operation: the manager's events, grouped by kind."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for event in events:
        name = f".{event.object_name}" if event.object_name else ""
        groups[event.kind].append(f"{event.session_id}{name}")
    print(f"{what:28s}" + "; ".join(f"{kind} {' '.join(names)}" for kind, names in groups.items()))
    events.clear()


def main() -> None:
    per_session = new_session(0).nbytes_by_device()["cpu:0"]
    budget = RESIDENT * per_session
    print(f"{SESSIONS} sessions of {per_session:,} bytes; cpu:0 budget {budget:,} (room for {RESIDENT})\n")
    events: list[jss.ManagerEvent] = []
    manager = jss.SessionStateManager(
        byte_budget={"cpu:0": budget}, park_memory_kind="pinned_host", on_event=events.append
    )
    manager.register_rebuild("cond", rebuild_condition)

    unmanaged = new_session(7)  # session 7's rollout, run beside the manager without it
    for sid in range(SESSIONS):
        manager.create(sid, new_session(sid))
        show(f"create session {sid}:", events)
    for request, sid in enumerate(np.random.default_rng(0).integers(0, SESSIONS, REQUESTS)):
        sid = int(sid)
        manager.update(sid, serve_one)
        show(f"request {request:2d} for session {sid}:", events)
        if sid == 7:
            unmanaged = serve_one(unmanaged)
        assert manager.nbytes_by_device()["cpu:0"] <= budget

    stats = manager.stats()
    counters = ("hits", "misses", "evictions", "parks", "restores", "rebuilds", "preemptions", "refusals")
    print("\n" + ", ".join(f"{key} {stats[key]}" for key in counters))
    print("bytes held:", {key: f"{nbytes:,}" for key, nbytes in stats["bytes"].items()})
    whole = sum(not h.parked and not h.dropped for h in manager.held().values())
    print(f"sessions whole on cpu:0: {whole}, partly parked or dropped: {len(manager) - whole}")
    served = manager.get(7)
    show("final lookup of session 7:", events)
    jss.check(served)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(served), jax.tree_util.tree_leaves(unmanaged))
    )
    print(f"session 7 served through the manager equals its unmanaged rollout bit for bit: {same}")
    assert same


if __name__ == "__main__":
    main()
