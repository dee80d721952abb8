"""``FixedState``: a pytree of constant-size arrays, replaced each commit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jax_session_state._core import _validation as v
from jax_session_state.accounting import SeenStorages, tree_bytes_by_device
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import allocator, overwrite
from jax_session_state.sharding import LogicalAxes

__all__ = ["FixedState"]


class FixedState(StateObject, kw_only=True):
    """A recurrent carry: linear-attention or SSM state, a causal-conv cache.

    Every commit replaces the whole value and must match its structure,
    shapes and dtypes exactly (``TypeError`` / ``ValueError`` otherwise): that
    is what keeps a jitted step from retracing.  A staged value takes the
    place of the committed one, which is kept beside it for ``discard()``
    (those bytes are reported by ``staged_nbytes_by_device``), so reading the
    value never selects between the two and ``commit()`` moves no data.  A
    carry usually cannot be recomputed, so ``evict()`` raises
    :class:`NotEvictableError` unless a recompute source is declared.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> carry = jss.FixedState.allocate(shapes={"h": (2, 16), "conv": (2, 3, 16)})
      >>> carry = carry.commit({"h": jnp.ones((2, 16)), "conv": jnp.ones((2, 3, 16))})
      >>> carry.view()["h"].sum()
      Array(32., dtype=float32)
    """

    treedef: jax.tree_util.PyTreeDef = struct.field(pytree_node=False)
    leaf_specs: tuple[jax.ShapeDtypeStruct, ...] = struct.field(pytree_node=False)
    leaf_axes: tuple[LogicalAxes, ...] = struct.field(pytree_node=False)

    value: Any = None
    """The value a reader sees, a pytree of the spec's shapes and dtypes: the
    staged one while ``has_staged``, else the committed one."""
    undo_value: Any = None
    """The committed value while a staged one is in ``value`` (what
    ``discard()`` restores), same spec; meaningful while ``has_staged``."""
    has_staged: jax.Array | None = None
    """``Bool[Array, ""]`` a value is staged."""

    data_fields = ("value",)
    capacity = 1
    """A carry holds one value."""

    @property
    def committed(self) -> jax.Array | None:
        """``Int[Array, ""]`` 1: a carry always holds a committed value (zeros until the first commit)."""
        return None if self.has_staged is None else jnp.ones((), jnp.int32)

    @property
    def staged(self) -> jax.Array | None:
        """``Int[Array, ""]`` 1 while a value is staged, else 0."""
        return None if self.has_staged is None else self.has_staged.astype(jnp.int32)

    @classmethod
    @allocator()
    def allocate(cls, *, shapes: Any, dtype: Any = jnp.float32, axes: Any = None, **options: Any) -> FixedState:
        """A zero-filled state of the given spec.

        Args:
          shapes: a pytree whose leaves are shape tuples (of ``dtype``),
            :class:`jax.ShapeDtypeStruct` or arrays (their shape and dtype).
          dtype: the dtype of leaves given as shape tuples.
          axes: logical names of each leaf's axes, for sharding: a pytree
            like ``shapes`` with a tuple per leaf (a name, or None for an
            axis never sharded), e.g. ``{"h": ("batch", "hidden")}``.  None
            leaves every axis unnamed.
          **options: how the object is managed
            (:class:`~jax_session_state.building_blocks.ManagedOptions`:
            ``recompute_source``, without which it is never evictable,
            ``recompute_cost``, ``sharding``).
        """
        owner = "FixedState.allocate"
        treedef, specs = v.leaf_specs(owner, shapes, dtype)
        return cls._allocated(
            options, treedef=treedef, leaf_specs=specs, leaf_axes=v.tree_axis_names(owner, "axes", axes, treedef, specs)
        )

    def storage_axes(self) -> dict[str, Any]:
        value = self.treedef.unflatten(self.leaf_axes)
        return {"value": value, "undo_value": value, "has_staged": ()}

    def _empty_storage(self) -> dict[str, Any]:
        def zeros() -> Any:
            return self.treedef.unflatten([jnp.zeros(s.shape, s.dtype) for s in self.leaf_specs])

        return {"value": zeros(), "undo_value": zeros(), "has_staged": jnp.zeros((), bool)}

    def describe(self) -> str:
        shapes = self.treedef.unflatten(
            [f"{v.dtype_name(s.dtype)}{list(s.shape)}" for s in self.leaf_specs]
        )
        return f"FixedState({shapes})"

    def _checked(self, payload: Any, operation: str) -> Any:
        v.check_tree(
            payload,
            owner=f"{self.describe()}.{operation}",
            what="value",
            treedef=self.treedef,
            leaves=self.leaf_specs,
        )
        return jax.tree_util.tree_map(jnp.asarray, payload)

    def _stage(self, payload: Any, operation: str) -> tuple[FixedState, bool]:
        """Puts ``payload`` (same spec exactly) in place of the value, keeping the committed one; never refused."""
        new = self.with_storage(
            value=overwrite(self.value, self._checked(payload, operation)),
            undo_value=self._committed(),
            has_staged=overwrite(self.has_staged, True),
        )
        return new, False

    def _write_and_commit(self, payload: Any, operation: str) -> FixedState:
        """Replaces the committed value (and any staged one) with ``payload``: no undo copy is kept."""
        return self.with_storage(
            value=overwrite(self.value, self._checked(payload, operation)),
            has_staged=overwrite(self.has_staged, False),
        )

    def _commit_staged(self, when: jax.Array | bool = True) -> FixedState:
        # The staged value is already in place: only the flag changes (not promoted: it stays staged).
        return self.with_storage(has_staged=self.has_staged & jnp.logical_not(when))

    def discard(self) -> FixedState:
        """Drops the staged value: the committed one comes back."""
        self._require_resident("discard")
        return self.with_storage(value=self._committed(), has_staged=overwrite(self.has_staged, False))

    def _committed(self) -> Any:
        return jax.tree_util.tree_map(
            lambda undo, value: jnp.where(self.has_staged, undo, value), self.undo_value, self.value
        )

    def view(self, *, include_staged: bool = True) -> Any:
        """The value: the staged one when included and present, else committed."""
        self._require_resident("view")
        return self.value if include_staged else self._committed()

    @property
    def evictable(self) -> bool:
        return bool(self.recompute_source)

    def staged_nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes of the slot that keeps the committed value while one is staged."""
        return tree_bytes_by_device(self.undo_value, seen)

    # ------------------------------------------------------------ branches
    def branch_window(self, size: int | None) -> FixedState:
        """A state of the same spec whose value is one lane's, once it stages one."""
        del size
        return self.empty()

    def branch_view(self, window: FixedState) -> Any:
        """The lane's value where it staged one, else the committed value."""
        return self.commit_window(window).value

    def commit_window(self, window: FixedState) -> FixedState:
        """The committed value replaced by the lane's, if it staged one."""
        value = jax.tree_util.tree_map(
            lambda lane, committed: jnp.where(window.has_staged, lane, committed), window.value, self.value
        )
        return self.with_storage(value=value)
