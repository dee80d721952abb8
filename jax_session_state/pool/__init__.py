"""``SessionPool``: many sessions of one structure stacked along a slot axis, stepped in one call.

Continuous batching, the way a serving loop wants it: every leaf of a pooled
session gains a leading ``slots`` axis, an on-device ``active`` mask says
which slots hold a live session, and :meth:`SessionPool.map` runs a step
written for *one* session over every slot under ``jax.vmap`` -- one
dispatch, one batched matmul per layer, instead of one jitted call per
session.  Sessions join and leave between steps through :meth:`insert`,
:meth:`extract` and :meth:`release`; each is jittable with a traced slot,
and under ``jit`` with the pool donated writes or reads one slot in place
(``dynamic_update_slice`` / ``dynamic_slice`` on the slot axis), so it
costs one session's bytes however many slots the pool has.

Per-slot state is whatever the session holds: ragged K/V lengths and
positions, ring counts, RNG keys and counters in ``attrs`` -- slots may be
at different points of their rollouts.  Inactive slots are left bit for bit
as they were by :meth:`map`.

Owns ``_masked_step`` (a step run for the live slots only) and
``_placement`` (the slot axis placed on a mesh). May import ``_core``,
``accounting``, ``base``, ``building_blocks``, ``errors`` and ``session``.

A slot operation that cannot be done writes nothing: eagerly it raises at
once (``IndexError`` for a slot out of range, ``ValueError`` for an insert
into a live slot or a read of an empty one); under ``jit`` the pool's
``refused`` flag is set and :meth:`SessionPool.check` raises.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> def new_session():
  ...     kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=8)
  ...     return jss.Session(objects={"kv": kv}, attrs={"steps": jnp.int32(0)})
  >>> pool = jss.SessionPool.allocate(new_session(), slots=4)
  >>> insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
  >>> pool = insert(pool, 2, new_session())
  >>> def step(session, rows):  # written for one session
  ...     session = session.append(kv=(rows, rows))
  ...     return session.with_attrs(steps=session.attrs["steps"] + 1), session["kv"].committed
  >>> pool, committed = jax.jit(jss.SessionPool.map, static_argnums=1)(pool, step, jnp.ones((4, 1, 3, 1, 4)))
  >>> committed[:, 0]  # only slot 2 is live
  Array([0, 0, 3, 0], dtype=int32)
  >>> pool.extract(2).attrs["steps"]
  Array(1, dtype=int32)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_session_state._core._validation import is_integer_scalar, positive_int
from jax_session_state.accounting import SeenStorages, tree_bytes_by_device
from jax_session_state.base import check
from jax_session_state.building_blocks import update_slice_or_keep
from jax_session_state.errors import NotResidentError, PayloadError, PayloadTypeError
from jax_session_state.pool import _placement
from jax_session_state.pool._masked_step import run_masked
from jax_session_state.session import Session

__all__ = ["SessionPool"]

_TAGS = itertools.count()


class SessionPool(struct.PyTreeNode):
    """Sessions of one structure stacked along a leading slot axis, plus which slots are live.

    Attributes:
      sessions: one :class:`Session` whose every leaf has a leading
        ``slots`` axis (``Float[Array, "slots batch capacity kv_heads head_dim"]``
        for a K/V buffer); its static fields are the template's.
      active: ``Bool[Array, "slots"]`` whether each slot holds a live session.
      refused: ``Bool[Array, ""]`` whether a slot operation under ``jit`` was
        refused and wrote nothing (see :meth:`check`).
      tag: ``Int[Array, ""]`` which pool this is, the same in every pool a
        step or slot operation returns from it: how a
        :class:`SessionStateManager` knows a pool it lent sessions to.

    Example:
      >>> import jax_session_state as jss
      >>> template = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(1, 8))})
      >>> pool = jss.SessionPool.allocate(template, slots=16)
      >>> pool.slots, pool.active_slots()
      (16, [])
    """

    sessions: Session
    active: jax.Array
    refused: jax.Array
    tag: jax.Array
    slot_sharding: jax.sharding.NamedSharding | None = struct.field(pytree_node=False, default=None)
    """Where the slot axis lives: None on one device, else a NamedSharding over a mesh (may span processes)."""

    # ------------------------------------------------------------ building
    @classmethod
    def allocate(
        cls, template: Session, *, slots: int, sharding: jax.sharding.NamedSharding | None = None
    ) -> SessionPool:
        """An empty pool of ``slots`` slots, each shaped like ``template``.

        With ``sharding=NamedSharding(mesh, P("data"))`` the slot axis is split
        over the mesh axis ``"data"`` (which may span JAX processes): each
        device holds whole sessions, its slots' shards, and a jitted, donated
        :meth:`map` steps every slot in one SPMD call.  Every process passes
        the same template and calls every pool method (SPMD).

        Args:
          template: a :class:`Session` whose objects are all resident; its
            structure, shapes and dtypes are what every inserted session
            must have.  Its values fill the empty slots (an empty session is
            the natural template).
          slots: how many sessions the pool holds at once.
          sharding: None (one device), or a NamedSharding whose one-entry spec
            places the slot axis; ``slots`` must divide evenly over it.

        Raises:
          PayloadTypeError: ``template`` is not a Session, or ``slots`` is not an int
            (a bool is not one).
          NotResidentError: an object of ``template`` is not resident.
          PayloadError: ``slots`` is an int below 1, or an object of ``template``
            is placed on a mesh, or ``sharding`` does not split ``slots`` evenly.
        """
        if not isinstance(template, Session):
            raise PayloadTypeError(f"SessionPool.allocate: template must be a Session; got {type(template).__name__}.")
        slots = positive_int("SessionPool.allocate", "slots", slots)
        if sharding is not None:
            sharding = _placement.check_slot_sharding(sharding, slots)
        for name, obj in template.objects.items():
            if not obj.resident:
                raise NotResidentError(
                    f"SessionPool.allocate: template object {name!r} ({obj.describe()}) is not resident; "
                    "allocate the pool from a session whose objects all hold storage (an empty one is best)."
                )
            if obj.sharding is not None:
                raise PayloadError(
                    f"SessionPool.allocate: template object {name!r} ({obj.describe()}) is placed on a mesh; "
                    "a pool keeps each session whole on one device (shard the slot axis with "
                    "allocate(..., sharding=NamedSharding(mesh, P('data')))). Allocate the template without sharding."
                )
        if sharding is not None:
            sessions, active, refused = _placement.stacked_on_mesh(template, slots, sharding)
            tag = _placement.replicated_scalar(next(_TAGS), np.int32, sharding)
            return cls(sessions=sessions, active=active, refused=refused, tag=tag, slot_sharding=sharding)
        leaves = [x for x in jax.tree_util.tree_leaves(template) if isinstance(x, jax.Array) and _concrete(x)]
        device = next(iter(leaves[0].devices())) if leaves else jax.devices()[0]
        # Committed to one device from the start: a step whose inputs are committed (a session brought
        # back from host memory) returns committed arrays, and a pool that changed from uncommitted to
        # committed would make every jitted step compile again.
        where = jax.sharding.SingleDeviceSharding(device)

        @functools.partial(jax.jit, out_shardings=where)
        def stacked(t: Session) -> SessionPool:
            return cls(
                sessions=jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (slots, *jnp.shape(x))), t),
                active=jnp.zeros((slots,), bool),
                refused=jnp.zeros((), bool),
                tag=jnp.zeros((), jnp.int32),
            )

        pool = stacked(template)
        return pool.replace(tag=jax.device_put(jnp.asarray(next(_TAGS), jnp.int32), where))

    # ------------------------------------------------------------- reading
    @property
    def slots(self) -> int:
        """How many sessions the pool holds at once."""
        return self.active.shape[0]

    def active_slots(self) -> list[int]:
        """The live slots, on the host (outside ``jit``)."""
        return [int(i) for i in np.flatnonzero(np.asarray(self.active))]

    def nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes of every slot (live or not) and the flags, by device key."""
        return tree_bytes_by_device(self, seen)

    @property
    def nbytes(self) -> int:
        """Total bytes, all devices together (for reporting only)."""
        return sum(self.nbytes_by_device().values())

    def check(self) -> None:
        """Raises for a refused slot operation or an overflowed object in any slot (outside ``jit``).

        Raises:
          PayloadError: a slot operation under ``jit`` was refused (slot out of
            range, insert into a live slot, extract or release of an empty one).
          CapacityError: a write in some slot overflowed (see :func:`jss.check`).
        """
        if isinstance(self.refused, jax.core.Tracer):
            raise PayloadTypeError("SessionPool.check() reads flags; call it outside jit on the step's output.")
        if bool(self.refused):
            raise PayloadError(
                "SessionPool: a slot operation inside jit was refused and wrote nothing (a slot out of "
                f"range [0, {self.slots}), an insert into a live slot, or an extract or release of an "
                "empty slot). Check pool.active_slots() before choosing a slot."
            )
        check(self.sessions)

    # ------------------------------------------------------------ one slot
    def insert(self, slot: Any, session: Session) -> SessionPool:
        """The pool with ``session`` written into the empty ``slot``, which becomes live.

        Jittable with a traced ``slot``; donate the pool and it writes one
        session's bytes in place.

        Args:
          slot: an int (or int32 scalar array) in ``[0, slots)``.
          session: a Session of the template's structure, shapes and dtypes.

        Raises:
          PayloadTypeError / PayloadError: ``session`` differs from the template (the
            message names the object or attr and what differs).
          IndexError: a concrete ``slot`` is out of range.
          PayloadError: a concrete ``slot`` is live (extract or release it first).

        Example:
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
          >>> pool = jss.SessionPool.allocate(make(), slots=3).insert(1, make())
          >>> pool.active_slots()
          [1]
          >>> try:
          ...     pool.insert(1, make())
          ... except ValueError as error:
          ...     print(error)
          SessionPool.insert: slot 1 holds a live session; extract or release it first.
        """
        self._require_like(session, "insert")
        index, in_range = self._slot_index(slot, "insert")
        live = self.active[index]
        if _concrete(live) and bool(live):
            raise PayloadError(
                f"SessionPool.insert: slot {int(index)} holds a live session; extract or release it first."
            )
        lands = in_range & ~live
        sessions = jax.tree_util.tree_map(
            lambda buffer, value: _write_slot(buffer, value, index, lands), self.sessions, session
        )
        return self.replace(
            sessions=sessions,
            active=_write_slot(self.active, jnp.asarray(True), index, lands),
            refused=self.refused | ~lands,
        )

    def extract(self, slot: Any) -> Session:
        """The session in ``slot``: a copy of one slot, equal leaf for leaf to what was inserted and stepped.

        The slot stays live; :meth:`release` it when the session leaves.
        Jittable with a traced ``slot`` (then an empty or out-of-range slot
        cannot be refused: read :attr:`active` first).

        Args:
          slot: an int (or int32 scalar array) in ``[0, slots)``.

        Returns:
          The slot's :class:`Session`, without the slot axis.

        Raises:
          IndexError: a concrete ``slot`` is out of range.
          PayloadError: a concrete ``slot`` is empty.

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
          >>> pool = jss.SessionPool.allocate(make(), slots=3).insert(0, make().commit(carry=jnp.ones(2)))
          >>> pool.extract(0).view()["carry"], pool.active_slots()  # the slot stays live
          (Array([1., 1.], dtype=float32), [0])
        """
        index, _ = self._slot_index(slot, "extract")
        live = self.active[index]
        if _concrete(live) and not bool(live):
            raise PayloadError(f"SessionPool.extract: slot {int(index)} is empty; live slots: {self.active_slots()}.")
        return jax.tree_util.tree_map(
            lambda buffer: jax.lax.dynamic_index_in_dim(buffer, index, axis=0, keepdims=False), self.sessions
        )

    def release(self, slot: Any) -> SessionPool:
        """The pool with ``slot`` empty; its data stays where it is until the next insert.

        Jittable with a traced ``slot``: under ``jit`` releasing an empty
        slot is refused (``refused`` is set, :meth:`check` raises).

        Args:
          slot: an int (or int32 scalar array) in ``[0, slots)``.

        Raises:
          IndexError: a concrete ``slot`` is out of range.
          PayloadError: a concrete ``slot`` is already empty.

        Example:
          >>> import jax
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
          >>> release = jax.jit(jss.SessionPool.release, donate_argnums=0)
          >>> pool = release(jss.SessionPool.allocate(make(), slots=3).insert(0, make()), 0)
          >>> pool.active_slots()
          []
          >>> bool(release(pool, 0).refused)  # already empty: refused, nothing written
          True
        """
        index, in_range = self._slot_index(slot, "release")
        live = self.active[index]
        if _concrete(live) and not bool(live):
            raise PayloadError(f"SessionPool.release: slot {int(index)} is already empty.")
        lands = in_range & live
        return self.replace(
            active=_write_slot(self.active, jnp.asarray(False), index, lands),
            refused=self.refused | ~lands,
        )

    # ---------------------------------------------------------- every slot
    def map(self, step: Callable[..., tuple[Session, Any]], *per_slot: Any) -> tuple[SessionPool, Any]:
        """Runs ``step(session, *args) -> (session, out)``, written for one session, on every slot.

        One ``jax.vmap`` over the slot axis: jit it (``step`` static) with
        the pool donated and every slot is stepped in one call.  Inactive
        slots keep their state bit for bit, and their ``out`` is zeros: the
        step's in-place writes land only in live slots (no select over the
        whole pool, so a pool step writes in place what its slots write).

        Args:
          step: a pure function of one session and its arguments; it must
            return a session of the same structure, shapes and dtypes.
          *per_slot: pytrees whose leaves have a leading ``slots`` axis (one
            action, one RNG key... per slot).  Values every slot shares are
            closed over by ``step``.

        Returns:
          The stepped pool and ``out`` with a leading ``slots`` axis.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
          >>> pool = jss.SessionPool.allocate(make(), slots=3).insert(0, make()).insert(2, make())
          >>> def step(session, x):  # written for one session
          ...     carry = session.view()["carry"] + x
          ...     return session.commit(carry=carry), carry.sum()
          >>> pool, out = jax.jit(jss.SessionPool.map, static_argnums=1)(pool, step, jnp.arange(1.0, 4.0))
          >>> out  # slot 1 is empty: its out is zero and its state is untouched
          Array([2., 0., 6.], dtype=float32)
        """
        for i, args in enumerate(per_slot):
            for leaf in jax.tree_util.tree_leaves(args):
                if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != self.slots:
                    raise PayloadError(
                        f"SessionPool.map: argument {i} of {_name(step)} needs a leading axis of "
                        f"{self.slots} slots on every leaf; got a leaf of shape {jnp.shape(leaf)}."
                    )

        def one(session: Session, live: jax.Array, *args: Any) -> tuple[Session, Any]:
            (stepped, out), origins = run_masked(step, live, session, *args)
            if not isinstance(stepped, Session):
                raise PayloadTypeError(
                    f"SessionPool.map: {_name(step)} must return (session, out); got {type(stepped).__name__}."
                )
            _require_same(session, stepped, f"SessionPool.map: {_name(step)} returned a session that")
            old, tree = jax.tree_util.tree_flatten(session)
            new = jax.tree_util.tree_leaves(stepped)
            # A leaf written in place by masked writes only is already unchanged where not live.
            kept = [n if origins[i] == i else _select(live, n, o) for i, (n, o) in enumerate(zip(new, old))]
            return tree.unflatten(kept), jax.tree_util.tree_map(lambda x: _select(live, x, jnp.zeros_like(x)), out)

        sessions, out = jax.vmap(one)(self.sessions, self.active, *per_slot)
        sessions, out = _placement.constrain_slots((sessions, out), self.slot_sharding)
        return self.replace(sessions=sessions), out

    # ------------------------------------------------------------- helpers
    def _slot_index(self, slot: Any, operation: str) -> tuple[jax.Array, jax.Array]:
        """``slot`` as an int32 index clamped into range, and whether it was in range."""
        if not is_integer_scalar(slot):
            raise PayloadTypeError(f"SessionPool.{operation}: slot must be an integer scalar; got {slot!r}.")
        if _concrete(slot) and not 0 <= int(slot) < self.slots:
            raise IndexError(f"SessionPool.{operation}: slot {int(slot)} is out of range [0, {self.slots}).")
        slot = jnp.asarray(slot, jnp.int32)
        in_range = (slot >= 0) & (slot < self.slots)
        return jnp.clip(slot, 0, self.slots - 1), in_range

    def _require_like(self, session: Session, operation: str) -> None:
        """Raises naming what differs between ``session`` and one slot of the pool."""
        if not isinstance(session, Session):
            raise PayloadTypeError(f"SessionPool.{operation}: expected a Session; got {type(session).__name__}.")
        ours, theirs = self.sessions.objects, session.objects
        if set(ours) != set(theirs):
            raise PayloadError(
                f"SessionPool.{operation}: the session holds objects {sorted(theirs)}; the pool's sessions "
                f"hold {sorted(ours)} (missing: {sorted(set(ours) - set(theirs))}, "
                f"extra: {sorted(set(theirs) - set(ours))})."
            )
        for name, slot_obj in ours.items():
            obj = theirs[name]
            if not obj.resident:
                raise NotResidentError(
                    f"SessionPool.{operation}: object {name!r} ({obj.describe()}) is not resident; "
                    "restore it (manager.checkout does) before it enters a pool."
                )
            if type(obj) is not type(slot_obj) or obj.describe() != slot_obj.describe():
                raise PayloadError(
                    f"SessionPool.{operation}: object {name!r} is {obj.describe()}; the pool's sessions "
                    f"hold {slot_obj.describe()}."
                )
        if set(self.sessions.attrs) != set(session.attrs):
            raise PayloadError(
                f"SessionPool.{operation}: the session carries attrs {sorted(session.attrs)}; the pool's "
                f"sessions carry {sorted(self.sessions.attrs)}."
            )
        _require_same(
            jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), self.sessions),
            session,
            f"SessionPool.{operation}: the session",
        )


def _require_same(expected: Session, got: Session, subject: str) -> None:
    """Raises naming the first leaf whose place, shape or dtype differs from ``expected``'s."""
    expected_leaves, expected_tree = jax.tree_util.tree_flatten_with_path(expected)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    if expected_tree != got_tree:
        names = [*expected.objects, *expected.attrs]
        names += [name for name in (*got.objects, *got.attrs) if name not in names]
        differing = [
            name
            for name in names
            if _has(expected, name) != _has(got, name)
            or jax.tree_util.tree_structure(_part(expected, name)) != jax.tree_util.tree_structure(_part(got, name))
        ]
        where = f"in {differing}" if differing else f"in its static fields: expected {expected_tree}, got {got_tree}"
        raise PayloadError(f"{subject} differs in structure {where}.")
    for (path, want), (_, leaf) in zip(expected_leaves, got_leaves):
        shape, dtype = jnp.shape(leaf), jnp.result_type(leaf)
        if shape != tuple(want.shape) or dtype != want.dtype:
            raise PayloadError(
                f"{subject} has {jax.tree_util.keystr(path)} of shape {shape} and dtype {dtype}; "
                f"expected shape {tuple(want.shape)} and dtype {want.dtype}."
            )


def _has(session: Session, name: str) -> bool:
    return name in session.objects or name in session.attrs


def _part(session: Session, name: str) -> Any:
    """The object or attr ``name`` of ``session`` (None where it has none)."""
    return session.objects[name] if name in session.objects else session.attrs.get(name)


def _write_slot(buffer: jax.Array, value: Any, index: jax.Array, lands: jax.Array) -> jax.Array:
    """``buffer`` with ``value`` written at ``index`` along the slot axis, where ``lands``.

    Where it does not land the slot takes back what it held: one slice read
    and one slice write, in place under donation (:func:`update_slice_or_keep`;
    PRNG keys select their key data).
    """
    value = jnp.asarray(value)
    if value.dtype != buffer.dtype:  # a Python scalar attr
        value = value.astype(buffer.dtype)
    value = value[None]
    if not jax.dtypes.issubdtype(buffer.dtype, jax.dtypes.prng_key):
        return update_slice_or_keep(buffer, value, index, axis=0, lands=lands)
    kept = jax.lax.dynamic_slice_in_dim(buffer, index, 1, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(buffer, _select(lands, value, kept), index, axis=0)


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``pred`` (a scalar) else ``old``; works for PRNG key arrays too."""
    if jax.dtypes.issubdtype(jnp.result_type(old), jax.dtypes.prng_key):
        data = jnp.where(pred, jax.random.key_data(new), jax.random.key_data(old))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
    return jnp.where(pred, new, old)


def _concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _name(step: Callable[..., Any]) -> str:
    return getattr(step, "__qualname__", None) or repr(step)

