"""``StateObject``: the abstract pytree contract every kind of state follows.

A state object is a frozen dataclass registered as a pytree
(:class:`flax.struct.PyTreeNode`).  Arrays are leaves; sizes, dtypes, mode
flags and the recompute edge are static fields.  Per-step methods (``stage``,
``commit``, ``discard``, ``append``, ``view``) are pure and jittable and keep
the pytree structure, shapes and dtypes unchanged, so a jitted step compiles
once and a donated input aliases its output: under ``jax.jit`` with donation a
write costs what it writes, not what the object holds.

Writes are two-phase: ``stage`` holds data for the in-progress window (seen
only by ``view(include_staged=True)``), ``commit()`` makes it persistent and
``discard()`` drops it without touching committed data.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
  >>> step = jax.jit(lambda c, k, v: c.append((k, v)), donate_argnums=0)
  >>> kv = step(kv, jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4)))
  >>> kv.view().lengths
  Array([3], dtype=int32)
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_session_state._core import _validation as v
from jax_session_state._core._validation import non_negative
from jax_session_state.accounting import SeenStorages, tree_bytes_by_device
from jax_session_state.building_blocks import _MANAGEMENT_FIELDS, Fill, check_same_spec, overwrite
from jax_session_state.errors import (
    CapacityError,
    DonatedError,
    NotDemotableError,
    NotEvictableError,
    NotResidentError,
    PayloadTypeError,
)
from jax_session_state.sharding import ShardingRules, local_value, rules_or_none

__all__ = [
    "StateObject", "check", "is_state_object", "state_object_classes",
]

Self = TypeVar("Self", bound="StateObject")

_DEFINED: dict[str, type[StateObject]] = {}
"""Every StateObject subclass defined at module level in this process, by ``"module:QualName"``."""

class StateObject(struct.PyTreeNode, abc.ABC, kw_only=True):
    """Abstract base of every kind of session state.

    Subclasses declare their storage as pytree fields and their spec as static
    fields (``struct.field(pytree_node=False)``), and implement ``allocate``,
    ``_empty_storage``, ``_stage``, ``_commit_staged``, ``discard`` and
    ``view``; writes return :meth:`with_storage`, and :meth:`storage_axes`
    names the storage axes for sharding.  A non-resident object (after
    ``evict`` or ``reset``) keeps its static spec and holds None in every
    storage field.

    Attributes:
      recompute_source: names of sibling objects in the same session this
        object can be recomputed from (empty when it cannot be recomputed).
      recompute_cost: estimated work to recompute it, a number >= 0 (any
        unit, compared across objects by the eviction planner).
      sharding: where the storage lives on a mesh
        (:class:`~jax_session_state.ShardingRules` over the logical axes of
        :meth:`storage_axes`), or None for the default device.  Kept when
        the object is evicted or reset, so ``empty()`` allocates the same way.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
      >>> tried = kv.stage((jnp.ones((1, 2, 1, 2)),) * 2)  # in the window, not yet committed
      >>> isinstance(kv, jss.StateObject), [int(tried.view(include_staged=s).lengths[0]) for s in (True, False)]
      (True, [2, 0])
    """

    recompute_source: tuple[str, ...] = struct.field(pytree_node=False, default=())
    recompute_cost: float = struct.field(pytree_node=False, default=0.0)
    sharding: ShardingRules | None = struct.field(pytree_node=False, default=None)

    # Whether a write can overflow (and so be refused under jit).
    can_overflow: ClassVar[bool] = False
    # The storage fields that hold data (the rest is bookkeeping: counts, flags).
    data_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "<locals>" not in cls.__qualname__:  # a class made inside a function cannot be named by a checkpoint
            _DEFINED[f"{cls.__module__}:{cls.__qualname__}"] = cls

    def __post_init__(self) -> None:
        # ``replace(recompute_source="prompt")`` means one name, as ``allocate`` reads it.
        if isinstance(self.recompute_source, str):
            object.__setattr__(self, "recompute_source", (self.recompute_source,))

    # ------------------------------------------------------------------ spec
    @classmethod
    @abc.abstractmethod
    def allocate(cls: type[Self], **kwargs: Any) -> Self:
        """Returns an empty, resident object; keyword-only sizing arguments."""

    @classmethod
    def _allocated(cls: type[Self], options: Mapping[str, Any], **spec: Any) -> Self:
        """An empty object of this spec, managed as ``options`` (:class:`ManagedOptions`) say.

        What every ``allocate`` ends in, once it has checked its sizes
        (``allocate`` itself is wrapped by :func:`allocator`, which refuses
        unknown keywords first).
        """
        owner = f"{cls.__name__}.allocate"
        spec_object = cls(
            **spec,
            recompute_source=v.source_names(owner, options.get("recompute_source", ())),
            recompute_cost=float(non_negative(owner, "recompute_cost", options.get("recompute_cost", 0.0))),
            sharding=rules_or_none(owner, options.get("sharding")),
        )
        return spec_object.empty()

    @abc.abstractmethod
    def _empty_storage(self) -> dict[str, Any]:
        """The storage fields of an empty object of this spec, freshly allocated."""

    def empty(self: Self) -> Self:
        """A new empty, resident object with this object's spec (new buffers).

        A sharded object allocates each shard on its own device (nothing is
        built whole on one device first).
        """
        if self.sharding is None:
            return self.replace(**self._empty_storage())
        shardings = self.sharding.shardings(
            self.storage_axes(), jax.eval_shape(self._empty_storage), owner=self.describe()
        )
        return self.replace(**jax.jit(self._empty_storage, out_shardings=shardings)())

    def storage_shapes(self) -> dict[str, Any]:
        """The shape and dtype of every storage leaf of this spec, allocating nothing.

        Returns:
          A dict like the storage (field name -> pytree) of
          :class:`jax.ShapeDtypeStruct`, what ``jax.eval_shape`` gives for an
          empty object's storage.

        Example:
          >>> import jax_session_state as jss
          >>> jss.FixedState.allocate(shapes=(2, 3)).storage_shapes()["value"]
          ShapeDtypeStruct(shape=(2, 3), dtype=float32)
        """
        return jax.eval_shape(self._empty_storage)

    def storage_axes(self) -> dict[str, Any]:
        """The logical name of each axis of each storage leaf.

        Returns:
          A dict like the storage (field name -> pytree) holding, where the
          storage has an array, a tuple with one name (or None: never
          sharded) per axis.  Kinds name their axes after the ``allocate``
          argument that sizes them (``"batch"``, ``"kv_heads"``, ...); this
          default names none, so an object of a kind that does not override
          it is replicated on a mesh.
        """
        return jax.tree_util.tree_map(lambda leaf: (None,) * leaf.ndim, self.storage_shapes())

    def with_storage(self: Self, **storage: Any) -> Self:
        """A copy holding this new storage; what every write returns.

        Each new storage pytree must have the structure, shapes and dtypes of
        the one it replaces (checked at trace time, as a changed one would
        make a jitted step compile again and break donation).  On a sharded
        object the storage is placed by ``sharding`` (a sharding constraint
        under ``jit``), so every lifecycle method returns storage sharded
        exactly like its input and donation aliases each shard.  Kinds
        return their writes through here rather than ``replace``.

        Raises:
          PayloadTypeError: a new storage pytree differs from the one it replaces.
        """
        for name, new in storage.items():
            check_same_spec(self, name, getattr(self, name), new)
        if self.sharding is not None:
            axes = self.storage_axes()
            storage = self.sharding.constrain(
                {name: axes[name] for name in storage}, storage, owner=self.describe()
            )
        return self.replace(**storage)

    def with_sharding(self: Self, rules: ShardingRules) -> Self:
        """This object placed by ``rules``, which it keeps in its spec (what :func:`~jax_session_state.shard` calls).

        ``empty()`` and every write then keep the placement, resident or not.
        """
        storage = {name: getattr(self, name) for name in self.storage_fields()} if self.resident else {}
        return self.replace(sharding=rules).with_storage(**storage)

    @classmethod
    @functools.cache
    def storage_fields(cls) -> tuple[str, ...]:
        """Names of the fields that hold storage (the pytree children)."""
        return tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.metadata.get("pytree_node", True)
        )

    @classmethod
    @functools.cache
    def spec_fields(cls) -> tuple[str, ...]:
        """Names of the static fields that size the storage (the spec).

        Without the recompute edge, the placement (``sharding``) and a
        demotion function, which say how the object is managed, not what it
        holds.
        """
        return tuple(
            f.name
            for f in dataclasses.fields(cls)
            if not f.metadata.get("pytree_node", True)
            and f.name not in _MANAGEMENT_FIELDS
        )

    def describe(self) -> str:
        """A short name for messages: the kind and its spec, no array values."""
        spec = ", ".join(f"{name}={_spec_repr(getattr(self, name))}" for name in self.spec_fields())
        return f"{type(self).__name__}({spec})"

    def __repr__(self) -> str:
        state = "resident" if self.resident else "not resident"
        source = f", recompute_source={self.recompute_source}" if self.recompute_source else ""
        return f"{self.describe()[:-1]}{source}) <{state}>"

    # ------------------------------------------------------------- lifecycle
    @abc.abstractmethod
    def _stage(self: Self, payload: Any, operation: str) -> tuple[Self, Any]:
        """Checks and writes ``payload`` after the committed data, replacing what is staged.

        Args:
          payload: the kind's payload; its structure, shapes and dtypes are
            checked at trace time (``TypeError`` / ``ValueError`` naming the
            object and ``operation``).
          operation: the public method, for messages.

        Returns:
          The new object and whether the write was refused (a bool or a
          traced bool).  A refused write writes nothing: eagerly it raises at
          once, under ``jit`` it sets ``overflowed``.
        """

    @abc.abstractmethod
    def _commit_staged(self: Self, when: Any = True) -> Self:
        """Promotes what is staged to committed, where ``when`` (a bool, maybe traced)."""

    def stage(self: Self, payload: Any) -> Self:
        """Holds ``payload`` for the in-progress window, replacing what was staged.

        Visible only to ``view(include_staged=True)`` until ``commit()``.
        Staging again before a commit replaces the staged data rather than
        adding to it, so a frame staged once per denoising step leaves one
        copy visible, the last; a refused write leaves what was staged.
        """
        self._require_resident("stage")
        return self._stage(payload, "stage")[0]

    def commit(self: Self, payload: Any = None) -> Self:
        """Makes data persistent.

        Args:
          payload: written after the committed data in place of anything
            staged, and committed (``commit(p)`` equals
            ``stage(p).commit()``: the clean frame of a denoising loop
            replaces its last noisy staging).  When None, what is staged is
            promoted.  A refused write commits nothing.

        Returns:
          The new object.
        """
        self._require_resident("commit")
        if payload is None:
            return self._commit_staged()
        return self._write_and_commit(payload, "commit")

    def append(self: Self, payload: Any) -> Self:
        """Stages and commits ``payload`` in one write (replacing what was staged): ``commit(payload)``, its
        errors naming ``append``."""
        self._require_resident("append")
        return self._write_and_commit(payload, "append")

    def _write_and_commit(self: Self, payload: Any, operation: str) -> Self:
        """Writes ``payload`` in place of what is staged and commits it, unless refused; messages name ``operation``."""
        written, refused = self._stage(payload, operation)
        return written._commit_staged(when=jnp.logical_not(refused))

    @abc.abstractmethod
    def discard(self: Self) -> Self:
        """Drops what is staged; committed data is never touched."""

    @abc.abstractmethod
    def view(self, *, include_staged: bool = True) -> Any:
        """What attention kernels and the pipeline read: a small pytree."""

    # ------------------------------------------------------------ branches
    # What a kind does under Session.branch unless it says otherwise: lanes read its committed data
    # and cannot write it (no window). Kinds that stage in place (K/V caches, frame buffers) override
    # these three so each lane writes its own small window.
    def branch_window(self, size: int | None) -> Any:
        """An empty window for one speculative lane's writes, or None if shared.

        Lanes made by :meth:`Session.branch` share this object's committed
        data and write only into their own window (a small object of a kind
        that stages in place).  None means lanes read this object but cannot
        write it.

        Args:
          size: how many entries (rows, items) one lane may write; kinds that
            replace their value ignore it.

        Example:
          >>> import jax_session_state as jss
          >>> store = jss.RetrievalStore.allocate(capacity=4, key_dim=2, value_shapes=(3,))
          >>> store.branch_window(8) is None  # lanes read the bank; none writes it
          True
        """
        del size
        return None

    def branch_view(self, window: Any) -> Any:
        """What a lane reads: the committed data, then the lane's window."""
        del window
        return self.view(include_staged=False)

    def commit_window(self, window: Any) -> Any:
        """This object with a lane's window written after its committed data."""
        del window
        return self

    # ---------------------------------------------------------- bookkeeping
    # Every kind also answers ``committed`` and ``staged`` (``Int`` arrays:
    # entries committed, and staged after them, per batch row or slot where
    # the kind has rows; None when not resident) and ``capacity`` (the most
    # entries visible per row, static), with the same meaning everywhere:
    # a field or a property of the kind, so they are not declared here.
    @property
    def staging_margin(self) -> int:
        """Storage slots held beyond :attr:`capacity` for staged entries (static; 0 where none)."""
        return 0

    @property
    def overflowed(self) -> jax.Array | None:
        """``Bool[Array, ""]`` a write was refused under jit (always False where writes cannot overflow)."""
        return None if not self.resident else jnp.zeros((), bool)

    def holds_staged(self) -> jax.Array:
        """Whether anything is staged: a bool array (False when not resident)."""
        return jnp.any(self.staged > 0) if self.resident else jnp.zeros((), bool)

    def fill(self) -> Fill:
        """How full it is, for reports (host values; a non-resident object reports None counts).

        Of an object whose counts are split over several processes (rows on
        other processes' devices), each process reports the rows it holds
        and None for the others; no process waits for another.
        """
        if not self.resident:
            return Fill(None, None, self.capacity, self.staging_margin)
        self._require_not_donated("fill")
        committed, staged = local_value(self.committed).tolist(), local_value(self.staged).tolist()
        return Fill(committed, staged, self.capacity, self.staging_margin)

    # ---------------------------------------------------------------- tiers
    @property
    def demotable(self) -> bool:
        """Whether :meth:`demote` has a cheaper form of this object to return."""
        return False

    def demote(self: Self) -> Self:
        """The next lower tier of this object: a cheaper, lossy form that reads the same way.

        Raises:
          NotDemotableError: the object declares no lower tier (this default).
        """
        raise NotDemotableError(
            f"{self.describe()} has no lower tier to demote to; kinds that have one declare it at "
            "allocate (KVCache tiers=, LatentBuffer demote_fn=)."
        )

    # ------------------------------------------------------------ residency
    @property
    def resident(self) -> bool:
        """Whether the object holds storage."""
        return getattr(self, self.storage_fields()[0]) is not None

    @property
    def evictable(self) -> bool:
        """Whether ``evict()`` may release this object's storage."""
        return True

    def evict(self: Self) -> tuple[Self, int]:
        """Releases the storage.

        Returns:
          The non-resident object (it keeps its static spec) and the bytes
          freed.

        Raises:
          NotEvictableError: this object may never be evicted.
        """
        if not self.evictable:
            raise NotEvictableError(
                f"{self.describe()} cannot be evicted: it has no recompute source, "
                "so its contents could not be recomputed. Declare recompute_source= "
                "at allocate, park it to host memory, or reset() it deliberately."
            )
        freed = self.nbytes if self.resident else 0
        return self.reset(), freed

    def reset(self: Self) -> Self:
        """Back to the unallocated (non-resident) state; the spec is kept."""
        return self.replace(**{name: None for name in self.storage_fields()})

    def clear(self: Self) -> Self:
        """Empty again, in place: every entry, committed and staged, dropped; the storage kept.

        The result equals a freshly allocated object of this spec (an empty
        cache, free pages, a zero carry), written into this object's own
        buffers: under ``jax.jit`` with donation it allocates nothing and
        compiles once, unlike :meth:`reset` (frees the storage) or
        :meth:`empty` (new buffers).  A frame's scratch state can be cleared
        this way every frame.

        Raises:
          NotResidentError: the object holds no storage (evicted or reset).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
          >>> kv = kv.append((jnp.ones((1, 3, 1, 2)),) * 2)
          >>> clear = jax.jit(lambda kv: kv.clear(), donate_argnums=0)
          >>> clear(kv).view().lengths  # the same buffers, nothing kept
          Array([0], dtype=int32)
        """
        self._require_resident("clear")
        storage = {name: getattr(self, name) for name in self.storage_fields()}
        return self.with_storage(**overwrite(storage, self._empty_storage()))

    def _require_resident(self, operation: str) -> None:
        if not self.resident:
            raise NotResidentError(
                f"{operation}() on {self.describe()}, which is not resident (it was "
                "evicted or reset). Recompute it, restore it through the manager, or "
                "start over with .empty()."
            )
        self._require_not_donated(operation)

    def _require_not_donated(self, operation: str) -> None:
        for name in self.storage_fields():
            if any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
                   for x in jax.tree_util.tree_leaves(getattr(self, name))):
                raise DonatedError(
                    f"{operation}() on {self.describe()}, whose storage ({name!r}) was donated to a "
                    "jitted call and deleted. Use that call's output instead, or fork() before donating."
                )

    # ------------------------------------------------------------ accounting
    def nbytes_by_device(self, seen: SeenStorages | set | None = None) -> dict[str, int]:
        """Bytes of storage held, by device key, de-duplicated through ``seen``.

        Args:
          seen: the storages already counted (a :class:`SeenStorages`, or a
            plain ``set`` of ``(device key, pointer)``), updated here; None
            counts everything.

        Raises:
          DonatedError: the storage was donated away (it is not zero bytes:
            it is somewhere else now).
        """
        self._require_not_donated("nbytes_by_device")
        return tree_bytes_by_device(self, seen)

    def staged_nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes held only for staged data (none where staging is in-buffer)."""
        del seen
        return {}

    @property
    def nbytes(self) -> int:
        """Total bytes held, all devices together (for reporting only)."""
        return sum(self.nbytes_by_device().values())



def _spec_repr(value: Any) -> str:
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    return repr(value)


def state_object_classes() -> Mapping[str, type[StateObject]]:
    """The StateObject kinds defined in this process, by ``"module:QualName"``: what a checkpoint may name.

    Every subclass of :class:`StateObject` defined at module level enters
    this registry as its class statement runs (the library's kinds as soon as
    it is imported, a user's kind once its module is imported).  A restore
    resolves the kinds a checkpoint names here and imports nothing.

    Returns:
      A read-only mapping from ``"module:QualName"`` to the class.

    Example:
      >>> import jax_session_state as jss
      >>> from jax_session_state.base import state_object_classes
      >>> state_object_classes()["jax_session_state.objects.kv:KVCache"] is jss.KVCache
      True
    """
    return types.MappingProxyType(_DEFINED)


def is_state_object(x: Any) -> bool:
    """Whether ``x`` is a :class:`StateObject` (handy as ``is_leaf``).

    Args:
      x: any value (a pytree node, a leaf, None...).

    Returns:
      True for a state object of any kind, resident or not; False for
      anything else (a :class:`~jax_session_state.Session` included).

    Example:
      >>> import jax
      >>> import jax_session_state as jss
      >>> tree = {"carry": jss.FixedState.allocate(shapes=(2,)), "step": 3}
      >>> [type(x).__name__ for x in jax.tree_util.tree_leaves(tree, is_leaf=jss.is_state_object)]
      ['FixedState', 'int']
    """
    return isinstance(x, StateObject)


def check(tree: Any) -> None:
    """Raises :class:`CapacityError` for every overflowed object in ``tree``.

    Inside ``jit`` an overflowing write writes nothing and sets the object's
    ``overflowed`` flag; call ``check`` on the step's output, outside ``jit``.

    Args:
      tree: any pytree holding state objects (a Session, a dict, an object).

    Raises:
      CapacityError: naming each flagged object by its path in ``tree``.
      PayloadTypeError: called on traced values.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=2)
      >>> kv = jax.jit(lambda c: c.append((jnp.ones((1, 3, 1, 2)),) * 2))(kv)  # 3 rows do not fit: refused
      >>> try:
      ...     jss.check({"kv": kv})
      ... except jss.CapacityError as error:
      ...     print(str(error)[:48])
      a write inside jit was refused and wrote nothing
    """
    flagged = []
    paths_and_objects, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state_object)
    for path, obj in paths_and_objects:
        if not isinstance(obj, StateObject) or not obj.can_overflow or not obj.resident:
            continue
        flag = obj.overflowed
        if isinstance(flag, jax.core.Tracer):
            raise PayloadTypeError("check() reads overflow flags; call it outside jit on the step's output.")
        if bool(np.any(flag)):  # lanes of a branch carry one flag each
            flagged.append(f"{jax.tree_util.keystr(path) or '<root>'}: {obj.describe()}")
    if flagged:
        raise CapacityError(
            "a write inside jit was refused and wrote nothing (it did not fit, its per-row "
            "counts were out of range, or it named a slot it may not use), in: " + "; ".join(flagged)
            + ". Allocate more capacity (or max_staged for rings, pages for paged "
            "caches), commit or discard staged data sooner, pass counts in [0, T], or fork and "
            "free only the slots their rules allow."
        )
