"""The pure-JAX attention readers under ``jax.vmap`` over independent caches (a pool's slots).

A reader loops over key blocks up to the longest row's valid length.  Under
a plain ``vmap`` over caches with their own lengths, that trip count is
batched: the loop runs every slot to the longest slot's count and its block
index, batched too, turns every block read into a gather.  :func:`fold_slots`
gives a reader a batching rule instead.  When every cache operand is
batched:

- the slots are folded into the batch axis (reshapes), so the block index
  stays one scalar and every block read is one slice of the stacked cache;
- when their lengths are so ragged that running every slot to the longest
  costs more than it saves, the slots are read one after another, each to
  its own block count, straight from the stacked cache (no copy of a slot).

:func:`cheapest_reading` picks one at run time (``lax.switch``) from the
slots' block counts, so one compiled step serves every mix of lengths.

Lanes that share one cache (queries batched, no cache operand) become more
query rows of one call, as in the native kernel's rule, so the cache is read
once for all lanes and a ``vmap`` outside (a pool of sessions that branch)
still meets this rule; a cache only partly batched is the reader under
plain ``vmap``.

Derivatives are the reader's own (``jax.custom_jvp``: forward mode is
``jax.jvp`` of the reader, reverse mode transposes it), so ``jax.grad``
works wherever it works through the reader itself.  The readers of a float
append-mode cache are wrapped in a ``jax.custom_vjp`` outside this rule
(``_append._float_append``): the loop's traced trip count, and buckets
switched by a batched index, do not transpose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

__all__ = [
    "APART",
    "LOOP_OVERHEAD",
    "TOGETHER",
    "cheapest_reading",
    "fold_rows",
    "fold_slots",
]

Cache = dict[str, Array]
"""Per-row operands of a reader, each with a leading batch axis (K, V, lengths...)."""

Reader = Callable[[Array, Array, Cache, Any], tuple[Array, Array]]
"""``reader(q, q_positions, cache, row) -> (out, lse)``; with ``row`` (a traced int)
it reads only the ``q.shape[0]`` cache rows from ``row`` on, else every row."""

LOOP_OVERHEAD = 0.25
"""The cost of one loop iteration, and of starting one slot's loop, in units
of one slot's block of work (measured on XLA:CPU with 16 slots of the
example world model's heads: about 0.17 and 0.13; a slot's block costs
nearly the same folded or alone, so folding pays only for even lengths)."""

TOGETHER, APART = 0, 1
"""How :func:`fold_slots` reads stacked caches: one loop over the folded slots, or slot by slot."""


def cheapest_reading(per_slot_blocks: Array) -> Array:
    """Which reading of stacked caches costs least: :data:`TOGETHER` or :data:`APART`.

    A folded loop of ``max`` iterations reads ``S`` slots' blocks each time;
    slot by slot costs ``sum`` iterations of one slot's block, plus one loop
    per slot; each iteration also pays :data:`LOOP_OVERHEAD`.
    """
    slots = per_slot_blocks.shape[0]
    blocks = per_slot_blocks.astype(jnp.float32)
    costs = [jnp.max(blocks) * (slots + LOOP_OVERHEAD), jnp.sum(blocks) * (1 + LOOP_OVERHEAD) + slots * LOOP_OVERHEAD]
    return jnp.argmin(jnp.stack(costs)).astype(jnp.int32)


def fold_rows(x: Array) -> Array:
    """``[slots, batch, ...]`` -> ``[slots * batch, ...]``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def fold_slots(
    reader: Reader,
    blocks: Callable[[Cache], Array],
    *,
    fold: Callable[[Cache, int], Cache] | None = None,
) -> Callable[[Array, Array, Cache], tuple[Array, Array]]:
    """``reader`` as ``f(q, q_positions, cache) -> (out, lse)`` with the batching rule above.

    Args:
      reader: the blockwise reader (see :data:`Reader`).
      blocks: ``Int[Array, "batch"]`` the blocks each row of a (folded)
        cache needs.
      fold: stacked cache operands and the number of slots -> one cache of
        ``slots * batch`` rows; default: merge the two leading axes of each.
    """
    fold = fold or (lambda cache, slots: jax.tree_util.tree_map(fold_rows, cache))

    @jax.custom_batching.custom_vmap
    def primal(q: Array, q_positions: Array, cache: Cache) -> tuple[Array, Array]:
        return reader(q, q_positions, cache, None)

    @primal.def_vmap
    def rule(slots: int, batched: Any, q: Array, q_positions: Array, cache: Cache) -> Any:
        q_batched, positions_batched, cache_batched = batched
        q = q if q_batched else jnp.broadcast_to(q, (slots, *q.shape))
        q_positions = q_positions if positions_batched else jnp.broadcast_to(q_positions, (slots, *q_positions.shape))
        batch, T = q.shape[1:3]
        if not any(jax.tree_util.tree_leaves(cache_batched)):  # lanes sharing one cache: more query rows

            def rows(x: Array) -> Array:
                return jnp.moveaxis(x, 0, 1).reshape(batch, slots * T, *x.shape[3:])

            def lanes_back(x: Array) -> Array:
                return jnp.moveaxis(x.reshape(batch, slots, T, *x.shape[2:]), 1, 0)

            out, lse = primal(rows(q), rows(q_positions), cache)
            return (lanes_back(out), lanes_back(lse)), (True, True)
        if not all(jax.tree_util.tree_leaves(cache_batched)):
            axes = jax.tree_util.tree_map(lambda b: 0 if b else None, cache_batched)
            return jax.vmap(lambda q, p, c: reader(q, p, c, None), in_axes=(0, 0, axes))(q, q_positions, cache), \
                (True, True)
        stacked = fold(cache, slots)
        per_slot = jnp.max(blocks(stacked).reshape(slots, batch), axis=1)

        def folded(inner: Callable[..., tuple[Array, Array]]) -> Callable[[], tuple[Array, Array]]:
            def read() -> tuple[Array, Array]:
                out, lse = inner(fold_rows(q), fold_rows(q_positions), stacked)
                return out.reshape(q.shape), lse.reshape(q.shape[:4])

            return read

        def apart() -> tuple[Array, Array]:
            def one(args: tuple[Array, Array, Array]) -> tuple[Array, Array]:
                q_slot, positions_slot, slot = args
                return reader(q_slot, positions_slot, stacked, slot * batch)

            return lax.map(one, (q, q_positions, jnp.arange(slots, dtype=jnp.int32)))

        together = folded(primal)  # the folded reader keeps a batching rule, for a vmap outside this one
        if slots == 1:
            return together(), (True, True)
        return lax.switch(cheapest_reading(per_slot), [together, apart]), (True, True)

    @jax.custom_jvp
    def attend(q: Array, q_positions: Array, cache: Cache) -> tuple[Array, Array]:
        return primal(q, q_positions, cache)

    @attend.defjvp
    def attend_jvp(primals: tuple, tangents: tuple) -> tuple:
        return jax.jvp(lambda q, p, c: reader(q, p, c, None), primals, tangents)

    return attend
