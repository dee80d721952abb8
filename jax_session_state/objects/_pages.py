"""Page bookkeeping of ``PagedKVCache``: the free list, reference counts and page copies.

Pure functions over a cache's storage arrays, each returning the storage
fields it changes (for ``with_storage``).  The free list is a stack: its first
``free_count`` entries are the free pages, the top one taken first.  A page
index of ``num_pages`` (one past the last) is the "no page" index: writes to it
are dropped, so a refused or masked operation writes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import Array

from jax_session_state._core import _writes

if TYPE_CHECKING:
    from jax_session_state.objects.paged import PagedKVCache


def take(cache: PagedKVCache, need: Array) -> dict[str, Array]:
    """Pops a free page into every page-table entry where ``need`` (row-major order).

    Args:
      cache: the cache; the caller has checked that enough pages are free.
      need: ``Bool[Array, "max_slots max_pages_per_slot"]`` the entries to fill.
    """
    rank = jnp.cumsum(need.ravel()).reshape(need.shape) - 1
    top = jnp.clip(cache.free_count - 1 - rank, 0, cache.num_pages - 1)
    ids = cache.free_pages[top]
    return {
        "page_table": jnp.where(need, ids, cache.page_table),
        "refcounts": cache.refcounts.at[jnp.where(need, ids, cache.num_pages)].set(1, mode="drop"),
        "free_count": cache.free_count - need.sum(dtype=jnp.int32),
    }


def referenced(refcounts: Array, pages: Array, use: Array) -> Array:
    """``refcounts`` with one more reference to each page of ``pages`` where ``use`` (distinct ids)."""
    return refcounts.at[jnp.where(use, pages, refcounts.shape[0])].add(1, mode="drop")


def unreference(cache: PagedKVCache, pages: Array) -> dict[str, Array]:
    """One reference fewer to each of ``pages`` (distinct ids, -1 entries ignored); the pages left unreferenced
    pushed on the free list."""
    held = pages >= 0
    refcounts = cache.refcounts.at[jnp.where(held, pages, cache.num_pages)].add(-1, mode="drop")
    freed = held & (refcounts[jnp.clip(pages, 0, cache.num_pages - 1)] == 0)
    top = cache.free_count + jnp.cumsum(freed) - 1
    return {
        "refcounts": refcounts,
        "free_pages": cache.free_pages.at[jnp.where(freed, top, cache.num_pages)].set(pages, mode="drop"),
        "free_count": cache.free_count + freed.sum(dtype=jnp.int32),
    }


def release(cache: PagedKVCache, slot: Array) -> dict[str, Array]:
    """``slot`` emptied: its references dropped, the pages left unreferenced pushed on the free list."""
    return {
        "page_table": cache.page_table.at[slot].set(-1),
        "committed": cache.committed.at[slot].set(0),
        "staged": cache.staged.at[slot].set(0),
        **unreference(cache, cache.page_table[slot]),
    }


def write_rows(pool: Array, pages: Array, offsets: Array, rows: Array) -> Array:
    """``pool [num_pages, page_size, ...]`` with ``rows [B, T, ...]`` at ``(pages, offsets)`` (both ``[B, T]``).

    A page out of range (``num_pages``) drops its row.  A bfloat16 or fp8
    pool on CPU is written as rows of the pool flattened to ``[num_pages *
    page_size, ...]`` by the native row writer (``_writes``), in place.
    """
    num_pages, page_size = pool.shape[:2]
    flat = pool.reshape(num_pages * page_size, *pool.shape[2:])
    slots = (jnp.minimum(pages, num_pages) * page_size + offsets).reshape(-1)
    written = _writes.write_rows(flat, slots, rows.reshape(-1, *rows.shape[2:]), axis=0,
                                 otherwise=lambda: pool.at[pages, offsets].set(rows, mode="drop").reshape(flat.shape))
    return written.reshape(pool.shape)


def copy_page(pool: Array, source: Array, target: Array) -> Array:
    """``pool`` with page ``source`` copied into page ``target`` (``num_pages``: nothing copied)."""
    page = pool[source]
    return _writes.write_rows(pool, target[None], page[None], axis=0,
                              otherwise=lambda: pool.at[target].set(page, mode="drop"))
