"""A small world-model session for the manager's tests.

Objects: ``prompt`` (a FixedState prompt embedding, not recomputable),
``cond`` (conditioning K/V recomputed from the prompt), ``carry`` (a FixedState
recurrent carry, not recomputable) and ``kv`` (a growing KVCache); attrs hold a
step counter.  ``step`` is a jitted, donating rollout step.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss

B, H, D, PROMPT = 1, 2, 4, 6
TRACES: collections.Counter = collections.Counter()


@jax.jit
def encode(prompt: jax.Array) -> jss.KVChunk:
    """Conditioning K/V of a prompt embedding ``[B, PROMPT, H * D]``."""
    k = prompt.reshape(B, PROMPT, H, D)
    return jss.KVChunk(k, jnp.tanh(k))


@jax.jit
def _encoded(spec: jss.EncodeOnceKV, prompt: jax.Array) -> jss.EncodeOnceKV:
    return spec.empty().commit(encode(prompt))


def recompute_cond(session: jss.Session) -> jss.EncodeOnceKV:
    """Recomputes ``cond`` from the resident prompt (what ``register_recompute`` takes)."""
    return _encoded(session["cond"], session["prompt"].view())


def make_session(seed: int, *, capacity: int = 16, tokens: int = 3) -> jss.Session:
    """A session holding random data (never zeros), ``tokens`` rows in a K/V of ``capacity``."""
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.normal(size=(B, PROMPT, H * D)), jnp.float32)
    k_rows, v_rows = (jnp.asarray(rng.normal(size=(B, tokens, H, D)), jnp.float32) for _ in range(2))
    return jss.Session(
        objects={
            "prompt": jss.FixedState.allocate(shapes=(B, PROMPT, H * D)).commit(prompt),
            "cond": jss.EncodeOnceKV.allocate(
                batch=B, kv_heads=H, head_dim=D, capacity=PROMPT, recompute_source="prompt", recompute_cost=1.0
            ).commit(encode(prompt)),
            "carry": jss.FixedState.allocate(shapes={"h": (B, 8)}).commit(
                {"h": jnp.asarray(rng.normal(size=(B, 8)), jnp.float32)}
            ),
            "kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=capacity).append((k_rows, v_rows)),
        },
        attrs={"step": jnp.asarray(seed, jnp.int32)},
    )


def _visible_mean(view: jss.KVView) -> tuple[jax.Array, jax.Array]:
    """Per head and dim, the mean K and V ``[B, H * D]`` over the positions ``view`` shows."""
    shown = (view.positions >= 0)[:, None, :, None]
    count = jnp.maximum(shown.sum(axis=2), 1)
    k, v = ((jnp.where(shown, x, 0).sum(axis=2) / count).reshape(B, H * D) for x in (view.k, view.v))
    return k, v


def _step(session: jss.Session) -> jss.Session:
    # Every head and dim gets its own value, and V is not K, so a write, park, restore or recompute
    # that permutes heads or dims or swaps K and V changes what the rollout computes.
    TRACES[session["kv"].capacity] += 1
    cond_k, cond_v = _visible_mean(session["cond"].view())
    kv_k, kv_v = _visible_mean(session["kv"].view())
    h = jnp.tanh(session["carry"].view()["h"] + cond_k + 0.5 * cond_v)
    k = (h + 0.5 * kv_k - 0.25 * kv_v).reshape(B, 1, H, D)
    v = 1.5 * jnp.tanh(k) - 0.5 * kv_v.reshape(B, 1, H, D)
    session = session.append(kv=(k, v), carry={"h": h})
    return session.with_attrs(step=session.attrs["step"] + 1)


step = jax.jit(_step, donate_argnums=0)
"""One rollout step: a K/V row (its own value per head and dim, V not K) and a new carry; donates the session."""


def contents(tree: object) -> dict[str, np.ndarray]:
    """Every array of ``tree`` as numpy, by path: equal contents are equal bit for bit."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def assert_same(a: object, b: object) -> None:
    """``a`` and ``b`` hold the same arrays, bit for bit, with the same shardings."""
    left, right = contents(a), contents(b)
    assert left.keys() == right.keys()
    for key in left:
        assert left[key].dtype == right[key].dtype and left[key].tobytes() == right[key].tobytes(), key
    shardings = [getattr(x, "sharding", None) for x in jax.tree_util.tree_leaves(a)]
    assert shardings == [getattr(x, "sharding", None) for x in jax.tree_util.tree_leaves(b)]


def session_bytes(seed: int = 0, **kw: int) -> dict[str, int]:
    """Bytes by device key of one session made by :func:`make_session`, and of each object."""
    session = make_session(seed, **kw)
    return {"session": session.nbytes, **{name: obj.nbytes for name, obj in session.objects.items()}}
