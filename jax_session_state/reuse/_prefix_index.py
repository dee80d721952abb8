"""``PrefixIndex``: chained page keys -> pages of one ``PagedKVCache`` that hold that prefix.

The host side of prefix reuse for paged K/V.  The index holds one reference
to every page it names, so an indexed page is never freed or reused while
indexed; a new slot whose prompt starts with indexed pages maps them (their
reference counts go up, no row is copied or recomputed) and writes only what
follows.  Only full pages are indexed and mapped: a partial last page is the
slot's own, so a shared page is never written.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_session_state._core._validation import is_integer_scalar
from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.objects import _page_sharing
from jax_session_state.objects.paged import PagedKVCache
from jax_session_state.reuse._keys import page_keys

__all__ = ["PrefixIndex"]

# Compiled once per cache spec (page lists are padded to num_pages with -1); the cache is donated.
_map_pages = jax.jit(_page_sharing.map_pages, donate_argnums=0)
_hold = jax.jit(_page_sharing.hold, donate_argnums=0)
_drop = jax.jit(_page_sharing.drop, donate_argnums=0)


def _padded(cache: PagedKVCache, pages: list[int]) -> jax.Array:
    row = np.full(cache.num_pages, -1, np.int32)
    row[: len(pages)] = pages
    return jnp.asarray(row)


class PrefixIndex:
    """Shared prompt prefixes of one :class:`~jax_session_state.PagedKVCache`, page by page.

    1. ``cache, rows = index.attach(cache, slot, tokens)`` maps the longest
       indexed prefix of ``tokens`` into free slot ``slot``: ``rows`` tokens
       (a multiple of ``page_size``) are then committed there.
    2. Append the K/V of ``tokens[rows:]`` to the slot as usual.
    3. ``cache = index.publish(cache, slot, tokens)`` indexes the slot's full
       committed pages, so later prompts can map them.

    ``free`` a slot as usual: an indexed page stays (the index refers to it)
    until :meth:`release_unused` lets go of pages no slot maps.  Every
    method donates the cache it is given (use the one it returns).  Not
    thread-safe: use one index per cache, from the thread that steps it.

    Args:
      page_size: the cache's ``page_size``.
      identity: the model whose K/V the pages hold (part of every key).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jax_session_state as jss
      >>> cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=1, head_dim=2, page_size=4, num_pages=8)
      >>> index = jss.reuse.PrefixIndex(page_size=4, identity="lm@1")
      >>> def write(cache, slot, tokens, start):  # K/V of tokens[start:] (here: the token id)
      ...     n = len(tokens) - start
      ...     rows = jnp.zeros((2, 12, 1, 2)).at[slot, :n].set(jnp.asarray(tokens[start:], jnp.float32)[:, None, None])
      ...     counts = jnp.zeros(2, jnp.int32).at[slot].set(n)
      ...     return cache.append(jss.KVChunk(rows, rows, counts=counts))
      >>> a, b = np.arange(10), np.r_[np.arange(8), 50, 51, 52]  # the first 8 tokens (2 pages) shared
      >>> cache, rows = index.attach(cache, 0, a)
      >>> cache = index.publish(write(cache, 0, a, rows), 0, a)
      >>> cache, rows = index.attach(cache, 1, b)  # maps a's 2 full pages
      >>> cache = index.publish(write(cache, 1, b, rows), 1, b)
      >>> rows, int(cache.free_count), cache.view().lengths  # 2 shared + 1 + 1 own pages used
      (8, 4, Array([10, 11], dtype=int32))
    """

    def __init__(self, *, page_size: int, identity: str):
        page_keys(np.zeros(0, np.int32), page_size=page_size, identity=identity)  # checks both
        self.page_size, self.identity = page_size, identity
        self._pages: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.hits = self.misses = 0  # pages mapped / full pages written by their slot

    def __len__(self) -> int:
        return len(self._pages)

    def __repr__(self) -> str:
        return f"PrefixIndex(page_size={self.page_size}, identity={self.identity!r})"

    def _check(self, cache: PagedKVCache, where: str) -> None:
        if not isinstance(cache, PagedKVCache) or cache.page_size != self.page_size:
            got = cache.describe() if isinstance(cache, PagedKVCache) else type(cache).__name__
            raise PayloadError(
                f"PrefixIndex.{where}: expected a PagedKVCache with page_size {self.page_size}; got {got}."
            )

    def _check_slot(self, cache: PagedKVCache, slot: Any, where: str) -> int:
        """``slot`` as an int, checked on the host: an out-of-range slot would read or map another slot's pages."""
        if not is_integer_scalar(slot) or isinstance(slot, jax.core.Tracer):
            raise PayloadTypeError(f"{self!r}.{where}: slot must be an integer (not traced); got {slot!r}.")
        if not 0 <= int(slot) < cache.slot_count:
            raise IndexError(
                f"{self!r}.{where}: slot {int(slot)} is out of range: {cache.describe()} has slots "
                f"[0, {cache.slot_count})."
            )
        return int(slot)

    def match(self, tokens: Any) -> list[int]:
        """The pages holding the longest indexed prefix of ``tokens``, in row order."""
        return self._match_keys(page_keys(tokens, page_size=self.page_size, identity=self.identity))

    def _match_keys(self, keys: list[str]) -> list[int]:
        """The pages of the longest indexed run of ``keys``; each found page becomes the most recently matched."""
        found = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            self._pages.move_to_end(key)
            found.append(page)
        return found

    def attach(self, cache: PagedKVCache, slot: int, tokens: Any) -> tuple[PagedKVCache, int]:
        """Maps the longest indexed prefix of ``tokens`` into free slot ``slot``.

        Everything is checked before anything is counted: a refused attach
        counts no hit or miss and makes no page more recently matched.

        Returns:
          The cache, and how many of ``tokens`` the slot now holds (committed);
          append the K/V of the rest.

        Raises:
          PayloadError: the slot holds pages, or the cache's page size is not the index's.
          PayloadTypeError: ``slot`` is not an integer.
          IndexError: ``slot`` is outside ``[0, cache.max_slots)``.
        """
        self._check(cache, "attach")
        slot = self._check_slot(cache, slot, "attach")
        keys = page_keys(tokens, page_size=self.page_size, identity=self.identity)
        if int(cache.page_table[slot, 0]) >= 0 or int(cache.staged[slot]) > 0:
            raise PayloadError(
                f"{self!r}.attach: slot {slot} of {cache.describe()} holds pages; attach to a free slot."
            )
        pages = self._match_keys(keys)[: cache.max_pages_per_slot]
        self.hits += len(pages)
        self.misses += len(keys) - len(pages)
        row = np.full(cache.max_pages_per_slot, -1, np.int32)
        row[: len(pages)] = pages
        if not pages:
            return cache, 0
        return _map_pages(cache, jnp.int32(slot), jnp.asarray(row), jnp.int32(len(pages))), len(pages) * self.page_size

    def publish(self, cache: PagedKVCache, slot: int, tokens: Any) -> PagedKVCache:
        """Indexes the full committed pages of ``slot``, whose rows are the K/V of ``tokens``.

        Pages already indexed under their key are left as they are; each
        newly indexed page gets one more reference (the index's).

        Raises:
          PayloadError: the cache's page size is not the index's.
          PayloadTypeError: ``slot`` is not an integer.
          IndexError: ``slot`` is outside ``[0, cache.max_slots)``.
        """
        self._check(cache, "publish")
        slot = self._check_slot(cache, slot, "publish")
        keys = page_keys(tokens, page_size=self.page_size, identity=self.identity)
        committed = int(cache.committed[slot]) // self.page_size
        table = np.asarray(cache.page_table[slot])
        new = []
        for entry, key in enumerate(keys[:committed]):
            if key not in self._pages:
                self._pages[key] = int(table[entry])
                new.append(int(table[entry]))
        if not new:
            return cache
        return _hold(cache, _padded(cache, new))

    def release_unused(self, cache: PagedKVCache, *, keep: int = 0) -> tuple[PagedKVCache, int]:
        """Lets go of indexed pages no slot maps, least recently matched first, keeping ``keep`` of them.

        Returns:
          The cache (those pages back on the free list) and how many were released.
        """
        self._check(cache, "release_unused")
        refcounts = np.asarray(cache.refcounts)
        unused = [key for key, page in self._pages.items() if refcounts[page] == 1]
        gone = unused[: max(len(unused) - keep, 0)]
        if not gone:
            return cache, 0
        pages = [self._pages.pop(key) for key in gone]
        return _drop(cache, _padded(cache, pages)), len(pages)

    def clear(self, cache: PagedKVCache) -> PagedKVCache:
        """Lets go of every indexed page (slots mapping them keep them)."""
        self._check(cache, "clear")
        pages = list(self._pages.values())
        self._pages.clear()
        return _drop(cache, _padded(cache, pages)) if pages else cache

    def stats(self) -> dict[str, int]:
        """``pages`` indexed, ``hits`` (pages mapped instead of written) and ``misses`` (full pages not found)."""
        return {"pages": len(self._pages), "hits": self.hits, "misses": self.misses}
