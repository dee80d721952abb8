"""Slot arithmetic shared by the kinds that keep a ring of recent entries.

A ring buffer of ``capacity`` slots keeps its first ``sink`` positions for
ever in slots ``0..sink-1`` and every later position ``p`` in slot
``sink + (p - sink) % ring`` with ``ring = capacity - sink``.  An append-mode
buffer (``ring=None``) keeps position ``p`` in slot ``p``.

Staged entries are written in-buffer past the committed ones.  A ring keeps a
margin of slots beyond what a reader may see, so staged entries never
overwrite visible committed ones and ``discard()`` stays O(1).  Each slot
holds the largest position written to it; given the *high-water mark* (one
past the largest position ever written), that is the largest position below
it that maps to the slot.  Positions past a reader's end are discarded
staged entries; readers mask them (and anything else not visible) with -1.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def slot_of(position: Array, *, sink: int, ring: int | None) -> Array:
    """The slot that holds absolute ``position``."""
    if ring is None:
        return position
    return jnp.where(position < sink, position, sink + (position - sink) % ring)


def slot_positions(capacity: int, end: Array, *, sink: int, ring: int | None) -> Array:
    """For each slot, the largest position below ``end`` that maps to it.

    Args:
      capacity: number of slots.
      end: ``Int[Array, "..."]`` the high-water mark (or any bound that only
        the visible positions lie below, within one ring of it).
      sink: slots kept for the first positions.
      ring: ring slots after the sinks; None for append mode.

    Returns:
      ``Int[Array, "... capacity"]``, -1 where no position below ``end`` maps
      to the slot.
    """
    j = jnp.arange(capacity, dtype=jnp.int32)
    end = end[..., None]
    if ring is None:
        return jnp.where(j < end, j, -1)
    back = end - 1 - j  # how far the newest position of this slot lies past j
    position = jnp.where(j < sink, j, j + ring * (back // ring))
    return jnp.where(back >= 0, position, -1)


def visible(position: Array, *, start: Array | int, end: Array, sink: int = 0) -> Array:
    """Mask of positions a reader sees: the sinks and ``[start, end)``."""
    return (position >= 0) & (position < end) & ((position < sink) | (position >= start))
