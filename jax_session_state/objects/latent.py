"""``LatentBuffer``: recent frames or latent chunks, a ring or a bounded append."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array, lax

from jax_session_state import _validation as v
from jax_session_state.objects._items import ItemBuffer
from jax_session_state.sharding import LogicalAxes, ShardingRules

__all__ = ["LatentBuffer", "LatentView"]


class LatentView(struct.PyTreeNode):
    """Items oldest to newest.

    Attributes:
      items: ``Float[Array, "maxlen *item_shape"]``; ``items[:count]`` are the
        visible items, oldest first; entries past ``count`` are unspecified.
      count: ``Int[Array, ""]`` number of visible items.
    """

    items: Array
    count: Array

    def materialize(self) -> np.ndarray:
        """The visible items, oldest first, as a numpy array."""
        return np.asarray(self.items)[: int(self.count)]


class LatentBuffer(ItemBuffer, kw_only=True):
    """The last ``maxlen`` frames or latent chunks of a rollout.

    With ``ring=True`` a write overwrites the oldest items (a model
    conditioned on recent frames); without, a write past ``maxlen`` is a
    :class:`CapacityError` and writes nothing.  A payload is one item
    ``[*item_shape]`` or several ``[n, *item_shape]``.  A ring reserves
    ``max_staged`` extra slots so staged items never overwrite visible ones.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> frames = jss.LatentBuffer.allocate(maxlen=4, item_shape=(8, 8), ring=True)
      >>> for t in range(6):
      ...     frames = frames.append(jnp.full((8, 8), float(t)))
      >>> view = frames.view()
      >>> int(view.count), view.items[:, 0, 0].tolist()
      (4, [2.0, 3.0, 4.0, 5.0])
    """

    maxlen: int = struct.field(pytree_node=False)
    item_shape: tuple[int, ...] = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)
    item_axes: LogicalAxes = struct.field(pytree_node=False)
    ring: bool = struct.field(pytree_node=False, default=False)
    max_staged: int = struct.field(pytree_node=False, default=0)

    items: Array | None = None
    """``Float[Array, "slots *item_shape"]`` in slot order."""

    @classmethod
    def allocate(
        cls,
        *,
        maxlen: int,
        item_shape: tuple[int, ...],
        dtype: Any = jnp.float32,
        ring: bool = False,
        max_staged: int = 0,
        item_axes: tuple[str | None, ...] | None = None,
        recompute_source: str | tuple[str, ...] = (),
        recompute_cost: float = 0.0,
        sharding: ShardingRules | None = None,
    ) -> LatentBuffer:
        """An empty buffer.

        Args:
          maxlen: items kept (and visible).
          item_shape: the shape of one item.
          dtype: storage dtype; payloads must match it exactly.
          ring: overwrite the oldest items instead of refusing writes.
          max_staged: ring mode: the most items staged between commits.
          item_axes: logical names of the item axes, for sharding (a name,
            or None for an axis never sharded); None leaves them unnamed.
            The storage axes are ``("slots", *item_axes)``.
          recompute_source: sibling object(s) it can be rebuilt from.
          recompute_cost: estimated work to rebuild it.
          sharding: where the storage lives on a mesh (see
            :mod:`jax_session_state.sharding`), or None for the default device.
        """
        owner = "LatentBuffer.allocate"
        if not ring and max_staged:
            raise TypeError(f"{owner}: max_staged applies only to ring=True (append mode stages in place).")
        item_shape = tuple(v.positive_int(owner, "item_shape", d, minimum=0) for d in item_shape)
        spec = cls(
            maxlen=v.positive_int(owner, "maxlen", maxlen),
            item_shape=item_shape,
            dtype=np.dtype(dtype),
            item_axes=v.axis_names(owner, "item_axes", item_axes, len(item_shape)),
            ring=bool(ring),
            max_staged=v.positive_int(owner, "max_staged", max_staged, minimum=0),
            recompute_source=v.source_names(owner, recompute_source),
            recompute_cost=float(recompute_cost),
            sharding=v.sharding_rules(owner, sharding),
        )
        return spec.empty()

    def storage_axes(self) -> dict[str, Any]:
        return {"items": ("slots", *self.item_axes), **self._bookkeeping_axes()}

    def _empty_storage(self) -> dict[str, Any]:
        return {"items": jnp.zeros((self.slots, *self.item_shape), self.dtype), **self._bookkeeping()}

    @property
    def item_treedef(self) -> jax.tree_util.PyTreeDef:
        return jax.tree_util.tree_structure(0)

    @property
    def item_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct(self.item_shape, self.dtype),)

    def _buffers(self) -> Array:
        return self.items

    def _with_buffers(self, buffers: Array) -> LatentBuffer:
        return self.with_storage(items=buffers)

    def view(self, *, include_staged: bool = True) -> LatentView:
        """The visible items oldest to newest (a gather of ``maxlen`` items in ring mode)."""
        self._require_resident("view")
        start, end = self._visible_range(include_staged)
        if not self.ring:
            return LatentView(items=self.items, count=end)
        # The slots of positions end - maxlen .. end - 1, from the slot of ``end``
        # (the slot a write takes next: the step computes it once for both).
        index = jnp.arange(self.maxlen, dtype=jnp.int32)
        slots = jnp.where(end >= self.maxlen, lax.rem(end, self.slots) - self.maxlen + index, index)
        slots = jnp.where(slots < 0, slots + self.slots, slots)
        items = self.items.at[slots].get(mode="promise_in_bounds", wrap_negative_indices=False, unique_indices=True)
        return LatentView(items=items, count=end - start)

    # ------------------------------------------------------------ branches
    def branch_window(self, size: int | None) -> LatentBuffer:
        """A bounded buffer of ``size`` items for one lane's frames."""
        if size is None:
            raise TypeError(f"{self.describe()}: lanes need a window size (items per lane).")
        if self.ring and size > self.slots:
            raise ValueError(f"{self.describe()}: a lane window of {size} items exceeds the ring's {self.slots} slots.")
        return LatentBuffer.allocate(
            maxlen=size, item_shape=self.item_shape, dtype=self.dtype, item_axes=self.item_axes, sharding=self.sharding
        )

    def branch_view(self, window: LatentBuffer) -> LatentView:
        """The last ``maxlen`` of the committed items followed by the lane's items."""
        _, prefix_end = self._visible_range(include_staged=False)
        lane_items = window.count + window.staged
        end = prefix_end + lane_items
        start = jnp.maximum(end - self.maxlen, 0) if self.ring else 0
        position = start + jnp.arange(self.maxlen, dtype=jnp.int32)
        from_prefix = jnp.take(self.items, position % self.slots if self.ring else position, axis=0, mode="clip")
        from_lane = jnp.take(window.items, position - prefix_end, axis=0, mode="clip")
        lane = (position >= prefix_end).reshape(-1, *([1] * len(self.item_shape)))
        return LatentView(items=jnp.where(lane, from_lane, from_prefix), count=jnp.minimum(end - start, self.maxlen))

    def commit_window(self, window: LatentBuffer) -> LatentBuffer:
        """Appends the lane's items."""
        written, refused = self._write(
            [window.items], window.maxlen, staging=False, operation="commit_window", take=window.count + window.staged
        )
        return written._commit_staged(when=~refused)
