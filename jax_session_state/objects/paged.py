"""``PagedKVCache``: K/V of many sequence slots in one pool of pages, with copy-on-write forks.

Sequences share a pool of fixed-size pages instead of each owning a
``capacity``-long buffer.  A slot's page table lists the pages that hold its
rows in order; pages come from an on-device free list as rows need them and
go back when no slot refers to them any more.  ``fork(src, dst)`` gives
``dst`` the same full pages (their reference counts go up) and a copy of
only the partial last page, so a fork costs one page whatever the length.

A shared page is never written: it is full of committed rows, and every
write lands at or after a slot's committed length, that is in the slot's
own partial last page or in pages taken fresh from the free list.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jax_session_state._core import _validation as v
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import allocator, overwrite, refuse_now_if
from jax_session_state.errors import CapacityError, PayloadError, PayloadTypeError
from jax_session_state.objects import _batch, _pages, _quantize
from jax_session_state.objects._batch import BatchShape
from jax_session_state.objects.kv_views import KVChunk, PagedView, read_chunk

__all__ = ["PagedKVCache", "PagedView"]

# Storage that a refused operation leaves exactly as it was (the pools are
# written with dropped indices instead).
_BOOKKEEPING = ("page_table", "committed", "staged", "refcounts", "free_pages", "free_count")


class PagedKVCache(StateObject, kw_only=True):
    """Self-attention K/V of ``max_slots`` sequences in one pool of pages.

    - ``append`` / ``stage`` / ``commit`` take a :class:`KVChunk` with ``k, v:
      Float[Array, "max_slots T kv_heads head_dim"]`` and per-slot ``counts``
      (0 for slots not written).  Pages come from the free list as rows need
      them.  Staging is in-buffer: staged rows go past a slot's committed
      length; ``commit()`` advances the length and ``discard()`` forgets the
      staged count, both O(1).  Pages taken for staged rows stay attached to
      the slot after a ``discard()`` and take the slot's next rows; ``free``
      returns them.
    - ``fork(src, dst)`` makes ``dst`` a copy-on-write copy of ``src``'s
      committed rows: full pages are shared by reference count, only the
      partial last page is copied (one page from the free list).
    - ``free(slot)`` empties the slot; pages no other slot refers to go
      back to the free list.

    Quantized storage (``quantize="int8"`` or ``"fp8"``) is that of
    :class:`~jax_session_state.KVCache`, the scales laid out as pages: one
    float32 scale per row and head, the same error bound.  ``append``
    quantizes the rows it writes, a fork copies the partial page's scales
    with it, attention applies them block by block; ``tiers=("int8",)``
    lets :meth:`demote` quantize a float cache when memory is short.

    A slot is *free* while it holds no page.  Refused operations change
    nothing: a write that needs more pages than are free or more than
    ``max_pages_per_slot`` pages for one slot is a :class:`CapacityError`;
    a slot index out of range an ``IndexError``; a fork from a slot without
    committed rows, a fork into a slot holding rows, or a free of a free slot
    a ``ValueError``.  Eagerly these raise at once; under ``jit`` they cannot,
    so the object's ``overflowed`` flag is set instead (nothing written) and
    :func:`jax_session_state.check` raises.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=1, head_dim=2, page_size=4, num_pages=8)
      >>> rows = jnp.ones((2, 6, 1, 2))
      >>> cache = cache.append(jss.KVChunk(rows, rows, counts=jnp.array([6, 0], jnp.int32)))
      >>> fork = jax.jit(lambda c, src, dst: c.fork(src, dst), donate_argnums=0)
      >>> cache = fork(cache, 0, 1)  # shares page 0, copies the 2 rows of page 1
      >>> cache.view().lengths, int(cache.free_count)
      (Array([6, 6], dtype=int32), 5)
    """

    max_slots: BatchShape = struct.field(pytree_node=False)
    kv_heads: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)
    num_pages: int = struct.field(pytree_node=False)
    max_pages_per_slot: int = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)
    quantize: str | None = struct.field(pytree_node=False, default=None)
    tiers: tuple[str, ...] = struct.field(pytree_node=False, default=())

    k_pages: Array | None = None
    """``Float[Array, "num_pages page_size kv_heads head_dim"]`` (int8 / fp8 values when quantized)."""
    v_pages: Array | None = None
    """``Float[Array, "num_pages page_size kv_heads head_dim"]`` (int8 / fp8 values when quantized)."""
    k_scale: Array | None = None
    """``Float[Array, "num_pages page_size kv_heads 1"]`` the scale of each row of ``k_pages`` when quantized,
    else None."""
    v_scale: Array | None = None
    """``Float[Array, "num_pages page_size kv_heads 1"]`` the scale of each row of ``v_pages`` when quantized,
    else None."""
    page_table: Array | None = None
    """``Int[Array, "max_slots max_pages_per_slot"]`` page ids in row order, -1 after the last."""
    committed: Array | None = None
    """``Int[Array, "max_slots"]`` committed rows per slot."""
    staged: Array | None = None
    """``Int[Array, "max_slots"]`` staged rows per slot, after the committed ones."""
    refcounts: Array | None = None
    """``Int[Array, "num_pages"]`` page-table entries referring to each page."""
    free_pages: Array | None = None
    """``Int[Array, "num_pages"]`` a stack: its first ``free_count`` entries are the free pages."""
    free_count: Array | None = None
    """``Int[Array, ""]`` pages on the free list."""
    refused: Array | None = None
    """``Bool[Array, ""]`` an operation was refused under jit; read it through :attr:`overflowed`."""

    can_overflow = True
    data_fields = ("k_pages", "v_pages")

    @property
    def slot_count(self) -> int:
        """Sequence slots held: ``max_slots``, or the product of its axes when it is a tuple (stored flattened)."""
        return _batch.size_of(self.max_slots)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading axes of payloads and queries: ``(max_slots,)``, or ``max_slots`` when it is a tuple."""
        return _batch.shape_of(self.max_slots)

    @property
    def capacity(self) -> int:
        """The most rows one slot can hold: ``max_pages_per_slot * page_size``."""
        return self.max_pages_per_slot * self.page_size

    @property
    def overflowed(self) -> Array | None:
        """``Bool[Array, ""]`` an operation was refused under jit."""
        return self.refused

    @classmethod
    @allocator()
    def allocate(
        cls,
        *,
        max_slots: BatchShape,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        max_pages_per_slot: int | None = None,
        dtype: Any = jnp.float32,
        quantize: str | None = None,
        tiers: tuple[str, ...] = (),
        **options: Any,
    ) -> PagedKVCache:
        """An empty cache: every slot free, every page on the free list.

        Args:
          max_slots: sequence slots, or a tuple of slot axes (``(B, P)``):
            payloads and queries then lead with them and the page tables
            hold their slots flattened (slot indices of :meth:`fork` and
            :meth:`free` are flat).
          kv_heads: K/V heads.
          head_dim: size of each head.
          page_size: rows per page.
          num_pages: pages in the pool, shared by all slots.
          max_pages_per_slot: page-table entries per slot (at most
            ``num_pages``, the default): a slot holds at most this many
            pages' rows.
          dtype: payload dtype (and storage dtype unless quantized);
            payloads must match it exactly.
          quantize: store the rows quantized: ``"int8"`` or ``"fp8"``
            (``float8_e4m3fn``); ``dtype`` stays the payloads' dtype.
          tiers: the quantized forms it may be demoted to when memory is
            short (``("int8",)``), highest precision first.
          **options: how the object is managed
            (:class:`~jax_session_state.building_blocks.ManagedOptions`:
            ``recompute_source``, ``recompute_cost``, ``sharding``).  Its
            storage axes are ``("num_pages", "page_size", "kv_heads",
            "head_dim")`` for the pools (and their scales), ``("max_slots",
            "max_pages_per_slot")`` for the page table, ``("max_slots",)``
            for the committed and staged rows and ``("num_pages",)`` for the free list;
            ``max_slots=(B, P)`` names the flattened slot axis
            ``("max_slots", "max_slots_1")``.

        Returns:
          An empty, resident cache.
        """
        owner = "PagedKVCache.allocate"
        num_pages = v.positive_int(owner, "num_pages", num_pages)
        max_pages_per_slot = v.positive_int(
            owner, "max_pages_per_slot", num_pages if max_pages_per_slot is None else max_pages_per_slot
        )
        if max_pages_per_slot > num_pages:
            raise PayloadError(
                f"{owner}: max_pages_per_slot must be <= num_pages ({num_pages}), since a slot holds "
                f"distinct pages; got {max_pages_per_slot}."
            )
        dtype = np.dtype(dtype)
        quantize, tiers = _quantize.check_args(owner, dtype, quantize, tiers)
        return cls._allocated(
            options,
            max_slots=_batch.checked(owner, "max_slots", max_slots),
            kv_heads=v.positive_int(owner, "kv_heads", kv_heads),
            head_dim=v.positive_int(owner, "head_dim", head_dim),
            page_size=v.positive_int(owner, "page_size", page_size),
            num_pages=num_pages,
            max_pages_per_slot=max_pages_per_slot,
            dtype=dtype,
            quantize=quantize,
            tiers=tiers,
        )

    def storage_axes(self) -> dict[str, Any]:
        pool = ("num_pages", "page_size", "kv_heads", "head_dim")
        slot = _batch.logical_name("max_slots", self.max_slots)
        slots, pages = (slot,), ("num_pages",)
        scale = (*pool[:3], None) if self.quantize else None
        return {
            "k_pages": pool, "v_pages": pool, "k_scale": scale, "v_scale": scale,
            "page_table": (slot, "max_pages_per_slot"),
            "committed": slots, "staged": slots, "refcounts": pages, "free_pages": pages,
            "free_count": (), "refused": (),
        }

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of the pools: ``dtype``, or the quantized format's."""
        return self.dtype if self.quantize is None else _quantize.storage_dtype(self.quantize)

    @property
    def _pools(self) -> tuple[str, ...]:
        """The storage fields laid out as pages: the values, and their scales when quantized."""
        return ("k_pages", "v_pages", "k_scale", "v_scale") if self.quantize else ("k_pages", "v_pages")

    def _empty_storage(self) -> dict[str, Any]:
        pool = (self.num_pages, self.page_size, self.kv_heads, self.head_dim)
        slots = jnp.zeros((self.slot_count,), jnp.int32)
        scale = jnp.ones((*pool[:3], 1), jnp.float32) if self.quantize else None
        return {
            "k_pages": jnp.zeros(pool, self.storage_dtype),
            "v_pages": jnp.zeros(pool, self.storage_dtype),
            "k_scale": scale,
            "v_scale": None if scale is None else jnp.ones_like(scale),
            "page_table": jnp.full((self.slot_count, self.max_pages_per_slot), -1, jnp.int32),
            "committed": slots,
            "staged": jnp.zeros_like(slots),
            "refcounts": jnp.zeros((self.num_pages,), jnp.int32),
            "free_pages": jnp.arange(self.num_pages - 1, -1, -1, dtype=jnp.int32),  # page 0 on top
            "free_count": jnp.asarray(self.num_pages, jnp.int32),
            "refused": jnp.zeros((), bool),
        }

    # ------------------------------------------------------------- writes
    def _stage(self, payload: KVChunk | tuple[Array, ...], operation: str) -> tuple[PagedKVCache, Array]:
        """Writes rows after each slot's committed ones, replacing what the slot staged.

        Args:
          payload: a :class:`KVChunk` or ``(k, v[, counts])`` with ``k, v:
            Float[Array, "*max_slots T kv_heads head_dim"]`` of the cache's
            dtype and ``counts: Int[Array, "*max_slots"]`` in ``[0, T]``;
            with ``rows`` (a :class:`KVChunk` of some slots) the leading
            axes are ``rows``' and only those slots are written, the others
            staging nothing.
          operation: the public method, for messages.

        Returns:
          The cache with the rows staged, and whether the write was refused
          (a count out of range, a slot past ``max_pages_per_slot`` pages, or
          more new pages needed than are free): then nothing is written.
        """
        chunk, counts, bad_counts = read_chunk(self, payload, operation, batch=self.max_slots)
        T = chunk.k.shape[1]
        owner = f"{self.describe()}.{operation}"
        if chunk.rows is not None:  # only the named slots: the others write (and stage) nothing
            counts = jnp.zeros_like(self.committed).at[chunk.rows].set(jnp.where(bad_counts, 0, counts))
        start = self.committed
        end = start + counts
        no_room = jnp.any(end > self.capacity)
        refuse_now_if(
            no_room,
            lambda: CapacityError(
                f"{owner}: writing {np.asarray(counts).tolist()} rows after {np.asarray(start).tolist()} "
                f"exceeds a slot's {self.capacity} rows (max_pages_per_slot {self.max_pages_per_slot} x "
                f"page_size {self.page_size}); nothing was written. Allocate more max_pages_per_slot."
            ),
        )
        entry = jnp.arange(self.max_pages_per_slot, dtype=jnp.int32)
        need = (self.page_table < 0) & (entry * self.page_size < end[:, None])
        needed = need.sum(dtype=jnp.int32)
        no_pages = needed > self.free_count
        refuse_now_if(
            no_pages,
            lambda: CapacityError(
                f"{owner}: writing {np.asarray(counts).tolist()} rows needs {int(needed)} new pages but "
                f"{int(self.free_count)} of {self.num_pages} are free; nothing was written. Free slots, "
                "or allocate more num_pages."
            ),
        )
        refused = bad_counts | no_room | no_pages
        taken = self.with_storage(**_pages.take(self, need))
        written_slots = slice(None) if chunk.rows is None else chunk.rows  # the chunk's rows' slots
        positions = start[written_slots, None] + jnp.arange(T, dtype=jnp.int32)
        entries = jnp.minimum(positions // self.page_size, self.max_pages_per_slot - 1)
        pages = jnp.take_along_axis(taken.page_table[written_slots], entries, axis=1)
        written = (jnp.arange(T) < counts[written_slots, None]) & ~refused
        pages = jnp.where(written, pages, self.num_pages)  # out of range: dropped
        offsets = positions % self.page_size
        rows = {"k_pages": chunk.k, "v_pages": chunk.v}
        if self.quantize is not None:  # only the chunk's rows: O(rows written)
            rows["k_pages"], rows["k_scale"] = _quantize.quantize(chunk.k, self.quantize)
            rows["v_pages"], rows["v_scale"] = _quantize.quantize(chunk.v, self.quantize)
        new = taken.with_storage(
            **{name: _pages.write_rows(getattr(self, name), pages, offsets, x) for name, x in rows.items()},
            staged=counts,
        )
        return self._unless(refused, new), refused

    def _unless(self, refused: Array, new: PagedKVCache) -> PagedKVCache:
        """``new``, or this cache's bookkeeping where ``refused``; ``overflowed`` records a refusal.

        ``new``'s pools must already drop a refused write.
        """
        kept = {name: jnp.where(refused, getattr(self, name), getattr(new, name)) for name in _BOOKKEEPING}
        return new.with_storage(**kept, refused=self.refused | refused)

    def _commit_staged(self, when: Array | bool = True) -> PagedKVCache:
        promoted = jnp.where(when, self.staged, 0)
        return self.with_storage(committed=self.committed + promoted, staged=self.staged - promoted)

    def discard(self) -> PagedKVCache:
        """Forgets staged rows (O(1)); their pages stay with the slot for its next rows."""
        self._require_resident("discard")
        return self.with_storage(staged=overwrite(self.staged, 0))

    # -------------------------------------------------------------- slots
    def fork(self, src: int | Array, dst: int | Array) -> PagedKVCache:
        """Slot ``dst`` becomes a copy-on-write copy of slot ``src``'s committed rows.

        ``dst`` refers to ``src``'s full pages (their reference counts go up)
        and gets a fresh copy of the partial last page, if any: one page from
        the free list, whatever the length.  ``src``'s staged rows are not
        forked.  Pages ``dst`` kept from discarded rows are released first.

        Args:
          src: a slot holding committed rows (an int, or an int32 scalar array
            so one jitted fork serves every slot).
          dst: a slot holding no rows.

        Returns:
          The cache with ``dst`` forked; under ``jit`` a refused fork changes
          nothing and sets ``overflowed``.

        Raises:
          IndexError: ``src`` or ``dst`` outside ``[0, max_slots)``.
          ValueError: ``src`` holds no committed rows, or ``dst`` holds rows.
          CapacityError: the partial last page needs a copy and no page is free.
        """
        self._require_resident("fork")
        src, bad_src = self._slot("fork", "src", src)
        dst, bad_dst = self._slot("fork", "dst", dst)
        owner = f"{self.describe()}.fork"
        length = self.committed[src]
        empty_src = length == 0
        refuse_now_if(
            empty_src,
            lambda: PayloadError(
                f"{owner}: src slot {int(src)} holds no committed rows; fork needs a slot with "
                "committed rows to copy (commit staged rows first)."
            ),
        )
        dst_rows = self.committed[dst] + self.staged[dst]
        occupied_dst = dst_rows > 0
        refuse_now_if(
            occupied_dst,
            lambda: PayloadError(
                f"{owner}: dst slot {int(dst)} is occupied ({int(dst_rows)} rows); fork needs a slot "
                "without rows: free(dst) first, or fork into another slot."
            ),
        )
        released = self.with_storage(**_pages.release(self, dst))
        full = length // self.page_size
        partial = length % self.page_size > 0
        no_page = partial & (released.free_count < 1)
        refuse_now_if(
            no_page,
            lambda: CapacityError(
                f"{owner}: the partial last page of slot {int(src)} needs a copy but no page of "
                f"{self.num_pages} is free; nothing was written. Free slots, or allocate more num_pages."
            ),
        )
        refused = bad_src | bad_dst | empty_src | occupied_dst | no_page
        entry = jnp.arange(self.max_pages_per_slot, dtype=jnp.int32)
        row = self.page_table[src]
        shared = entry < full
        copy = jnp.where(partial & ~refused, released.free_pages[jnp.maximum(released.free_count - 1, 0)], -1)
        new_row = jnp.where(shared, row, jnp.where(entry == full, copy, -1))
        refcounts = _pages.referenced(released.refcounts, row, shared)
        target = jnp.where(copy >= 0, copy, self.num_pages)  # out of range: nothing copied
        source = jnp.maximum(row[jnp.minimum(full, self.max_pages_per_slot - 1)], 0)
        new = released.with_storage(
            **{name: _pages.copy_page(getattr(self, name), source, target) for name in self._pools},
            page_table=released.page_table.at[dst].set(new_row),
            committed=released.committed.at[dst].set(length),
            refcounts=refcounts.at[target].set(1, mode="drop"),
            free_count=released.free_count - partial.astype(jnp.int32),
        )
        return self._unless(refused, new)

    def free(self, slot: int | Array) -> PagedKVCache:
        """Empties ``slot``; its pages that no other slot refers to go back to the free list.

        Args:
          slot: a slot holding pages (an int, or an int32 scalar array).

        Returns:
          The cache with the slot free; under ``jit`` a refused free changes
          nothing and sets ``overflowed``.

        Raises:
          IndexError: ``slot`` outside ``[0, max_slots)``.
          ValueError: the slot is already free (it holds no pages).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=1, head_dim=2, page_size=4, num_pages=8)
          >>> rows = jnp.ones((2, 6, 1, 2))
          >>> cache = cache.append(jss.KVChunk(rows, rows, counts=jnp.array([6, 0], jnp.int32)))  # pages 0, 1
          >>> cache = jax.jit(lambda c: c.fork(0, 1), donate_argnums=0)(cache)  # slot 1 shares page 0
          >>> cache = cache.free(0)  # page 0 stays: slot 1 still refers to it
          >>> cache.view().lengths, int(cache.free_count)
          (Array([0, 6], dtype=int32), 6)
        """
        self._require_resident("free")
        slot, bad_slot = self._slot("free", "slot", slot)
        is_free = self.page_table[slot, 0] < 0
        refuse_now_if(
            is_free,
            lambda: PayloadError(
                f"{self.describe()}.free: slot {int(slot)} is already free (it holds no pages); "
                "free only slots that were written or forked into."
            ),
        )
        return self._unless(bad_slot | is_free, self.with_storage(**_pages.release(self, slot)))

    def _slot(self, operation: str, name: str, index: int | Array) -> tuple[Array, Array]:
        """``index`` clipped into range, and whether it was out of range (raised at once eagerly)."""
        if not v.is_integer_scalar(index):
            got = f"shape {list(np.shape(index))} and dtype {index.dtype}" if hasattr(index, "dtype") else repr(index)
            raise PayloadTypeError(f"{self.describe()}.{operation}: {name} must be an integer scalar; got {got}.")
        index = jnp.asarray(index)
        bad = (index < 0) | (index >= self.slot_count)
        refuse_now_if(
            bad,
            lambda: IndexError(
                f"{self.describe()}.{operation}: {name} must be a slot in [0, {self.slot_count}); "
                f"got {int(index)}."
            ),
        )
        return jnp.clip(index, 0, self.slot_count - 1).astype(jnp.int32), bad

    # -------------------------------------------------------------- reads
    def view(self, *, include_staged: bool = True) -> PagedView:
        """The pools, page tables and per-slot lengths; see :class:`PagedView`."""
        self._require_resident("view")
        lengths = self.committed + self.staged if include_staged else self.committed
        return PagedView(
            k_pages=self.k_pages,
            v_pages=self.v_pages,
            page_table=self.page_table,
            lengths=lengths,
            page_size=self.page_size,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            batch_shape=self.batch_shape,
        )

    # -------------------------------------------------------------- tiers
    demotable = property(lambda self: bool(self.tiers), doc="Whether ``tiers`` names a lower tier.")

    def demote(self) -> PagedKVCache:
        """The next lower tier of this cache: every page quantized to ``tiers[0]``.

        Each row is quantized as ``allocate(quantize=...)`` would have
        written it (the error bound: the class docstring); page tables,
        reference counts, free list, committed and staged rows are kept, so
        attention, forks and frees work unchanged.  Under ``jit`` with the
        cache donated the bookkeeping is reused in place; the peak is the
        float pools plus their quantized copy.

        Returns:
          The cache quantized to ``tiers[0]``, with the remaining tiers.

        Raises:
          NotDemotableError: the cache declares no (further) tier.

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=1, head_dim=2, page_size=4, num_pages=4,
          ...                                   tiers=("int8",))
          >>> rows = jnp.ones((2, 3, 1, 2))
          >>> cache = cache.append(jss.KVChunk(rows, rows, counts=jnp.array([3, 1], jnp.int32)))
          >>> low = cache.demote()
          >>> low.quantize, low.k_pages.dtype, low.view().lengths, int(low.free_count)  # pages kept
          ('int8', dtype('int8'), Array([3, 1], dtype=int32), 2)
        """
        return _quantize.demoted(self, (("k_pages", "k_scale"), ("v_pages", "v_scale")))

