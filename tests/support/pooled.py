"""A small session and a one-session step, shared by the pool tests.

The step draws its K/V rows and query from the session's own RNG key, so
every slot of a pool does different work, and it reads the cache through
``jss.attend``: a slot stepped in a pool must equal the same session
stepped alone.
"""

import jax
import jax.numpy as jnp

import jax_session_state as jss

HEADS, KV_HEADS, DIM, CAPACITY, CHUNK, WIDTH = 4, 2, 8, 48, 3, 6


def new_session(seed: int) -> jss.Session:
    """An empty session whose RNG key is ``seed``'s."""
    return jss.Session(
        objects={
            "kv": jss.KVCache.allocate(batch=1, kv_heads=KV_HEADS, head_dim=DIM, capacity=CAPACITY),
            "carry": jss.FixedState.allocate(shapes=(1, WIDTH)),
            "frames": jss.LatentBuffer.allocate(capacity=4, item_shape=(WIDTH,), ring=True),
        },
        attrs={"rng": jax.random.key(seed), "steps": jnp.zeros((), jnp.int32)},
    )


def step(session: jss.Session, scale: jax.Array) -> tuple[jss.Session, jax.Array]:
    """One step of one session: append random K/V rows, attend, update the carry and frames."""
    rng, k_rows, k_query = jax.random.split(session.attrs["rng"], 3)
    k, v = jax.random.normal(k_rows, (2, 1, CHUNK, KV_HEADS, DIM)) * scale
    session = session.append(kv=jss.KVChunk(k, v))
    q = jax.random.normal(k_query, (1, CHUNK, HEADS, DIM))
    out = jss.attend(q, session["kv"].view())
    carry = jnp.tanh(session["carry"].view() + out.reshape(1, -1)[:, :WIDTH])
    session = session.commit(carry=carry).append(frames=carry[0])
    return session.with_attrs(rng=rng, steps=session.attrs["steps"] + 1), out


def steps_fit(session_steps: int) -> bool:
    """Whether a session may take another step without overflowing its cache."""
    return (session_steps + 1) * CHUNK <= CAPACITY
