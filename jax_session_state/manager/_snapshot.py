"""What a session manager shows of what it holds: :class:`Held` per session, and :class:`ManagerSnapshot`.

:class:`ManagerSnapshots` is the part of
:class:`~jax_session_state.SessionStateManager` that exports its table
(``snapshot()``) and imports one (``load()``, ``from_snapshot()``): what
checkpoints save and restore; and its reports (``held()``, ``stats()``,
``nbytes_by_device()``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple, Self

from jax_session_state.errors import DonatedError, PayloadError
from jax_session_state.manager import offload
from jax_session_state.manager._arguments import checked_session
from jax_session_state.manager._core import COUNTERS, ManagerCore
from jax_session_state.manager._events import ManagerEvent
from jax_session_state.manager._prepare import rebuilt
from jax_session_state.manager._table import Entry
from jax_session_state.session import Session

__all__ = ["Held", "ManagerSnapshot", "ManagerSnapshots", "SnapshotSession"]


@dataclasses.dataclass(frozen=True)
class Held:
    """How the manager holds one session now (see :meth:`SessionStateManager.held`).

    Attributes:
      session: the session; its parked and evicted objects are not resident here.
      parked: the parked objects by name (their arrays in host memory).
      evicted: names of the objects evicted, to be rebuilt on the next lookup.
      donated: whether its arrays were deleted by a step in progress (between
        a ``get`` and its ``put``).
      pinned: whether a ``pin()`` block holds it.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 40})  # room for one carry of 33 bytes
      >>> for user, x in (("a", 1.0), ("b", 2.0)):  # "b" parks "a"'s carry to host memory
      ...     carry = jss.FixedState.allocate(shapes=(4,)).commit(jnp.full(4, x))
      ...     manager.create(user, jss.Session(objects={"h": carry}))
      >>> with manager.pin("b"):
      ...     held = manager.held()
      >>> sorted(held["a"].parked), held["a"].evicted, held["b"].parked, held["b"].pinned
      (['h'], frozenset(), {}, True)
    """

    session: Session
    parked: Mapping[str, offload.Parked]
    evicted: frozenset[str]
    donated: bool
    pinned: bool = False


class SnapshotSession(NamedTuple):
    """One session of a :class:`ManagerSnapshot`.

    Attributes:
      session_id: its id.
      session: the session; parked objects hold their arrays in host memory,
        evicted objects are non-resident.
      evicted: names of the objects the manager evicted (to be rebuilt).
      parked: the parked objects by name, with where their arrays go back
        to (their objects are the ones in ``session``); a manager loading
        the snapshot holds them parked.

    Example:
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> manager.create("user", jss.Session(objects={"h": jss.FixedState.allocate(shapes=(2,))}))
      >>> held = manager.snapshot().sessions[0]
      >>> held.session_id, list(held.session.objects), held.evicted, dict(held.parked)
      ('user', ['h'], frozenset(), {})
    """

    session_id: Hashable
    session: Session
    evicted: frozenset[str]
    parked: Mapping[str, offload.Parked] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class ManagerSnapshot:
    """What a manager holds (see :meth:`SessionStateManager.snapshot`).

    Attributes:
      settings: the manager's constructor settings (:meth:`SessionStateManager.settings`).
      sessions: every session, least recently used first.

    Example:
      >>> import jax_session_state as jss
      >>> session = jss.Session(objects={"h": jss.FixedState.allocate(shapes=(2,))})
      >>> manager = jss.SessionStateManager(max_sessions=8)
      >>> for user in ("a", "b"):
      ...     manager.create(user, session)
      >>> snapshot = manager.snapshot()
      >>> snapshot.settings["max_sessions"], [s.session_id for s in snapshot.sessions]
      (8, ['a', 'b'])
      >>> copy = jss.SessionStateManager(max_sessions=8)
      >>> copy.load(snapshot)  # what checkpoint.restore does with a saved manager
      >>> copy.stats()["sessions"]
      2
    """

    settings: Mapping[str, Any]
    sessions: tuple[SnapshotSession, ...]


class ManagerSnapshots(ManagerCore):
    """Exports and imports of the manager's whole table, and reports of it."""

    def settings(self) -> dict[str, Any]:
        """The constructor's settings that describe this manager (not the lock or ``on_event``)."""
        return {
            "max_sessions": self.max_sessions,
            "byte_budget": dict(self.byte_budget),
            "evict_when_full": self.evict_when_full,
            "park_memory_kind": self.park_memory_kind,
            "host_budget": self.host_budget,
        }

    def snapshot(self) -> ManagerSnapshot:
        """Everything this manager holds, as one consistent picture, to save or load elsewhere.

        Nothing is brought back or copied: parked objects appear with their
        arrays in host memory, evicted objects non-resident.  Pins, counters,
        ``on_event`` and registered rebuilds are not part of it.

        Raises:
          DonatedError: a session's arrays were donated to a step that has
            not been put back (``put`` it first).

        Example:
          >>> import jax_session_state as jss
          >>> manager = jss.SessionStateManager(max_sessions=4)
          >>> manager.create("a", jss.Session(objects={"c": jss.FixedState.allocate(shapes=(2,))}))
          >>> snapshot = manager.snapshot()
          >>> [s.session_id for s in snapshot.sessions], snapshot.settings["max_sessions"]
          (['a'], 4)
          >>> list(jss.SessionStateManager.from_snapshot(snapshot).held())
          ['a']
        """
        with self._lock:
            sessions = []
            for session_id, entry in self._by_recency():
                if offload.is_donated(entry.session):
                    raise DonatedError(
                        f"session {session_id!r} is in use: its arrays were donated to a step that has not "
                        "been put back. put() it (or release() it) first."
                    )
                parked = {name: entry.records[name].parked for name in entry.names("parked")}
                session = entry.session
                if parked:
                    session = session.with_objects(**{name: p.obj for name, p in parked.items()})
                evicted = frozenset(entry.names("evicted"))
                sessions.append(SnapshotSession(session_id, session, evicted, types.MappingProxyType(parked)))
            return ManagerSnapshot(self.settings(), tuple(sessions))

    @classmethod
    def from_snapshot(cls, snapshot: ManagerSnapshot, **settings: Any) -> Self:
        """A new manager with the snapshot's settings (``settings`` override them), loaded with it."""
        manager = cls(**{**snapshot.settings, **settings})
        manager.load(snapshot)
        return manager

    def load(self, snapshot: ManagerSnapshot) -> None:
        """Fills this empty manager with a snapshot's sessions, least recently used first.

        This manager's own settings, ``on_event`` and registered rebuilds
        apply: evicted objects with a registered rebuild are rebuilt before
        their session is admitted, the others stay non-resident; parked
        objects stay parked (a lookup copies them back, as it would have
        in the manager saved); admission follows ``create``'s rules (so
        under a smaller budget it parks or preempts as ``create`` would).
        Counters start at zero.  No other thread may use the manager
        meanwhile.

        Raises:
          PayloadError: the manager holds sessions already.
          BudgetExceededError, SessionAdmissionError: a session does not fit;
            every session loaded so far is released again: nothing is
            half-loaded.
        """
        with self._lock:
            if self._entries:
                raise PayloadError(f"load() needs an empty manager; this one holds {len(self)} sessions.")
        loaded = []
        try:
            for held in snapshot.sessions:
                objects = dict(held.session.objects)
                for name in sorted(held.evicted & self._rebuilds.keys()):
                    objects[name] = rebuilt(self._rebuilds[name].fn, held.session_id, name, held.session, None)
                session = checked_session(held.session.replace(objects=objects), "load", held.session_id)
                events: list[ManagerEvent] = []
                with self._delivering(events), self._lock:  # events go out once the lock is released
                    self._admit(held.session_id, Entry.holding_parked(session, held.parked), events)
                loaded.append(held.session_id)
        except Exception:
            for session_id in loaded:
                self.release(session_id)
            with self._lock:
                self._lost.clear()
            raise
        with self._lock:
            self._hits = self._misses = 0
            self._counts = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------ reports
    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes held by device key (parked bytes under ``"cpu:0/pinned_host"`` etc.), each buffer once."""
        with self._lock:
            return dict(self._ledger.totals)

    def stats(self) -> dict[str, Any]:
        """Counters and bytes.

        Returns:
          ``sessions``; ``hits`` and ``misses`` (lookups by get, update, pin
          and checkout: a miss found the id lost or had to bring objects back) and
          their sum ``lookups``; ``evictions`` (objects evicted to be
          rebuilt), ``demotions`` (objects replaced by their lower tier),
          ``preemptions`` (whole sessions released), ``parks``, ``restores``
          (parked objects copied back), ``rebuilds``, ``refusals``;
          ``bytes`` by device key; with a
          :class:`~jax_session_state.reuse.SharedStore` on this manager,
          ``shared``: its :meth:`~jax_session_state.reuse.SharedStore.stats`.

        Example:
          >>> import jax_session_state as jss
          >>> manager = jss.SessionStateManager()
          >>> manager.create("a", jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(1, 4))}))
          >>> session = manager.get("a")  # a hit
          >>> try:
          ...     manager.get("b")  # a miss
          ... except jss.SessionStateLostError:
          ...     pass
          >>> manager.stats()
          {'sessions': 1, 'lookups': 2, 'hits': 1, 'misses': 1, 'evictions': 0, 'demotions': 0,
           'preemptions': 0, 'parks': 0, 'restores': 0, 'rebuilds': 0, 'refusals': 0, 'bytes': {'cpu:0': 33}}
        """
        with self._lock:
            stats = {
                "sessions": len(self._entries),
                "lookups": self._hits + self._misses,
                "hits": self._hits,
                "misses": self._misses,
                **self._counts,
                "bytes": dict(self._ledger.totals),
            }
        for name, report in dict(getattr(self, "_stat_reports", {})).items():  # outside the lock: they take theirs
            stats[name] = report()
        return stats

    def held(self) -> dict[Hashable, Held]:
        """How every session is held now, least recently used first, without bringing anything back.

        For reports (``jss.summary(manager)``): a parked object's arrays are
        in host memory and stay out of the sessions here.
        """
        with self._lock:
            return {
                session_id: Held(
                    entry.session,
                    {name: entry.records[name].parked for name in entry.names("parked")},
                    frozenset(entry.names("evicted")),
                    offload.is_donated(entry.session),
                    bool(entry.pins),
                )
                for session_id, entry in self._by_recency()
            }
