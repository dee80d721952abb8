"""``LatentBuffer``: recent frames or latent chunks, a ring or a bounded append."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array, lax

from jax_session_state._core import _validation as v
from jax_session_state.building_blocks import allocator
from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.objects._items import ItemBuffer
from jax_session_state.sharding import LogicalAxes

__all__ = ["LatentBuffer", "LatentView"]


class LatentView(struct.PyTreeNode):
    """Items oldest to newest.

    Attributes:
      items: ``Float[Array, "capacity *item_shape"]``; ``items[:count]`` are the
        visible items, oldest first; entries past ``count`` are unspecified.
      count: ``Int[Array, ""]`` number of visible items.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> frames = jss.LatentBuffer.allocate(capacity=3, item_shape=(2,)).append(jnp.ones((2, 2)))
      >>> view = frames.view()
      >>> int(view.count), view.materialize().shape
      (2, (2, 2))
    """

    items: Array
    count: Array

    def materialize(self) -> np.ndarray:
        """The visible items, oldest first, as a numpy array."""
        return np.asarray(self.items)[: int(self.count)]


class LatentBuffer(ItemBuffer, kw_only=True):
    """The last ``capacity`` frames or latent chunks of a rollout.

    With ``ring=True`` a write overwrites the oldest items (a model
    conditioned on recent frames); without, a write past ``capacity`` is a
    :class:`CapacityError` and writes nothing.  A payload is one item
    ``[*item_shape]`` or several ``[n, *item_shape]``.  A ring reserves
    ``max_staged`` extra slots so staged items never overwrite visible ones.
    A buffer allocated with ``demote_fn`` may be demoted (:meth:`demote`):
    every item is replaced by ``demote_fn(item)``, a cheaper form of it
    (pooled or compressed latents) that the model reads instead.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(8, 8), ring=True)
      >>> for t in range(6):
      ...     frames = frames.append(jnp.full((8, 8), float(t)))
      >>> view = frames.view()
      >>> int(view.count), view.items[:, 0, 0].tolist()
      (4, [2.0, 3.0, 4.0, 5.0])
    """

    capacity: int = struct.field(pytree_node=False)
    item_shape: tuple[int, ...] = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)
    axes: LogicalAxes = struct.field(pytree_node=False)
    ring: bool = struct.field(pytree_node=False, default=False)
    max_staged: int = struct.field(pytree_node=False, default=0)
    demote_fn: Callable[[Array], Array] | None = struct.field(pytree_node=False, default=None)

    items: Array | None = None
    """``Float[Array, "slots *item_shape"]`` in slot order."""

    data_fields = ("items",)

    @classmethod
    @allocator()
    def allocate(
        cls,
        *,
        capacity: int | None = None,
        item_shape: tuple[int, ...],
        dtype: Any = jnp.float32,
        ring: bool = False,
        max_staged: int = 0,
        axes: tuple[str | None, ...] | None = None,
        demote_fn: Callable[[Array], Array] | None = None,
        **options: Any,
    ) -> LatentBuffer:
        """An empty buffer.

        Args:
          capacity: items kept (and visible).
          item_shape: the shape of one item, a tuple of ints (``(n,)`` for
            ``n`` values; a bare int is refused).
          dtype: storage dtype; payloads must match it exactly.
          ring: overwrite the oldest items instead of refusing writes.
          max_staged: ring mode: the most items staged between commits.
          axes: logical names of the item axes, for sharding (a name, or
            None for an axis never sharded); None leaves them unnamed.  The
            storage axes are ``("slots", *axes)``.
          demote_fn: makes the buffer demotable: one item ``[*item_shape]``
            to its cheaper form (one array, any shape and dtype), applied to
            every slot by :meth:`demote`.  How lossy it is is the function's
            own bound.  Not saved by checkpoints (a function is code, not
            state): a restored buffer has none.
          **options: how the object is managed
            (:class:`~jax_session_state.building_blocks.ManagedOptions`:
            ``recompute_source``, ``recompute_cost``, ``sharding``).
        """
        owner = "LatentBuffer.allocate"
        capacity = v.required(owner, "capacity", capacity)
        if not ring and max_staged:
            raise PayloadTypeError(f"{owner}: max_staged applies only to ring=True (append mode stages in place).")
        if not isinstance(item_shape, (tuple, list)):
            raise PayloadTypeError(
                f"{owner}: item_shape must be a tuple of ints, the shape of one item ((n,) for n values); "
                f"got {item_shape!r}."
            )
        item_shape = tuple(v.positive_int(owner, "item_shape", d, minimum=0) for d in item_shape)
        return cls._allocated(
            options,
            capacity=v.positive_int(owner, "capacity", capacity),
            item_shape=item_shape,
            dtype=np.dtype(dtype),
            axes=v.axis_names(owner, "axes", axes, len(item_shape)),
            ring=bool(ring),
            max_staged=v.positive_int(owner, "max_staged", max_staged, minimum=0),
            demote_fn=v.optional_callable(owner, "demote_fn", demote_fn),
        )

    @property
    def demotable(self) -> bool:
        """Whether a ``demote_fn`` was declared."""
        return self.demote_fn is not None

    def demote(self) -> LatentBuffer:
        """Every item replaced by ``demote_fn(item)``; counts and staged items are kept.

        Returns:
          A buffer of the demoted items' shape and dtype, with no further
          ``demote_fn``.

        Raises:
          NotDemotableError: no ``demote_fn`` was declared.
          PayloadTypeError: ``demote_fn`` does not return one array per item.

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(4, 2), demote_fn=lambda x: x.mean(axis=0))
          >>> frames = frames.append(jnp.arange(16.0).reshape(2, 4, 2))  # two items of shape (4, 2)
          >>> low = frames.demote()
          >>> low.item_shape, low.view().materialize().tolist(), low.demotable
          ((2,), [[3.0, 4.0], [11.0, 12.0]], False)
        """
        self._require_resident("demote")
        if self.demote_fn is None:
            return super().demote()
        item = jax.ShapeDtypeStruct(self.item_shape, self.dtype)
        out = jax.eval_shape(self.demote_fn, item)  # checked before anything is computed
        if not isinstance(out, jax.ShapeDtypeStruct):
            raise PayloadTypeError(
                f"{self.describe()}.demote: demote_fn must return one array per item; it returned "
                f"{jax.tree_util.tree_structure(out)} for an item of shape {list(self.item_shape)}."
            )
        demoted = self.replace(
            item_shape=tuple(out.shape), dtype=np.dtype(out.dtype), axes=(None,) * len(out.shape),
            demote_fn=None, items=None,
        )
        return demoted.with_storage(items=jax.vmap(self.demote_fn)(self.items))

    def storage_axes(self) -> dict[str, Any]:
        return {"items": ("slots", *self.axes), **self._bookkeeping_axes()}

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
        """The visible items oldest to newest (a gather of ``capacity`` items in ring mode)."""
        self._require_resident("view")
        start, end = self._visible_range(include_staged)
        if not self.ring:
            return LatentView(items=self.items, count=end)
        # The slots of positions end - capacity .. end - 1, from the slot of ``end``
        # (the slot a write takes next: the step computes it once for both).
        index = jnp.arange(self.capacity, dtype=jnp.int32)
        slots = jnp.where(end >= self.capacity, lax.rem(end, self.slots) - self.capacity + index, index)
        slots = jnp.where(slots < 0, slots + self.slots, slots)
        items = self.items.at[slots].get(mode="promise_in_bounds", wrap_negative_indices=False, unique_indices=True)
        return LatentView(items=items, count=end - start)

    # ------------------------------------------------------------ branches
    def branch_window(self, size: int | None) -> LatentBuffer:
        """A bounded buffer of ``size`` items for one lane's frames.

        Raises:
          PayloadTypeError: ``size`` is None or not an int (a bool is not one).
          PayloadError: ``size`` is below 1, or exceeds a ring's slots.
        """
        if size is None:
            raise PayloadTypeError(f"{self.describe()}: lanes need a window size (items per lane).")
        size = v.positive_int(f"{self.describe()}.branch_window", "size", size)
        if self.ring and size > self.slots:
            raise PayloadError(
                f"{self.describe()}: a lane window of {size} items exceeds the ring's {self.slots} slots."
            )
        return LatentBuffer.allocate(
            capacity=size, item_shape=self.item_shape, dtype=self.dtype, axes=self.axes, sharding=self.sharding
        )

    def branch_view(self, window: LatentBuffer) -> LatentView:
        """The last ``capacity`` of the committed items followed by the lane's items."""
        _, prefix_end = self._visible_range(include_staged=False)
        lane_items = window.committed + window.staged
        end = prefix_end + lane_items
        start = jnp.maximum(end - self.capacity, 0) if self.ring else 0
        position = start + jnp.arange(self.capacity, dtype=jnp.int32)
        from_prefix = jnp.take(self.items, position % self.slots if self.ring else position, axis=0, mode="clip")
        from_lane = jnp.take(window.items, position - prefix_end, axis=0, mode="clip")
        lane = (position >= prefix_end).reshape(-1, *([1] * len(self.item_shape)))
        return LatentView(items=jnp.where(lane, from_lane, from_prefix), count=jnp.minimum(end - start, self.capacity))

    def commit_window(self, window: LatentBuffer) -> LatentBuffer:
        """Appends the lane's items; the window's refused writes are added to this buffer's."""
        written, refused = self._write(
            [window.items],
            window.capacity,
            staging=False,
            operation="commit_window",
            take=window.committed + window.staged,
        )
        return written._commit_staged(when=~refused)._with_refusals_of(window)
