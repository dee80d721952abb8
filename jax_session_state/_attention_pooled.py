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
  costs more than it saves (:func:`read_slot_by_slot`), the slots are read one
  after another, each to its own block count, straight from the stacked
  cache (no copy of a slot).  The choice is made at run time (``lax.cond``)
  from the slots' block counts, so one compiled step serves both.

Anything else (lanes that share one cache, a cache only partly batched) is
the reader under plain ``vmap``, where the loop index stays unbatched.

Derivatives are the reader's own (``jax.custom_jvp``: forward mode is
``jax.jvp`` of the reader, reverse mode transposes it), so ``jax.grad``
works wherever it works through the reader itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

__all__ = ["LOOP_OVERHEAD", "fold_slots", "read_slot_by_slot"]

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


def read_slot_by_slot(per_slot_blocks: Array) -> Array:
    """Whether reading the slots one by one beats one loop to the longest slot's block count.

    A folded loop of ``max`` iterations reads ``S`` slots' blocks each time;
    slot by slot costs ``sum`` iterations of one slot's block, plus one
    loop per slot.  Each iteration also pays :data:`LOOP_OVERHEAD`.
    """
    slots = per_slot_blocks.shape[0]
    blocks = per_slot_blocks.astype(jnp.float32)
    together = jnp.max(blocks) * (slots + LOOP_OVERHEAD)
    apart = jnp.sum(blocks) * (1 + LOOP_OVERHEAD) + slots * LOOP_OVERHEAD
    return apart < together


def fold_rows(x: Array) -> Array:
    """``[slots, batch, ...]`` -> ``[slots * batch, ...]``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def fold_slots(
    reader: Reader,
    blocks: Callable[[Cache], Array],
    *,
    fold: Callable[[Cache, int], Cache] | None = None,
    unbatched: Reader | None = None,
) -> Callable[[Array, Array, Cache], tuple[Array, Array]]:
    """``reader`` as ``f(q, q_positions, cache) -> (out, lse)`` with the batching rule above.

    Args:
      reader: the blockwise reader (see :data:`Reader`).
      blocks: ``Int[Array, "batch"]`` the blocks each row of a (folded)
        cache needs.
      fold: stacked cache operands and the number of slots -> one cache of
        ``slots * batch`` rows; default: merge the two leading axes of each.
      unbatched: what runs outside ``vmap`` (default ``reader``), e.g. one
        dense pass where a loop pays off only for many slots.
    """
    fold = fold or (lambda cache, slots: jax.tree_util.tree_map(fold_rows, cache))
    outside = unbatched or reader

    @jax.custom_batching.custom_vmap
    def primal(q: Array, q_positions: Array, cache: Cache) -> tuple[Array, Array]:
        return outside(q, q_positions, cache, None)

    @primal.def_vmap
    def rule(slots: int, batched: Any, q: Array, q_positions: Array, cache: Cache) -> Any:
        q_batched, positions_batched, cache_batched = batched
        if not all(jax.tree_util.tree_leaves(cache_batched)):
            axes = (0 if q_batched else None, 0 if positions_batched else None,
                    jax.tree_util.tree_map(lambda b: 0 if b else None, cache_batched))
            return jax.vmap(lambda q, p, c: outside(q, p, c, None), in_axes=axes)(q, q_positions, cache), (True, True)
        q = q if q_batched else jnp.broadcast_to(q, (slots, *q.shape))
        q_positions = q_positions if positions_batched else jnp.broadcast_to(q_positions, (slots, *q_positions.shape))
        batch = q.shape[1]
        stacked = fold(cache, slots)
        per_slot = jnp.max(blocks(stacked).reshape(slots, batch), axis=1)

        def together() -> tuple[Array, Array]:
            # The folded reader keeps this rule, for a vmap outside this one.
            inner = primal if unbatched is None else fold_slots(reader, blocks, fold=fold)
            out, lse = inner(fold_rows(q), fold_rows(q_positions), stacked)
            return out.reshape(q.shape), lse.reshape(q.shape[:4])

        def apart() -> tuple[Array, Array]:
            def one(args: tuple[Array, Array, Array]) -> tuple[Array, Array]:
                q_slot, positions_slot, slot = args
                return reader(q_slot, positions_slot, stacked, slot * batch)

            return lax.map(one, (q, q_positions, jnp.arange(slots, dtype=jnp.int32)))

        if slots == 1:
            return together(), (True, True)
        return lax.cond(read_slot_by_slot(per_slot), apart, together), (True, True)

    @jax.custom_jvp
    def attend(q: Array, q_positions: Array, cache: Cache) -> tuple[Array, Array]:
        return primal(q, q_positions, cache)

    @attend.defjvp
    def attend_jvp(primals: tuple, tangents: tuple) -> tuple:
        return jax.jvp(lambda q, p, c: outside(q, p, c, None), primals, tangents)

    return attend
