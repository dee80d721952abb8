"""Mapping pages of a ``PagedKVCache`` that already hold a prefix into a free slot, and holding pages.

Pure, jittable functions over a cache (each returns the new cache) for the
prefix index of :mod:`jax_session_state.reuse`: it holds a reference to every
page it indexes (:func:`hold`), maps a run of them into a new slot
(:func:`map_pages`: reference counts up, no row copied) and lets go
(:func:`drop`: pages no one refers to any more go back to the free list).
A mapped page is full of committed rows, so the slot's next rows land in
pages taken fresh: a shared page is never written (the copy-on-write rule of
``fork``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax import Array

from jax_session_state.building_blocks import refuse_now_if
from jax_session_state.errors import PayloadError
from jax_session_state.objects import _pages

if TYPE_CHECKING:
    from jax_session_state.objects.paged import PagedKVCache


def _pages_valid(cache: PagedKVCache, pages: Array, use: Array) -> Array:
    """Whether every used entry names a page someone holds (a page on the free list may be reused)."""
    in_range = (pages >= 0) & (pages < cache.num_pages)
    held = cache.refcounts[jnp.clip(pages, 0, cache.num_pages - 1)] > 0
    return ~jnp.any(use & ~(in_range & held))


def map_pages(cache: PagedKVCache, slot: int | Array, pages: Array, count: int | Array) -> PagedKVCache:
    """Free slot ``slot`` refers to the first ``count`` of ``pages``: ``count * page_size`` committed rows.

    Args:
      cache: the cache.
      slot: a slot holding no pages.
      pages: ``Int[Array, "max_pages_per_slot"]`` page ids, the first
        ``count`` in row order (the rest ignored); each must be held (its
        reference count above 0) and full.
      count: how many pages to map, in ``[0, max_pages_per_slot]``.

    Returns:
      The cache with the slot mapped; refused (nothing changed, ``overflowed``
      set; eagerly: raised) when the slot holds pages or a page is not held.
    """
    cache._require_resident("map_pages")
    slot, bad_slot = cache._slot("map_pages", "slot", slot)
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (cache.max_pages_per_slot,):
        raise PayloadError(
            f"{cache.describe()}.map_pages: pages must have shape [{cache.max_pages_per_slot}] "
            f"(max_pages_per_slot); got {list(pages.shape)}."
        )
    count = jnp.asarray(count, jnp.int32)
    use = jnp.arange(cache.max_pages_per_slot) < count
    occupied = (cache.page_table[slot, 0] >= 0) | (cache.staged[slot] > 0)
    bad = (count < 0) | (count > cache.max_pages_per_slot) | ~_pages_valid(cache, pages, use)
    refuse_now_if(occupied, lambda: PayloadError(
        f"{cache.describe()}.map_pages: slot {int(slot)} holds pages; map a prefix only into a free slot."))
    refuse_now_if(bad, lambda: PayloadError(
        f"{cache.describe()}.map_pages: {int(count)} pages {np.asarray(pages).tolist()} must each be held "
        f"(reference count > 0) and count within [0, {cache.max_pages_per_slot}]."))
    row = jnp.where(use, pages, -1)
    new = cache.with_storage(
        page_table=cache.page_table.at[slot].set(row),
        committed=cache.committed.at[slot].set(count * cache.page_size),
        refcounts=_pages.referenced(cache.refcounts, pages, use),
    )
    return cache._unless(bad_slot | occupied | bad, new)


def hold(cache: PagedKVCache, pages: Array) -> PagedKVCache:
    """One more reference to each page of ``pages`` (``Int[Array, "n"]``; -1 entries ignored); each must be held."""
    pages, use, bad = _held_pages(cache, "hold", pages)
    new = cache.with_storage(refcounts=_pages.referenced(cache.refcounts, pages, use))
    return cache._unless(bad, new)


def drop(cache: PagedKVCache, pages: Array) -> PagedKVCache:
    """One reference fewer to each page of ``pages`` (distinct ids; -1 ignored); unreferenced pages are freed."""
    pages, _, bad = _held_pages(cache, "drop", pages)
    return cache._unless(bad, cache.with_storage(**_pages.unreference(cache, pages)))


def _held_pages(cache: PagedKVCache, operation: str, pages: Array) -> tuple[Array, Array, Array]:
    """``pages`` as int32, which entries are ids (not -1), and whether one of those is not held (raised at once
    eagerly)."""
    cache._require_resident(operation)
    pages = jnp.asarray(pages, jnp.int32)
    use = pages >= 0
    bad = ~_pages_valid(cache, pages, use)
    refuse_now_if(bad, lambda: PayloadError(
        f"{cache.describe()}.{operation}: pages {np.asarray(pages).tolist()} must each be held (reference count > 0)."))
    return pages, use, bad
