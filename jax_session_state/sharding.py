"""Placing session state on a :class:`jax.sharding.Mesh` by logical axis names.

Every kind names the axes of its storage with *logical* names (the sizing
argument of ``allocate`` each axis comes from), and one :class:`ShardingRules`
maps logical names to mesh axes for a whole session:

=================  ==========================================================
kind               logical axes of its storage
=================  ==========================================================
``KVCache``        k, v ``("batch", "kv_heads", "capacity", "head_dim")``;
                   bookkeeping ``(None, "batch")``
``EncodeOnceKV``   k, v ``("batch", "kv_heads", "capacity", "head_dim")``;
                   lengths ``("batch",)``; phase, refused ``()``
``FixedState``     each leaf: the names given as ``axes=`` at allocate
                   (unnamed, so never sharded, by default)
``LatentBuffer``   items ``("slots", *axes)``; bookkeeping ``(None,)``
``RetrievalStore`` keys ``("slots", "key_dim")``; each value leaf
                   ``("slots", *axes)``; bookkeeping ``(None,)``
``PagedKVCache``   pools ``("num_pages", "page_size", "kv_heads", "head_dim")``;
                   page table ``("max_slots", "max_pages_per_slot")``; lengths,
                   staged ``("max_slots",)``; refcounts, free list ``("num_pages",)``
=================  ==========================================================

One array's names are a :data:`LogicalAxes` tuple, ``None`` for an axis that
is never sharded.  An axis that holds several logical axes flattened (a
``KVCache`` allocated with ``batch=(B, P)`` stores ``B * P`` rows on one
axis, named ``("batch", "batch_1")``) is sharded over the mesh axes of all
its names, major first.  An axis whose name has no rule (or no name) is not sharded.  Objects remember
their rules (``allocate(..., sharding=rules)`` or :func:`shard`), so ``empty()``
allocates the same way and every lifecycle method returns storage sharded
exactly like its input: under ``jit`` with donation each shard is written in
place.

Example:
  >>> import jax
  >>> from jax.sharding import AxisType
  >>> import jax_session_state as jss
  >>> mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
  >>> rules = jss.ShardingRules(mesh, {"kv_heads": "model"})
  >>> kv = jss.KVCache.allocate(batch=1, kv_heads=4, head_dim=8, capacity=16, sharding=rules)
  >>> kv.k.sharding.spec
  P(None, 'model')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_session_state.errors import PayloadError, PayloadTypeError

__all__ = ["LogicalAxes", "ShardingRules", "shard"]


@runtime_checkable
class _Placeable(Protocol):
    """What :func:`shard` places as one: a StateObject (:meth:`~jax_session_state.StateObject.with_sharding`)."""

    def with_sharding(self, rules: ShardingRules) -> Any: ...

LogicalAxes = tuple["str | tuple[str, ...] | None", ...]
"""The logical name of each axis of one array (a tuple of names for flattened axes); None for an axis never
sharded."""

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, init=False)
class ShardingRules:
    """Where logical axes go on a mesh, written once for a whole session.

    Hashable and compared by value: objects keep it in their static spec, so
    equal rules never retrace a jitted step.

    Attributes:
      mesh: a mesh whose axes are all ``AxisType.Auto`` (sharding is
        propagated by XLA, which keeps each object's sharding through every
        write).
      axes: pairs ``(logical name, mesh axes)``, sorted by name.
      replicate_indivisible: an axis whose size does not divide its mesh
        axes is left unsharded instead of raising ``ValueError``.

    Example:
      >>> import jax
      >>> from jax.sharding import AxisType
      >>> mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
      >>> rules = ShardingRules(mesh, {"batch": "data", "kv_heads": "model"})
      >>> rules.partition_spec(("batch", "kv_heads", "capacity", "head_dim"), (2, 8, 64, 16))
      P('data', 'model')
    """

    mesh: Mesh
    axes: tuple[tuple[str, tuple[str, ...]], ...]
    replicate_indivisible: bool

    def __init__(
        self,
        mesh: Mesh,
        axes: Mapping[str, str | Sequence[str] | None],
        *,
        replicate_indivisible: bool = False,
    ) -> None:
        """Checks and stores the rules.

        Args:
          mesh: the mesh to place state on (every axis ``AxisType.Auto``).
          axes: logical axis name -> a mesh axis, several mesh axes (sharded
            over their product, major first), or None (not sharded).
          replicate_indivisible: leave an axis unsharded when its size does
            not divide the mesh axes, instead of raising.

        Raises:
          PayloadTypeError: ``mesh`` is not a Mesh, ``axes`` not a mapping, or
            a logical name is not a string.
          PayloadError: a logical name is empty, a mesh axis is not in the
            mesh or named twice for one logical axis, or an axis is not Auto.
        """
        if not isinstance(mesh, Mesh):
            raise PayloadTypeError(f"ShardingRules: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}.")
        not_auto = [name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Auto]
        if not_auto:
            raise PayloadError(
                f"ShardingRules: mesh axes {not_auto} are not AxisType.Auto (jax.make_mesh makes Explicit "
                "axes by default). Session state relies on XLA's sharding propagation; build the mesh "
                f"with jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * {len(mesh.axis_names)})."
            )
        if not isinstance(axes, Mapping):
            raise PayloadTypeError(
                f"ShardingRules: axes must map logical names to mesh axes; got {type(axes).__name__}."
            )
        normalised = []
        for name, target in axes.items():
            if not isinstance(name, str):
                raise PayloadTypeError(f"ShardingRules: logical axis names must be non-empty strings; got {name!r}.")
            if not name:
                raise PayloadError(f"ShardingRules: logical axis names must be non-empty strings; got {name!r}.")
            mesh_axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
            for axis in mesh_axes:
                if axis not in mesh.axis_names:
                    raise PayloadError(
                        f"ShardingRules: logical axis {name!r} maps to mesh axis {axis!r}, which is not "
                        f"in the mesh; it has {list(mesh.axis_names)}."
                    )
            if len(set(mesh_axes)) != len(mesh_axes):
                raise PayloadError(f"ShardingRules: logical axis {name!r} names a mesh axis twice: {mesh_axes}.")
            normalised.append((name, mesh_axes))
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "axes", tuple(sorted(normalised)))
        object.__setattr__(self, "replicate_indivisible", bool(replicate_indivisible))

    def __repr__(self) -> str:
        shape = ", ".join(f"{name!r}: {size}" for name, size in self.mesh.shape.items())
        axes = ", ".join(f"{name!r}: {mesh_axes}" for name, mesh_axes in self.axes)
        extra = ", replicate_indivisible=True" if self.replicate_indivisible else ""
        return f"ShardingRules(mesh={{{shape}}}, axes={{{axes}}}{extra})"

    def mesh_axes(self, name: str | tuple[str, ...] | None) -> tuple[str, ...]:
        """The mesh axes logical axis ``name`` is sharded over (empty: not sharded).

        A tuple of names (logical axes flattened into one) is sharded over
        each name's mesh axes in turn, major first.
        """
        if isinstance(name, tuple):
            return tuple(axis for part in name for axis in self.mesh_axes(part))
        return dict(self.axes).get(name, ()) if name is not None else ()

    def partition_spec(self, names: LogicalAxes, shape: Sequence[int], *, owner: str = "array") -> PartitionSpec:
        """The partition spec of an array of ``shape`` whose axes are ``names``.

        Args:
          names: the logical name of each axis (None: never sharded).
          shape: the array's shape.
          owner: names the array in messages.

        Raises:
          PayloadError: an axis does not divide its mesh axes (unless
            ``replicate_indivisible``), two axes use one mesh axis, or the
            names do not match the shape's rank.
        """
        if len(names) != len(shape):
            raise PayloadError(f"{owner}: {len(names)} logical axis names {names} for shape {list(shape)}.")
        spec: list[str | tuple[str, ...] | None] = []
        used: dict[str, str] = {}
        for name, size in zip(names, shape):
            mesh_axes = self.mesh_axes(name)
            ways = math.prod(self.mesh.shape[axis] for axis in mesh_axes)
            if size % ways:
                if not self.replicate_indivisible:
                    raise PayloadError(
                        f"{owner}: axis {name!r} of size {size} does not divide over mesh axes "
                        f"{mesh_axes} of size {ways}. Choose a size that is a multiple of {ways}, "
                        f"map {name!r} elsewhere, or pass replicate_indivisible=True to keep it whole."
                    )
                mesh_axes = ()
            for axis in mesh_axes:
                if axis in used:
                    raise PayloadError(
                        f"{owner}: axes {used[axis]!r} and {name!r} both map to mesh axis {axis!r}; "
                        "an array can use each mesh axis once."
                    )
                used[axis] = name
            spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        while spec and spec[-1] is None:  # the canonical form, which jit gives its outputs
            spec.pop()
        return PartitionSpec(*spec)

    def shardings(self, axes: Any, shapes: Any, *, owner: str) -> Any:
        """A pytree of :class:`NamedSharding`, one per leaf of ``shapes``.

        Args:
          axes: a pytree like ``shapes`` with a tuple of logical names where
            ``shapes`` has a leaf.
          shapes: arrays, tracers or :class:`jax.ShapeDtypeStruct`.
          owner: names the object in messages.
        """
        paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
        try:
            names = treedef.flatten_up_to(axes)
        except (TypeError, ValueError) as error:
            raise PayloadTypeError(
                f"{owner}: its storage_axes() do not name every storage leaf ({error}); a kind must give "
                "each storage array a tuple of logical axis names."
            ) from None
        return treedef.unflatten(
            [
                NamedSharding(
                    self.mesh,
                    self.partition_spec(
                        tuple(leaf_names), leaf.shape, owner=f"{owner} storage {jax.tree_util.keystr(path)}"
                    ),
                )
                for (path, leaf), leaf_names in zip(paths_and_leaves, names)
            ]
        )

    def constrain(self, axes: Any, values: Any, *, owner: str) -> Any:
        """``values`` placed by these rules: a sharding constraint under ``jit``, else ``device_put``.

        Arrays already placed so are returned as they are (no copy).
        """
        shardings = self.shardings(axes, values, owner=owner)
        return jax.tree_util.tree_map(_place, values, shardings)

    def replicated(self) -> NamedSharding:
        """A sharding that keeps a whole copy on every device of the mesh."""
        return NamedSharding(self.mesh, PartitionSpec())


def _place(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return place_global(x, sharding)


def place_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` placed on ``sharding``, also where the sharding spans devices of other processes.

    ``jax.device_put`` places an array one process holds whole (numpy, or a
    jax array on this process's devices) only on devices this process can
    address.  On a sharding over several processes each process instead
    puts its own shards, cut from its local value: every process calls this
    with the same value (as SPMD code does), a promise it does not check.
    Global arrays are moved by ``device_put``.  Typed PRNG keys are placed
    through their key data.
    """
    local = not isinstance(x, jax.Array) or x.is_fully_addressable
    if not local or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = place_global(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_value(x: Any) -> np.ndarray:
    """The host value of ``x`` as far as this process holds it, with no collective.

    An array this process holds whole (numpy, a jax array on its devices, or
    a global array replicated on one of them) comes back as numpy.  Of a
    global array split over several processes, the elements this process's
    shards hold are filled and the others masked (a ``numpy.ma`` array,
    whose ``tolist()`` gives None for them): what a host-side report on one
    process can say without waiting for the others.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    found = np.ma.masked_all(x.shape, x.dtype)
    for piece in x.addressable_shards:
        found[piece.index] = np.asarray(piece.data)
    return found.data if not np.ma.is_masked(found) else found


def shard(tree: T, rules: ShardingRules) -> T:
    """Places a Session, a StateObject or any pytree of them on ``rules.mesh``.

    Each object keeps ``rules`` in its spec (so ``empty()`` and every write
    keep the placement, resident or not); every other array in ``tree`` (a
    Session's ``attrs``) is replicated on the mesh.

    On a mesh that spans several processes (``jax.distributed``) every
    process calls it with its copy of the same tree, and each puts its own
    shards: an array it holds whole (an attr such as an RNG key, an object
    made without ``sharding=``) is cut from its local value, which must be
    equal on every process (as SPMD code makes it; it is not checked).

    Args:
      tree: a :class:`~jax_session_state.Session`, a
        :class:`~jax_session_state.StateObject`, or a pytree holding them.
      rules: where logical axes go.

    Returns:
      ``tree``, placed.

    Raises:
      PayloadError: an axis does not divide its mesh axes (see
        :meth:`ShardingRules.partition_spec`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import AxisType
      >>> import jax_session_state as jss
      >>> mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
      >>> session = jss.Session(
      ...     objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)},
      ...     attrs={"rng": jax.random.key(0)},
      ... )
      >>> session = jss.shard(session, jss.ShardingRules(mesh, {"kv_heads": "model"}))
      >>> session["kv"].k.sharding.spec, session["kv"].empty().k.sharding.spec
      (P(None, 'model'), P(None, 'model'))
    """
    if not isinstance(rules, ShardingRules):
        raise PayloadTypeError(f"shard() takes ShardingRules; got {type(rules).__name__}.")

    def place(x: Any) -> Any:
        if isinstance(x, _Placeable):
            return x.with_sharding(rules)
        if isinstance(x, jax.Array):
            return place_global(x, rules.replicated())
        return x

    return jax.tree_util.tree_map(place, tree, is_leaf=lambda x: isinstance(x, _Placeable))


def rules_or_none(owner: str, sharding: Any) -> ShardingRules | None:
    """Returns ``sharding`` when it is ShardingRules or None, else raises naming the argument.

    Raises:
      PayloadTypeError: ``sharding`` is something else.
    """
    if sharding is not None and not isinstance(sharding, ShardingRules):
        raise PayloadTypeError(
            f"{owner}: sharding must be jax_session_state.ShardingRules (logical axes -> mesh axes) "
            f"or None; got {type(sharding).__name__}."
        )
    return sharding
