"""A short rollout: a session of several kinds, appends, a discarded guess, bytes per device.

Run:  python examples/quickstart.py [--chunks 12]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_session_state as jss

BATCH, HEADS, HEAD_DIM, CHUNK = 1, 4, 16, 8


def make_session() -> jss.Session:
    return jss.Session(
        objects={
            # Self-attention K/V: the first 4 tokens kept for ever, the last 64 in a ring.
            "kv": jss.KVCache.allocate(
                batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, window=64, sink=4, max_staged=CHUNK
            ),
            # Conditioning K/V, written once, recomputable from the prompt embedding.
            "cond": jss.EncodeOnceKV.allocate(
                batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=16, recompute_source="prompt"
            ),
            "prompt": jss.FixedState.allocate(shapes=(BATCH, 16, HEADS * HEAD_DIM)),
            # A recurrent carry and the last 4 latent frames.
            "carry": jss.FixedState.allocate(shapes={"h": (BATCH, 32)}),
            "frames": jss.LatentBuffer.allocate(capacity=4, item_shape=(8, 8), ring=True, max_staged=1),
        },
        attrs={"rng": jax.random.key(0)},
    )


def fake_model(session: jss.Session, rng: jax.Array) -> dict:
    """Stands in for a world model: new K/V rows, a new carry, a new frame."""
    k_rng, v_rng, f_rng = jax.random.split(rng, 3)
    shape = (BATCH, CHUNK, HEADS, HEAD_DIM)
    carry = session["carry"].view()
    frame = jax.random.normal(f_rng, (8, 8))
    return {
        "kv": jss.KVChunk(jax.random.normal(k_rng, shape), jax.random.normal(v_rng, shape)),
        "carry": {"h": jnp.tanh(carry["h"] + frame.mean())},
        "frames": frame,
    }


def step(session: jss.Session) -> jss.Session:
    """One chunk: write the model's outputs and advance the RNG."""
    rng, sub = jax.random.split(session.attrs["rng"])
    return session.append(**fake_model(session, sub)).with_attrs(rng=rng)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=12, help=f"chunks of {CHUNK} tokens to append")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    session = make_session()
    prompt = jax.random.normal(jax.random.key(1), (BATCH, 16, HEADS * HEAD_DIM))
    cond = prompt.reshape(BATCH, 16, HEADS, HEAD_DIM)
    session = session.append(prompt=prompt, cond=jss.KVChunk(cond, cond))

    jitted_step = jax.jit(step, donate_argnums=0)  # writes in place: costs what it writes
    for _ in range(args.chunks):
        session = jitted_step(session)

    # A speculative chunk: staged, looked at, then thrown away.
    guess = fake_model(session, jax.random.key(2))
    speculative = session.stage(kv=guess["kv"], frames=guess["frames"])
    staged_len = int(speculative.view()["kv"].lengths[0])
    session = speculative.discard()
    jss.check(session)  # raises CapacityError if any jitted write had overflowed

    kv = session.view()["kv"]
    print(f"kv: {int(kv.lengths[0])} tokens written, {int((kv.positions[0] >= 0).sum())} slots visible "
          f"(sink 4 + window 64), {staged_len} with the discarded guess")
    print(f"frames: {int(session.view()['frames'].count)} visible of {session['frames'].capacity}")
    print(f"cond written once: {bool(session['cond'].written)}; recomputable from prompt: "
          f"{session.recomputable('cond')}")
    for name, obj in session.objects.items():
        print(f"  {name:7s} {obj.nbytes:>8,d} bytes  {obj.describe()}")
    print("bytes per device:", session.nbytes_by_device())


if __name__ == "__main__":
    main()
