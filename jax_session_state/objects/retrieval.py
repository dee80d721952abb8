"""``RetrievalStore``: a fixed-capacity memory bank with jittable top-k lookup."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jax_session_state._core import _validation as v
from jax_session_state.building_blocks import allocator
from jax_session_state.errors import PayloadError
from jax_session_state.objects import _ring
from jax_session_state.objects._items import ItemBuffer
from jax_session_state.sharding import LogicalAxes

__all__ = ["RetrievalStore", "RetrievalView", "Retrieved"]


class RetrievalView(struct.PyTreeNode):
    """The bank in slot order, with which slots are visible and how old they are.

    Attributes:
      keys: ``Float[Array, "slots key_dim"]``.
      values: the values pytree, each leaf ``[slots, ...]``.
      valid: ``Bool[Array, "slots"]`` visible entries.
      age: ``Int[Array, "slots"]`` 0 for the newest entry, -1 where not valid.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> bank = jss.RetrievalStore.allocate(capacity=3, key_dim=2, value_shapes=(1,))
      >>> view = bank.append((jnp.eye(2), jnp.ones((2, 1)))).view()
      >>> view.valid.tolist(), view.age.tolist()
      ([True, True, False], [1, 0, -1])
    """

    keys: Array
    values: Any
    valid: Array
    age: Array

    def materialize(self) -> dict[str, Any]:
        """The visible entries, oldest first, as numpy."""
        valid, age = np.asarray(self.valid), np.asarray(self.age)
        slots = np.flatnonzero(valid)
        slots = slots[np.argsort(-age[slots], kind="stable")]
        return {
            "keys": np.asarray(self.keys)[slots],
            "values": jax.tree_util.tree_map(lambda x: np.asarray(x)[slots], self.values),
        }


class Retrieved(NamedTuple):
    """The result of :meth:`RetrievalStore.retrieve`, best match first.

    Attributes:
      scores: ``Float[Array, "... k"]`` dot products; -inf where not valid.
      values: the values pytree, each leaf ``[..., k, ...]``.
      slots: ``Int[Array, "... k"]`` slots of the matches.
      valid: ``Bool[Array, "... k"]`` False only when fewer than k entries exist.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> bank = jss.RetrievalStore.allocate(capacity=4, key_dim=2, value_shapes=(1,))
      >>> bank = bank.append((jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[10.0], [20.0]])))
      >>> hit = bank.retrieve(jnp.array([0.2, 0.9]), k=3)
      >>> hit.values[:, 0].tolist()[:2], hit.valid.tolist()
      ([20.0, 10.0], [True, True, False])
    """

    scores: Array
    values: Any
    slots: Array
    valid: Array


class RetrievalStore(ItemBuffer, kw_only=True):
    """Keys and values of a retrieval memory; inserting into a full bank replaces the oldest.

    Entries are ``(key, value)`` pairs: ``key: Float[Array, "key_dim"]`` and
    ``value`` a pytree of the value spec; insert one pair or a batch
    (``keys [n, key_dim]``, values with a leading ``n``).  ``max_staged``
    slots beyond ``capacity`` hold staged entries so a ``discard()`` never
    loses committed ones.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> bank = jss.RetrievalStore.allocate(capacity=4, key_dim=3, value_shapes=(2,))
      >>> bank = bank.append((jnp.eye(3), jnp.arange(6.0).reshape(3, 2)))
      >>> hit = bank.retrieve(jnp.array([0.0, 1.0, 0.0]), k=1)
      >>> hit.values.tolist(), hit.slots.tolist()
      ([[2.0, 3.0]], [1])
    """

    capacity: int = struct.field(pytree_node=False)
    key_dim: int = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)
    value_treedef: jax.tree_util.PyTreeDef = struct.field(pytree_node=False)
    value_specs: tuple[jax.ShapeDtypeStruct, ...] = struct.field(pytree_node=False)
    axes: tuple[LogicalAxes, ...] = struct.field(pytree_node=False)
    max_staged: int = struct.field(pytree_node=False, default=0)

    keys: Array | None = None
    """``Float[Array, "slots key_dim"]`` in slot order."""
    values: Any = None
    """Values pytree, each leaf ``[slots, ...]``."""

    ring = True
    data_fields = ("keys", "values")

    @classmethod
    @allocator()
    def allocate(
        cls,
        *,
        capacity: int,
        key_dim: int,
        value_shapes: Any,
        dtype: Any = jnp.float32,
        max_staged: int = 0,
        axes: Any = None,
        **options: Any,
    ) -> RetrievalStore:
        """An empty bank.

        Args:
          capacity: entries kept.
          key_dim: size of each key.
          value_shapes: the spec of one value: a shape tuple, or a pytree of
            shape tuples / :class:`jax.ShapeDtypeStruct`.
          dtype: dtype of keys and of values given as shape tuples.
          max_staged: the most entries staged between commits.
          axes: logical names of each value leaf's axes, for sharding: a
            pytree like ``value_shapes`` with a tuple per leaf (a name, or
            None for an axis never sharded); None leaves them unnamed.  The
            storage axes are ``("slots", "key_dim")`` for keys and
            ``("slots", *axes)`` for each value leaf.
          **options: how the object is managed
            (:class:`~jax_session_state.building_blocks.ManagedOptions`:
            ``recompute_source``, ``recompute_cost``, ``sharding``).
        """
        owner = "RetrievalStore.allocate"
        value_treedef, value_specs = v.leaf_specs(owner, value_shapes, dtype)
        return cls._allocated(
            options,
            capacity=v.positive_int(owner, "capacity", capacity),
            key_dim=v.positive_int(owner, "key_dim", key_dim),
            dtype=np.dtype(dtype),
            value_treedef=value_treedef,
            value_specs=value_specs,
            axes=v.tree_axis_names(owner, "axes", axes, value_treedef, value_specs),
            max_staged=v.positive_int(owner, "max_staged", max_staged, minimum=0),
        )

    def storage_axes(self) -> dict[str, Any]:
        values = self.value_treedef.unflatten([("slots", *axes) for axes in self.axes])
        return {"keys": ("slots", "key_dim"), "values": values, **self._bookkeeping_axes()}

    def _empty_storage(self) -> dict[str, Any]:
        values = self.value_treedef.unflatten(
            [jnp.zeros((self.slots, *s.shape), s.dtype) for s in self.value_specs]
        )
        return {"keys": jnp.zeros((self.slots, self.key_dim), self.dtype), "values": values, **self._bookkeeping()}

    @property
    def item_treedef(self) -> jax.tree_util.PyTreeDef:
        return jax.tree_util.tree_structure((0, self.value_treedef.unflatten([0] * self.value_treedef.num_leaves)))

    @property
    def item_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((self.key_dim,), self.dtype), *self.value_specs)

    def _buffers(self) -> Any:
        return (self.keys, self.values)

    def _with_buffers(self, buffers: Any) -> RetrievalStore:
        keys, values = buffers
        return self.with_storage(keys=keys, values=values)

    def view(self, *, include_staged: bool = True) -> RetrievalView:
        """The bank in slot order with validity and age (no copy of the bank)."""
        self._require_resident("view")
        start, end = self._visible_range(include_staged)
        positions = _ring.slot_positions(self.slots, end, sink=0, ring=self.slots)
        valid = _ring.visible(positions, start=start, end=end)
        age = jnp.where(valid, end - 1 - positions, -1)
        return RetrievalView(keys=self.keys, values=self.values, valid=valid, age=age)

    def retrieve(self, query: Array, k: int, *, include_staged: bool = True) -> Retrieved:
        """The ``k`` entries whose keys have the largest dot product with ``query``.

        Args:
          query: ``Float[Array, "... key_dim"]``.
          k: matches per query (static).
          include_staged: whether staged entries can match.

        Returns:
          :class:`Retrieved`, best first.  Invalid slots are never returned
          while valid ones remain; when fewer than ``k`` entries exist the
          tail has ``valid=False`` and ``scores=-inf``.

        Raises:
          PayloadTypeError: ``k`` is not an int (a bool is not one).
          PayloadError: ``k`` is outside ``[1, capacity + max_staged]`` (the slots), or ``query`` does
            not end in ``key_dim``.
        """
        view = self.view(include_staged=include_staged)
        owner = f"{self.describe()}.retrieve"
        k = v.positive_int(owner, "k", k)
        if k > self.slots:
            raise PayloadError(f"{owner}: k must lie in [1, {self.slots}]; got {k}.")
        if query.shape[-1:] != (self.key_dim,):
            raise PayloadError(f"{owner}: query must end in key_dim={self.key_dim}; got shape {list(query.shape)}.")
        scores = jnp.einsum("...d,sd->...s", query.astype(self.keys.dtype), self.keys)
        scores = jnp.where(view.valid, scores, -jnp.inf)
        top, slots = jax.lax.top_k(scores, k)
        values = jax.tree_util.tree_map(lambda x: jnp.take(x, slots, axis=0), self.values)
        return Retrieved(scores=top, values=values, slots=slots, valid=jnp.take(view.valid, slots))
