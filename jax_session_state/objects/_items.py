"""``ItemBuffer``: the write path shared by kinds that hold a sequence of items.

Items (frames, latent chunks, retrieval entries) are pytrees of fixed-shape
arrays stored along a leading slot axis.  A buffer shows its last
``capacity`` items: in ring mode older items are overwritten, otherwise a
write past ``capacity`` is refused.  Staging is in-buffer; a ring reserves
``max_staged`` slots beyond ``capacity`` so staged items never overwrite
visible ones.
"""

from __future__ import annotations

__all__ = ["ItemBuffer"]

import abc
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from jax_session_state._core import _validation as v, _writes
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import refuse_now_if, update_slice_or_keep
from jax_session_state.errors import CapacityError, PayloadError, PayloadTypeError
from jax_session_state.objects import _ring

# Entries of ``ItemBuffer.bookkeeping``.
_COMMITTED, _STAGED, _REFUSED = range(3)


class ItemBuffer(StateObject, kw_only=True):
    """Abstract: count/staged bookkeeping and in-buffer writes of item pytrees.

    Subclasses define the static fields ``capacity`` (items visible),
    ``ring`` and ``max_staged``, the storage pytree (``_buffers`` /
    ``_with_buffers``) and what an item is (``item_treedef`` /
    ``item_specs``).
    """

    bookkeeping: Array | None = None
    """``Int[Array, "3"]``: items ever committed, items staged after them, and
    the writes refused under jit.  One array, so a step updates all of it in
    one operation; read it through :attr:`committed`, :attr:`staged` and
    :attr:`overflowed`."""

    can_overflow = True

    @property
    def committed(self) -> Array | None:
        """``Int[Array, ""]`` items ever committed."""
        return None if self.bookkeeping is None else self.bookkeeping[..., _COMMITTED]


    @property
    def staged(self) -> Array | None:
        """``Int[Array, ""]`` items staged after them."""
        return None if self.bookkeeping is None else self.bookkeeping[..., _STAGED]

    @property
    def overflowed(self) -> Array | None:
        """``Bool[Array, ""]`` a write was refused under jit."""
        return None if self.bookkeeping is None else self.bookkeeping[..., _REFUSED] > 0

    @property
    def staging_margin(self) -> int:
        """A ring's ``max_staged`` slots beyond ``capacity`` (0 in append mode, which stages in place)."""
        return self.max_staged if self.ring else 0

    @property
    def slots(self) -> int:
        """Storage slots: ``capacity``, plus the staging margin of a ring."""
        return self.capacity + self.staging_margin

    @abc.abstractmethod
    def _buffers(self) -> Any:
        """The storage pytree, each leaf ``[slots, ...]``, in item order."""

    @abc.abstractmethod
    def _with_buffers(self, buffers: Any) -> ItemBuffer:
        """A copy holding ``buffers`` as storage."""

    @property
    @abc.abstractmethod
    def item_treedef(self) -> jax.tree_util.PyTreeDef:
        """The pytree structure of one item."""

    @property
    @abc.abstractmethod
    def item_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The shape and dtype of each leaf of one item."""

    def _bookkeeping(self) -> dict[str, Array]:
        return {"bookkeeping": jnp.zeros((3,), jnp.int32)}

    def _bookkeeping_axes(self) -> dict[str, tuple[None]]:
        return {"bookkeeping": (None,)}

    def _with_bookkeeping(self, *, count: Array, staged: Array, refused: Array) -> ItemBuffer:
        return self.with_storage(bookkeeping=jnp.stack([count, staged, refused], axis=-1).astype(jnp.int32))

    def _with_refusals_of(self, other: ItemBuffer) -> ItemBuffer:
        """This buffer with ``other``'s refused writes added to its own (a lane's window, as it is committed)."""
        return self.with_storage(bookkeeping=self.bookkeeping.at[..., _REFUSED].add(other.bookkeeping[..., _REFUSED]))

    def _items(self, payload: Any, operation: str) -> tuple[list[Array], int]:
        """Checks one item or a batch of items; returns leaves ``[n, ...]`` and n."""
        owner = f"{self.describe()}.{operation}"
        leaves, treedef = jax.tree_util.tree_flatten(payload)
        if treedef != self.item_treedef:
            raise PayloadTypeError(f"{owner}: items must have the pytree structure {self.item_treedef}; got {treedef}.")
        first, spec = leaves[0], self.item_specs[0]
        single = hasattr(first, "shape") and len(first.shape) == len(spec.shape)
        leading = () if single else ("n",)
        sizes: dict[str, int] = {}
        v.check_tree(
            payload, owner=owner, what="items", treedef=self.item_treedef,
            leaves=self.item_specs, leading=leading, sizes=sizes,
        )
        leaves = [jnp.asarray(x)[None] if single else jnp.asarray(x) for x in leaves]
        n = 1 if single else sizes["n"]
        if self.ring and n > self.slots:  # they would collide in the ring
            raise PayloadError(f"{owner}: {n} items at once exceed the ring's {self.slots} slots.")
        return leaves, n

    def _write(
        self, leaves: list[Array], n: int, *, staging: bool, operation: str, take: Array | int | None = None
    ) -> tuple[ItemBuffer, Array]:
        """Writes the first ``take`` (default: all ``n``) of the items in ``leaves`` after the committed ones,
        replacing what was staged."""
        start = self.committed
        take = n if take is None else take
        if not self.ring:
            refused = start + take > self.capacity
            limit = f"capacity {self.capacity}"
        elif staging:
            refused = jnp.asarray(take) > self.max_staged  # an array: traced under jit, so flagged there
            limit = f"max_staged {self.max_staged} items staged between commits"
        else:  # committed ring writes may overwrite the oldest items
            refused = jnp.zeros((), bool)
            limit = ""
        refuse_now_if(
            refused,
            lambda: CapacityError(
                f"{self.describe()}.{operation}: writing {int(take)} items after {int(start)} exceeds {limit}; "
                "nothing was written. Allocate more, or commit sooner."
            ),
        )
        buffers = jax.tree_util.tree_leaves(self._buffers())
        if n == 1 and isinstance(take, int) and self.sharding is None:
            written = [_write_one(b, x[0], start, refused, ring=self.ring) for b, x in zip(buffers, leaves)]
        else:
            index = jnp.arange(n, dtype=jnp.int32)
            slots = _ring.slot_of(start + index, sink=0, ring=self.slots if self.ring else None)
            slots = jnp.where(refused | (index >= take), self.slots, slots)  # out of range: dropped
            written = [_writes.write_rows(b, slots, x, axis=0) for b, x in zip(buffers, leaves)]
        buffers = self.item_treedef.unflatten(written)
        new = self._with_buffers(buffers)._with_bookkeeping(
            count=self.committed,
            staged=jnp.where(refused, self.staged, take),
            refused=self.bookkeeping[..., _REFUSED] + refused,
        )
        return new, refused

    def _stage(self, payload: Any, operation: str) -> tuple[ItemBuffer, Array]:
        """Writes one item or a batch of items after the committed ones, replacing what was staged.

        A staged write into a ring must fit its ``max_staged`` margin; a
        committed write (``commit(p)``, ``append``) may overwrite the oldest
        items instead.
        """
        leaves, n = self._items(payload, operation)
        return self._write(leaves, n, staging=operation == "stage", operation=operation)

    def _commit_staged(self, when: Array | bool = True) -> ItemBuffer:
        promoted = jnp.where(when, self.staged, 0)
        return self._with_bookkeeping(
            count=self.committed + promoted, staged=self.staged - promoted, refused=self.bookkeeping[..., _REFUSED]
        )

    def discard(self) -> ItemBuffer:
        """Forgets staged items (O(1)); committed items are untouched."""
        self._require_resident("discard")
        return self.with_storage(bookkeeping=self.bookkeeping.at[..., _STAGED].set(0))

    def _visible_range(self, include_staged: bool) -> tuple[Array, Array]:
        """``(start, end)``: positions of the items a reader sees."""
        end = self.committed + self.staged if include_staged else self.committed
        return jnp.maximum(end - self.capacity, 0), end


def _write_one(buffer: Array, item: Array, position: Array, refused: Array, *, ring: bool) -> Array:
    """``buffer`` with ``item`` in the slot of ``position``, unless ``refused``.

    One in-place update (:func:`update_slice_or_keep`); a scatter of one
    index took more operations (its indices, a bounds check, the update).
    The slot is clamped into range: an append-mode buffer refuses a write
    past its last slot.
    """
    slots = buffer.shape[0]
    slot = lax.rem(position, slots) if ring else jnp.minimum(position, slots - 1)
    slot = slot.astype(jnp.uint32)  # never negative: no index wrapping, the same index for both
    return update_slice_or_keep(buffer, item[None], slot, axis=0, lands=jnp.logical_not(refused))
