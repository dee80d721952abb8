"""What the session manager holds: one record per session, and an exact byte ledger.

A session's byte figures are taken once, when it is put, created or restored
(enumerating its buffers), and cached here: a lookup then does no accounting,
and the planner reads cached figures.  The ledger counts references to every
buffer (device key, pointer, bytes), so a buffer shared by two sessions counts
once in the running totals.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Literal

import jax

from jax_session_state._core._placement import Placement
from jax_session_state.accounting import Storage, device_key, tree_storages
from jax_session_state.base import StateObject
from jax_session_state.manager.parking import Parked
from jax_session_state.manager.planner import ObjectUsage, SessionUsage
from jax_session_state.session import Session

RecordState = Literal["resident", "parked", "evicted", "absent"]


def _leaf_bytes(tree: object) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


@functools.lru_cache(maxsize=1024)
def _demoted_leaf_bytes(treedef: jax.tree_util.PyTreeDef, shapes: tuple[tuple[tuple[int, ...], object], ...]) -> int:
    """Leaf bytes of the demoted form of an object of this structure (traced once per spec)."""
    obj = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes])
    return _leaf_bytes(jax.eval_shape(lambda o: o.demote(), obj))


def demoted_bytes(obj: StateObject, home_bytes: Mapping[str, int]) -> dict[str, int] | None:
    """Bytes by device key ``obj`` would hold once demoted, from ``jax.eval_shape``: nothing is computed.

    Each key's bytes scale by the demoted / current ratio of the global leaf
    bytes (a sharded or replicated object keeps its layout); None when the
    object has no lower tier.
    """
    if not (obj.resident and obj.demotable):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    before = _leaf_bytes(leaves)
    after = _demoted_leaf_bytes(treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
    return {key: nbytes * after // before for key, nbytes in home_bytes.items()} if before else None


def distinct_bytes(storages: Iterable[Storage]) -> dict[str, int]:
    """Bytes by device key, each buffer once."""
    out: dict[str, int] = {}
    for key, _, nbytes in set(storages):
        out[key] = out.get(key, 0) + nbytes
    return out


@dataclasses.dataclass(frozen=True)
class Recompute:
    """A registered recompute: ``fn(session) -> StateObject`` and its cost (None: the object's own)."""

    fn: Callable[[Session], StateObject]
    cost: float | None


@dataclasses.dataclass(frozen=True)
class ObjectRecord:
    """How the manager holds one object.

    Attributes:
      state: ``resident``; ``parked`` (its arrays in host memory, ``parked``);
        ``evicted`` (by the manager, to be recomputed onto
        ``placement``); ``absent`` (non-resident when it was put: left alone).
      storages: the buffers held for it now (parked: the host copies).
      home_bytes: its bytes by device key when resident where it belongs.
      parked: the parked object, when parked.
      placement: where an evicted object's arrays go when it is recomputed.
    """

    state: RecordState
    storages: tuple[Storage, ...]
    home_bytes: Mapping[str, int]
    parked: Parked | None = None
    placement: Placement | None = None

    @classmethod
    def of(cls, obj: StateObject) -> ObjectRecord:
        storages = tuple(tree_storages(obj))
        return cls("resident" if obj.resident else "absent", storages, distinct_bytes(storages))

    def evicted(self, placement: Placement) -> ObjectRecord:
        """The record once evicted from ``placement``."""
        return ObjectRecord("evicted", (), self.home_bytes, placement=placement)

    def parked_as(self, parked: Parked) -> ObjectRecord:
        """The record once parked as ``parked``."""
        return ObjectRecord("parked", tuple(tree_storages(parked.obj)), self.home_bytes, parked=parked)

    def usage(
        self, name: str, obj: StateObject, recompute: Recompute | None, *, as_resident: bool = False
    ) -> ObjectUsage:
        """The planner's figures of this object (``as_resident``: as if restored)."""
        recomputable = recompute is not None and bool(obj.recompute_source) and obj.evictable
        cost = recompute.cost if recompute is not None and recompute.cost is not None else obj.recompute_cost
        demoted = None
        if self.state == "absent":
            state, nbytes = "evicted", {}
        elif as_resident or self.state == "resident":
            state, nbytes = "resident", self.home_bytes
            if not as_resident:  # a session being restored is never acted on
                demoted = demoted_bytes(obj, self.home_bytes)
        else:
            state = self.state
            nbytes = distinct_bytes(self.storages) if self.state == "parked" else self.home_bytes
        return ObjectUsage(
            name,
            nbytes,
            state=state,
            sources=obj.recompute_source,
            recompute_cost=cost,
            recomputable=recomputable,
            demoted_bytes_by_device=demoted,
        )


class Entry:
    """One held session: its objects (parked and evicted ones non-resident), records, pins and use."""

    __slots__ = (
        "_shared_within",
        "_usage",
        "attrs_bytes",
        "attrs_storages",
        "busy",
        "origin",
        "pins",
        "records",
        "session",
        "whole",
    )

    def __init__(self, session: Session, records: dict[str, ObjectRecord]):
        self.session = session
        self.records = records
        self.attrs_storages = tuple(tree_storages(session.attrs))
        self.attrs_bytes = distinct_bytes(self.attrs_storages)
        self.whole = all(record.state in ("resident", "absent") for record in records.values())
        self.pins = 0  # open pin() contexts
        self.busy: int | None = None  # the thread running update() on it
        self.origin = object()  # which create() this entry descends from
        self._usage: tuple[int, tuple[ObjectUsage, ...]] | None = None
        self._shared_within: frozenset[Storage] | None = None

    @classmethod
    def of(cls, session: Session) -> Entry:
        return cls(session, {name: ObjectRecord.of(obj) for name, obj in session.objects.items()})

    @classmethod
    def holding_parked(cls, session: Session, parked: Mapping[str, Parked]) -> Entry:
        """The entry of ``session`` with the objects named in ``parked`` held parked as given there."""
        session = session.with_objects(**{name: p.obj.reset() for name, p in parked.items()})
        records = {name: ObjectRecord.of(obj) for name, obj in session.objects.items()}
        for name, p in parked.items():
            home = distinct_bytes(placed_storages(p.obj, p.placement))
            records[name] = ObjectRecord("parked", tuple(tree_storages(p.obj)), home, parked=p)
        return cls(session, records)

    def with_object(self, name: str, obj: StateObject, record: ObjectRecord) -> Entry:
        """A new entry with object ``name`` and its record replaced; pins and update hold carried over."""
        session = self.session.with_objects(**{name: obj})
        return Entry(session, {**self.records, name: record}).carrying(self)

    def carrying(self, old: Entry) -> Entry:
        """This entry, taking over ``old``'s pins, update hold and origin (it replaces ``old``)."""
        self.pins, self.busy, self.origin = old.pins, old.busy, old.origin
        return self

    @property
    def ready(self) -> bool:
        """Whether a lookup may hand the session out at once: whole, and not in an update()."""
        return self.whole and self.busy is None

    def storages(self) -> Iterator[Storage]:
        """Every buffer held for this session (repeats kept)."""
        for record in self.records.values():
            yield from record.storages
        yield from self.attrs_storages

    def names(self, state: RecordState) -> list[str]:
        return [name for name, record in self.records.items() if record.state == state]

    def shared_within(self) -> frozenset[Storage]:
        """The buffers that several of this session's objects (or an object and its attrs) hold."""
        if self._shared_within is None:
            holders = collections.Counter(
                storage
                for storages in (*(record.storages for record in self.records.values()), self.attrs_storages)
                for storage in set(storages)
            )
            self._shared_within = frozenset(storage for storage, count in holders.items() if count > 1)
        return self._shared_within

    def usage(
        self,
        session_id: Hashable,
        last_used: int,
        pinned: bool,
        recomputes: Mapping[str, Recompute],
        version: int,
    ) -> SessionUsage:
        """The planner's figures of this session; object figures cached per recompute registry ``version``."""
        if self._usage is None or self._usage[0] != version:
            self._usage = (version, self._object_usage(recomputes, as_resident=False))
        return SessionUsage(session_id, self._usage[1], last_used, pinned, self.attrs_bytes)

    def restored_usage(
        self, session_id: Hashable, last_used: int, recomputes: Mapping[str, Recompute]
    ) -> SessionUsage:
        """The planner's figures of this session once its parked and evicted objects are back."""
        objects = self._object_usage(recomputes, as_resident=True)
        return SessionUsage(session_id, objects, last_used, True, self.attrs_bytes)

    def _object_usage(self, recomputes: Mapping[str, Recompute], as_resident: bool) -> tuple[ObjectUsage, ...]:
        return tuple(
            record.usage(name, self.session.objects[name], recomputes.get(name), as_resident=as_resident)
            for name, record in self.records.items()
        )


class Ledger:
    """Reference counts of every buffer held, and exact running totals by device key."""

    def __init__(self) -> None:
        self.refs: dict[Storage, int] = {}
        self.totals: dict[str, int] = {}

    def delta(self, removed: Iterable[Storage], added: Iterable[Storage]) -> dict[str, int]:
        """How the totals would change if ``removed`` were released and ``added`` taken."""
        change = collections.Counter(added)
        change.subtract(removed)
        out: dict[str, int] = {}
        for storage, diff in change.items():
            before = self.refs.get(storage, 0)
            if diff and (before > 0) != (before + diff > 0):
                key, _, nbytes = storage
                out[key] = out.get(key, 0) + (nbytes if diff > 0 else -nbytes)
        return out

    def apply(self, removed: Iterable[Storage], added: Iterable[Storage]) -> None:
        """Releases ``removed`` and takes ``added``."""
        removed, added = list(removed), list(added)
        for key, nbytes in self.delta(removed, added).items():
            total = self.totals.get(key, 0) + nbytes
            if total:
                self.totals[key] = total
            else:
                self.totals.pop(key, None)
        for storage in added:
            self.refs[storage] = self.refs.get(storage, 0) + 1
        for storage in removed:
            count = self.refs[storage] - 1
            if count:
                self.refs[storage] = count
            else:
                del self.refs[storage]


class _SharedStorages:
    """The planner's id of the buffers several held sessions read (see :func:`split_shared`)."""

    def __repr__(self) -> str:
        return "<buffers shared between sessions>"


SHARED_STORAGES = _SharedStorages()


def split_shared(views: list[tuple[Entry, SessionUsage]]) -> list[SessionUsage]:
    """The planner's sessions with every buffer that several objects hold taken out of each object, and
    counted once: in one pinned session of its own (:data:`SHARED_STORAGES`, first) when several sessions
    hold it, else in its session's own bytes (with its attrs).

    Evicting, demoting, parking or preempting frees only the buffers nothing else reads (a conditioning
    shared by content, two names for one array), so only those are what an action on an object frees; a
    buffer shared within a session goes only with the whole session, and no plan acts on one several
    sessions read.
    """
    holders = collections.Counter(s for entry, _ in views for s in set(entry.storages()))
    across = {s for s, n in holders.items() if n > 1}
    out = [SessionUsage(SHARED_STORAGES, (), -1, True, distinct_bytes(across))] if across else []
    for entry, usage in views:
        within = entry.shared_within() - across
        if not across and not within:
            out.append(usage)
            continue
        shared = across | within
        objects = tuple(_without(obj, entry.records[obj.name].storages, shared) for obj in usage.objects)
        attrs = distinct_bytes(s for s in (*entry.attrs_storages, *within) if s not in across)
        out.append(dataclasses.replace(usage, objects=objects, attrs_bytes_by_device=attrs))
    return out


def _without(obj: ObjectUsage, storages: tuple[Storage, ...], shared: set[Storage]) -> ObjectUsage:
    """``obj``'s figures less its ``shared`` buffers; an object holding one is neither demoted nor parked (either
    would copy the buffer without freeing it)."""
    if obj.state == "evicted" or shared.isdisjoint(storages):
        return obj
    kept = distinct_bytes(s for s in storages if s not in shared)
    return dataclasses.replace(obj, bytes_by_device=kept, demoted_bytes_by_device=None, parkable=False)


def placed_storages(obj: StateObject, placement: Placement) -> list[Storage]:
    """The buffers ``obj``'s arrays would hold once put on ``placement`` (same layout, another memory)."""
    placed = []
    for leaf, sharding in zip(jax.tree_util.tree_leaves(obj), placement.shardings):
        if sharding is None:  # not a jax array: it stays as it is
            placed.extend(tree_storages(leaf))
            continue
        placed.extend(
            (device_key(shard.device, sharding.memory_kind), shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
            for shard in leaf.addressable_shards
        )
    return placed
