"""The session manager's table and the work done under its lock: lookups, room-making, restores.

:class:`ManagerCore` holds the state of a
:class:`~jax_session_state.SessionStateManager` and the operations on it
that the public methods compose.  Every method here runs with ``self._lock``
held (the public methods take it) and reports what it did by appending a
:class:`~jax_session_state.ManagerEvent` to the ``events`` list it is given;
:meth:`ManagerCore._delivering` hands them to ``on_event`` once the lock is
released.

The state:

- ``_entries``: session id -> :class:`~jax_session_state.manager._table.Entry`
  (the session, per-object records, pins, the update() hold);
- ``_recency``: ids least recently used first; the value is the session
  while a lookup may hand it out at once, else None;
- ``_lost``: why recently lost ids were lost (for their lookup errors);
- ``_ledger``: reference counts of every buffer held, and byte totals;
- ``_rebuilds``: registered rebuild functions by object name, with a
  version the planner's cached figures are keyed by;
- ``_hits``, ``_misses``, ``_counts``: what ``stats()`` reports.

Making room (:meth:`ManagerCore._plan_room`) asks the pure planner for a
plan over every session's cached figures and prepares each action's new
object (:mod:`~jax_session_state.manager._prepare`) before anything changes;
a restore also copies back and rebuilds its objects then; only then are the
actions applied (:meth:`ManagerCore._apply`): a refusal or an error leaves
every session as it was.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

from jax_session_state.accounting import Storage
from jax_session_state.errors import BudgetExceededError, PayloadError, SessionAdmissionError, SessionStateLostError
from jax_session_state.manager import offload
from jax_session_state.manager._agreement import DEFAULT_TIMEOUT_S, ProcessAgreement, agree_on
from jax_session_state.manager._events import ManagerEvent, deliver
from jax_session_state.manager._prepare import Prepared, Room, prepared, release_replaced, restored_session
from jax_session_state.manager._table import Entry, Ledger, Rebuild, split_shared
from jax_session_state.manager.planner import DemoteObject, EvictObject, Plan, SessionUsage, plan
from jax_session_state.session import Session

LOST_REASONS_KEPT = 4096
"""How many lost (released or preempted) session ids keep their reason for later lookups."""

COUNTERS = ("evictions", "demotions", "preemptions", "parks", "restores", "rebuilds", "refusals")
"""The action counters ``stats()`` reports."""


class _Donated(Exception):
    """Sessions a plan would act on whose arrays a step in progress has donated."""

    def __init__(self, session_ids: set[Hashable]):
        super().__init__(session_ids)
        self.session_ids = session_ids


class ManagerCore:
    """The manager's settings, table and locked operations (see the module docs)."""

    def __init__(
        self,
        *,
        max_sessions: int,
        byte_budget: dict[str, int],
        evict_when_full: bool,
        park_memory_kind: str | None,
        host_budget: int | None,
        lock: Any,
        on_event: Callable[[ManagerEvent], None] | None,
        agreement_timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self._agreement = ProcessAgreement(agreement_timeout)  # decisions on sessions spanning processes
        self.max_sessions = max_sessions
        self.byte_budget = byte_budget
        self.evict_when_full = evict_when_full
        self.park_memory_kind = park_memory_kind
        self.host_budget = host_budget
        self.on_event = on_event
        self._lock = lock
        self._idle = threading.Condition(self._lock)  # signalled when an update() ends
        self._entries: dict[Hashable, Entry] = {}
        # Recency, least recently used first; the value is the session while a lookup may hand it out
        # at once (whole, not in an update), else None: a hit reads nothing else.
        self._recency: collections.OrderedDict[Hashable, Session | None] = collections.OrderedDict()
        self._lost: collections.OrderedDict[Hashable, str] = collections.OrderedDict()
        self._ledger = Ledger()
        self._rebuilds: dict[str, Rebuild] = {}
        self._rebuilds_version = 0
        self._table_version = 0  # counts changes of _entries (a rebuild function may make some)
        self._hits = self._misses = 0
        self._counts = dict.fromkeys(COUNTERS, 0)
        # More reports for stats(), by name (a reuse.SharedStore adds "shared"); called outside the lock.
        self._stat_reports: dict[str, Callable[[], Any]] = {}

    @contextlib.contextmanager
    def _delivering(self, events: list[ManagerEvent]) -> Iterator[None]:
        """Runs an operation (outside it: the manager's lock), then hands every event it made to ``on_event``."""
        try:
            yield
        except BaseException as error:  # the operation's own error wins; the listener's are noted on it
            deliver(self.on_event, events, failing=error)
            raise
        deliver(self.on_event, events)

    def _store(self, session_id: Hashable, entry: Entry) -> None:
        """Holds ``entry`` for the id (a new id is the most recently used)."""
        self._entries[session_id] = entry
        self._recency[session_id] = entry.session if entry.ready else None
        self._table_version += 1

    def _forget(self, session_id: Hashable) -> Entry:
        del self._recency[session_id]
        self._table_version += 1
        return self._entries.pop(session_id)

    def _by_recency(self) -> Iterator[tuple[Hashable, Entry]]:
        """Every (id, entry), least recently used first."""
        for session_id in self._recency:
            yield session_id, self._entries[session_id]

    def _wait_idle(self, session_id: Hashable) -> Entry:
        me = threading.get_ident()
        while True:
            entry = self._entries.get(session_id)
            if entry is None:
                raise self._lost_error(session_id)
            if entry.busy is None or entry.busy == me:
                return entry
            self._idle.wait()

    def _lost_error(self, session_id: Hashable) -> SessionStateLostError:
        reason = self._lost.get(session_id)
        if reason is None:
            return SessionStateLostError(
                f"session {session_id!r} is unknown to this manager: it was never created (or was lost "
                f"longer ago than the last {LOST_REASONS_KEPT} losses). Nothing was created; call "
                f"create({session_id!r}, session) to start it."
            )
        return SessionStateLostError(
            f"session {session_id!r} is gone: {reason}. Its state cannot be returned and nothing was "
            f"created; start it again with create({session_id!r}, session) (from a checkpoint if you keep "
            "them), and pin() sessions that must not be lost."
        )

    def _remember_loss(self, session_id: Hashable, reason: str) -> None:
        self._lost[session_id] = reason
        self._lost.move_to_end(session_id)
        while len(self._lost) > LOST_REASONS_KEPT:
            self._lost.popitem(last=False)

    def _count_cap_victim(self) -> Hashable | None:
        for session_id, entry in self._by_recency():
            if not entry.pins and entry.busy is None and not offload.is_donated(entry.session):
                return session_id
        return None

    def _refuse_admission(self, session_id: Hashable, events: list[ManagerEvent]) -> None:
        why = (
            "every held session is pinned or in use"
            if self.evict_when_full
            else "it may not evict (evict_when_full=False)"
        )
        message = (
            f"cannot create session {session_id!r}: the manager holds max_sessions={self.max_sessions} "
            f"sessions and {why}. Nothing changed; release() a session, raise max_sessions, or allow eviction."
        )
        self._counts["refusals"] += 1
        events.append(ManagerEvent("refusal", session_id, None, {}, message))
        raise SessionAdmissionError(message)

    def _admit(self, session_id: Hashable, new: Entry, events: list[ManagerEvent]) -> None:
        """Holds ``new`` under an id not held yet, making room as ``create`` describes; else changes nothing."""
        if session_id in self._entries:
            raise PayloadError(
                f"create({session_id!r}): that session exists already. put() replaces it; "
                "release() it first to start over."
            )
        victim = None
        if len(self._entries) >= self.max_sessions:
            victim = self._count_cap_victim()
            if victim is None or not self.evict_when_full:
                self._refuse_admission(session_id, events)
        removed = list(self._entries[victim].storages()) if victim is not None else []
        action = f"creating session {session_id!r}"
        self._make_room(
            session_id, action, new, removed=removed, added=list(new.storages()), exclude=victim, events=events
        )
        if victim is not None:
            reason = f"preempted at the count cap (max_sessions={self.max_sessions}) while {action}"
            self._preempt(victim, reason, events)
        self._ledger.apply((), new.storages())
        self._store(session_id, new)
        self._lost.pop(session_id, None)

    def _make_room(self, session_id: Hashable, action: str, proposal: Entry, **kwargs: Any) -> None:
        """Frees bytes, if need be, so that ``action`` fits every budget (:meth:`_plan_room`, then applied)."""
        self._apply(self._plan_room(session_id, action, proposal, **kwargs))

    def _plan_room(
        self,
        session_id: Hashable,
        action: str,
        proposal: Entry,
        *,
        removed: Iterable[Storage] = (),
        added: Iterable[Storage] = (),
        restored: Mapping[str, int] | None = None,
        exclude: Hashable | None = None,
        events: list[ManagerEvent],
    ) -> Room:
        """The prepared actions that make ``action`` fit every budget (none when it fits); else refuses.

        Nothing changes here but the counters: :meth:`_apply` applies the room.

        The action releases storages ``removed``, takes ``added`` and, for a
        restore, brings back ``restored`` bytes (``proposal`` is then the
        entry restored, else the entry as it will be); ``exclude`` is a
        session leaving at the same time.  For a session spanning processes
        the decision is first agreed with every other process (see
        :mod:`~jax_session_state.manager._agreement`).
        """
        spanning = self._agreement.spans(session_id, proposal) or (
            exclude is not None and self._agreement.spans(exclude, self._entries[exclude])
        )
        agreed = functools.partial(
            agree_on, self._agreement, self._entries, session_id, action, proposal,
            restoring=restored is not None, victim=exclude,
        )  # fmt: skip
        change = self._ledger.delta(removed, added)
        for key, nbytes in (restored or {}).items():
            change[key] = change.get(key, 0) + nbytes
        over = {
            key: self._ledger.totals.get(key, 0) + change.get(key, 0) - budget
            for key, budget in self.byte_budget.items()
            if self._ledger.totals.get(key, 0) + change.get(key, 0) > budget
        }
        if not over:
            if spanning:
                agreed()
            return Room([], "", events)
        reason = ", ".join(
            f"{key} over its budget of {self.byte_budget[key]} bytes by {n}" for key, n in over.items()
        )
        reason = f"{reason} while {action}"
        # An operation on a session of this process alone never acts on one spanning processes.
        untouchable: set[Hashable] = set() if spanning else self._agreement.spanning_ids(self._entries)
        while True:
            result = plan(
                self._usages(session_id, proposal, exclude, untouchable, restoring=restored is not None),
                budgets=self.byte_budget,
                protect=session_id,
                park=self.park_memory_kind is not None,
                host_room=self._host_room(),
                allow_preempt=self.evict_when_full,
            )
            if not isinstance(result, Plan):
                self._counts["refusals"] += 1
                message = (
                    f"{action} does not fit the byte budget ({reason}); after everything the manager may "
                    f"free it is still {result.message}. Nothing changed. Raise byte_budget, release() or unpin "
                    "sessions, register rebuild functions, or allow parking and eviction."
                )
                events.append(
                    ManagerEvent("refusal", session_id, None, dict(result.shortfall_by_device), message)
                )
                if spanning:
                    agreed(refused=True)
                raise BudgetExceededError(message)
            try:
                room = Room(self._prepare(result), reason, events)
            except _Donated as donated:
                untouchable |= donated.session_ids
                continue
            if spanning:
                agreed(actions=result.actions)
            return room

    def _host_room(self) -> int | None:
        if self.host_budget is None:
            return None
        suffix = f"/{self.park_memory_kind}"
        parked = sum(nbytes for key, nbytes in self._ledger.totals.items() if key.endswith(suffix))
        return max(self.host_budget - parked, 0)

    def _usages(
        self,
        session_id: Hashable,
        proposal: Entry,
        exclude: Hashable | None,
        untouchable: set[Hashable],
        *,
        restoring: bool,
    ) -> list[SessionUsage]:
        """The planner's view: every session, least recently used first, the proposal last; buffers several
        sessions hold count once, in a pinned session of their own (:func:`split_shared`)."""
        views = []
        for tick, (other_id, entry) in enumerate(self._by_recency()):
            if other_id != session_id and other_id != exclude:
                pinned = bool(entry.pins) or entry.busy is not None or other_id in untouchable
                views.append((entry, entry.usage(other_id, tick, pinned, self._rebuilds, self._rebuilds_version)))
        last = len(self._entries)
        if restoring:
            views.append((proposal, proposal.restored_usage(session_id, last, self._rebuilds)))
        else:
            views.append((proposal, proposal.usage(session_id, last, True, self._rebuilds, self._rebuilds_version)))
        return split_shared(views)

    def _prepare(self, result: Plan) -> list[Prepared]:
        """Each action's new object (evicted, demoted or parked), computed before anything changes.

        Raises:
          _Donated: naming every acted-on session whose arrays were donated.
        """
        # A step in progress holds such a session: untouchable till its put.
        donated = {a.session_id for a in result.actions if offload.is_donated(self._entries[a.session_id].session)}
        if donated:
            raise _Donated(donated)
        return [prepared(action, self._entries[action.session_id], self.park_memory_kind) for action in result.actions]

    def _apply(self, room: Room) -> None:
        """Applies the room's prepared actions in order, and reports each."""
        for action, change in room.actions:
            session_id = action.session_id
            if change is None:
                self._preempt(session_id, f"preempted ({room.reason})", room.events)
                continue
            entry = self._entries[session_id]
            obj, record = change
            removed = entry.records[action.name].storages
            freed = {k: -b for k, b in self._ledger.delta(removed, record.storages).items() if b}
            self._ledger.apply(removed, record.storages)
            self._store(session_id, entry.with_object(action.name, obj, record))
            if isinstance(action, EvictObject):
                self._counts["evictions"] += 1
                room.events.append(ManagerEvent("evict", session_id, action.name, freed, room.reason))
            elif isinstance(action, DemoteObject):
                release_replaced(entry.session[action.name], self._ledger)
                self._counts["demotions"] += 1
                room.events.append(ManagerEvent("demote", session_id, action.name, freed, room.reason))
            else:
                self._counts["parks"] += 1
                room.events.append(ManagerEvent("park", session_id, action.name, dict(action.moved), room.reason))

    def _preempt(self, session_id: Hashable, reason: str, events: list[ManagerEvent]) -> None:
        entry = self._forget(session_id)
        freed = {k: -b for k, b in self._ledger.delta(entry.storages(), ()).items() if b}
        self._ledger.apply(entry.storages(), ())
        self._remember_loss(session_id, reason)
        self._counts["preemptions"] += 1
        events.append(ManagerEvent("preempt", session_id, None, freed, reason))

    def _restore(self, session_id: Hashable, entry: Entry, events: list[ManagerEvent]) -> Entry:
        """Brings the session's parked and evicted objects back; the new entry.

        The room is planned and prepared, then the objects are copied back and
        rebuilt, and only then is the room made: a refusal or a failing rebuild
        leaves every session as it was.
        """
        parked, evicted = entry.names("parked"), entry.names("evicted")
        restored: dict[str, int] = {}
        for name in parked + evicted:
            for key, nbytes in entry.records[name].home_bytes.items():
                restored[key] = restored.get(key, 0) + nbytes
        room = functools.partial(
            self._plan_room,
            session_id,
            f"restoring session {session_id!r}",
            entry,
            removed=[storage for name in parked for storage in entry.records[name].storages],
            restored=restored,
            events=events,
        )
        planned = room()
        version = self._table_version
        new = Entry.of(restored_session(session_id, entry, self._rebuilds)).carrying(entry)
        self._apply(planned if self._table_version == version else room())  # a rebuild function changed the table
        self._ledger.apply(entry.storages(), new.storages())
        self._store(session_id, new)
        reason = f"session {session_id!r} looked up"
        for name in parked:
            self._counts["restores"] += 1
            events.append(ManagerEvent("restore", session_id, name, new.records[name].home_bytes, reason))
        for name in evicted:
            self._counts["rebuilds"] += 1
            events.append(ManagerEvent("rebuild", session_id, name, new.records[name].home_bytes, reason))
        return new
