"""Where a :class:`~jax_session_state.SessionPool` keeps its slots: one device, or a slot axis sharded on a mesh.

A pool allocated with ``sharding=NamedSharding(mesh, P("data"))`` splits its
leading ``slots`` axis over the mesh axis ``"data"`` (which may span JAX
processes): each device -- and so each process -- holds the shards of its
own slots, whole sessions, and every other axis of a slot stays on that
device.  A jitted, donated :meth:`~jax_session_state.SessionPool.map` then
steps every slot in one SPMD call with no communication between slots.

The stacked leaves are built from host copies of the template
(:func:`jax.make_array_from_callback`), so the template may live on a
process-local device while the pool spans every process; each process must
pass the same template (SPMD).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_session_state.errors import PayloadError, PayloadTypeError

__all__ = ["check_slot_sharding", "constrain_slots", "stacked_on_mesh"]


def check_slot_sharding(sharding: Any, slots: int) -> NamedSharding:
    """``sharding`` checked as a placement of a ``slots``-long slot axis.

    Raises:
      PayloadTypeError: ``sharding`` is not a :class:`NamedSharding`.
      PayloadError: its spec is not one entry (the slot axis), or ``slots``
        does not divide evenly over the mesh axes it names.
    """
    if not isinstance(sharding, NamedSharding):
        raise PayloadTypeError(
            "SessionPool.allocate: sharding places the slot axis and must be a jax.sharding.NamedSharding "
            f"such as NamedSharding(mesh, P('data')); got {type(sharding).__name__}."
        )
    if len(sharding.spec) != 1:
        raise PayloadError(
            "SessionPool.allocate: sharding's PartitionSpec names the slot axis only (one entry, e.g. "
            f"P('data')); got {sharding.spec} with {len(sharding.spec)} entries."
        )
    entry = sharding.spec[0]
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    ways = int(np.prod([sharding.mesh.shape[name] for name in names], dtype=np.int64))
    if slots % ways:
        raise PayloadError(
            f"SessionPool.allocate: slots={slots} must divide evenly over the {ways} devices of mesh axes "
            f"{names} that sharding {sharding.spec} splits the slot axis over; use a multiple of {ways}."
        )
    return sharding


def _leaf_sharding(sharding: NamedSharding, ndim: int) -> NamedSharding:
    """The slot axis as ``sharding`` says, every other axis of the leaf whole on its device."""
    del ndim  # trailing axes unnamed: whole on the device (the spec a jitted step returns, so no recompile)
    return NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0]))


def _stacked_leaf(x: Any, slots: int, sharding: NamedSharding) -> jax.Array:
    is_key = jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
    value = np.asarray(jax.random.key_data(x) if is_key else x)
    shape = (slots, *value.shape)
    stacked = np.broadcast_to(value, shape)
    array = jax.make_array_from_callback(shape, _leaf_sharding(sharding, value.ndim), lambda index: stacked[index])
    return jax.random.wrap_key_data(array, impl=jax.random.key_impl(x)) if is_key else array


def stacked_on_mesh(template: Any, slots: int, sharding: NamedSharding) -> tuple[Any, jax.Array, jax.Array]:
    """``template``'s leaves stacked ``slots`` times along a new slot axis placed by ``sharding``.

    Returns:
      The stacked tree, an all-False ``active`` mask sharded like the slot
      axis, and a replicated False ``refused`` flag.

    Raises:
      PayloadError: a leaf of ``template`` is not fully addressable (the
        template must be whole on this process: the pool shards slots, not
        the inside of a session).
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise PayloadError(
                f"SessionPool.allocate: template leaf {jax.tree_util.keystr(path)} spans processes "
                f"({leaf.sharding}); a pool with a sharded slot axis keeps each session whole on one device. "
                "Allocate the template unsharded (the same on every process)."
            )
    stacked = jax.tree_util.tree_map(lambda x: _stacked_leaf(x, slots, sharding), template)
    active = jax.make_array_from_callback((slots,), _leaf_sharding(sharding, 0), lambda i: np.zeros(slots, bool)[i])
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    refused = jax.make_array_from_callback((), replicated, lambda i: np.zeros((), bool))
    return stacked, active, refused


def replicated_scalar(value: Any, dtype: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` as a scalar replicated over ``sharding``'s mesh (the pool's tag)."""
    host = np.asarray(value, dtype)
    return jax.make_array_from_callback((), NamedSharding(sharding.mesh, PartitionSpec()), lambda i: host)


def constrain_slots(tree: Any, sharding: NamedSharding | None) -> Any:
    """Every leaf of ``tree`` kept split along its leading slot axis as ``sharding`` says (inside ``jit``)."""
    if sharding is None:
        return tree

    def constrain(x: Any) -> Any:
        if jnp.ndim(x) == 0:
            return x
        if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            return x
        return jax.lax.with_sharding_constraint(x, _leaf_sharding(sharding, jnp.ndim(x) - 1))

    return jax.tree_util.tree_map(constrain, tree)
