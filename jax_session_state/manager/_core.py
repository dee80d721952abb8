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

Making room (:meth:`ManagerCore._make_room`) asks the pure planner for a
plan over every session's cached figures, prepares each action's new object
before anything changes, then applies them all: a refusal or an error
leaves every session as it was.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

import jax

from jax_session_state._core._validation import non_negative
from jax_session_state.accounting import Storage
from jax_session_state.base import StateObject
from jax_session_state.errors import (
    BudgetExceededError,
    PayloadError,
    PayloadTypeError,
    SessionAdmissionError,
    SessionStateLostError,
)
from jax_session_state.manager import offload
from jax_session_state.manager._agreement import DEFAULT_TIMEOUT_S, ProcessAgreement, agree_on
from jax_session_state.manager._events import ManagerEvent, deliver
from jax_session_state.manager._table import (
    Entry,
    Ledger,
    ObjectRecord,
    Rebuild,
    distinct_bytes,
    split_shared,
)
from jax_session_state.manager.planner import (
    Action,
    DemoteObject,
    EvictObject,
    Plan,
    PreemptSession,
    SessionUsage,
    plan,
)
from jax_session_state.session import Session

LOST_REASONS_KEPT = 4096
"""How many lost (released or preempted) session ids keep their reason for later lookups."""

COUNTERS = ("evictions", "demotions", "preemptions", "parks", "restores", "rebuilds", "refusals")
"""The action counters ``stats()`` reports."""


_demoted_in_place = jax.jit(lambda obj: obj.demote(), donate_argnums=0)
"""An object's next lower tier, its storage donated: the bookkeeping is reused in place and the float
storage read once, so the peak is the float storage plus its quantized copy (compiled once per spec)."""

_demoted_copy = jax.jit(lambda obj: obj.demote())
"""The same, for an object that shares a buffer with another object or session the manager holds."""


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
        timeout = non_negative("SessionStateManager", "agreement_timeout", agreement_timeout)
        self._agreement = ProcessAgreement(timeout)  # decisions on sessions spanning processes
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

    def _forget(self, session_id: Hashable) -> Entry:
        del self._recency[session_id]
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

    def _make_room(
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
    ) -> None:
        """Frees bytes, if need be, so that ``action`` fits every budget; else refuses, changing nothing.

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
            return
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
                prepared = self._prepare(result)
            except _Donated as donated:
                untouchable |= donated.session_ids
                continue
            if spanning:
                agreed(actions=result.actions)
            self._apply(prepared, reason, events)
            return

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

    def _prepare(self, result: Plan) -> list[tuple[Action, tuple[StateObject, ObjectRecord] | None]]:
        """Each action's new object (evicted or parked), computed before anything changes.

        Demotions are computed when applied (:meth:`_demote`): they donate the
        object's storage, so only once nothing can refuse the plan.

        Raises:
          _Donated: naming every acted-on session whose arrays were donated.
        """
        # A step in progress holds such a session: untouchable till its put.
        donated = {a.session_id for a in result.actions if offload.is_donated(self._entries[a.session_id].session)}
        if donated:
            raise _Donated(donated)
        prepared = []
        for action in result.actions:
            entry = self._entries[action.session_id]
            if isinstance(action, (PreemptSession, DemoteObject)):
                prepared.append((action, None))
            elif isinstance(action, EvictObject):
                obj = entry.session[action.name]
                record = entry.records[action.name].evicted(offload.Placement.of(obj))
                prepared.append((action, (obj.evict()[0], record)))
            else:
                obj = entry.session[action.name]
                record = entry.records[action.name].parked_as(offload.park(obj, self.park_memory_kind))
                prepared.append((action, (obj.reset(), record)))
        return prepared

    def _demote(self, entry: Entry, name: str) -> tuple[StateObject, ObjectRecord]:
        """Object ``name`` of ``entry`` demoted, and its record.

        Its storage is donated where the manager holds each of its buffers
        once, for this object only; an object sharing a buffer with another
        object or session is demoted into new buffers, the shared ones kept.
        """
        storages = entry.records[name].storages
        counts = collections.Counter(storages)
        alone = all(n == 1 and self._ledger.refs.get(storage) == 1 for storage, n in counts.items())
        with warnings.catch_warnings():  # the float storage is donated to be freed, not reused: no warning
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            demoted = (_demoted_in_place if alone else _demoted_copy)(entry.session[name])
        return demoted, ObjectRecord.of(demoted)

    def _apply(
        self,
        prepared: list[tuple[Action, tuple[StateObject, ObjectRecord] | None]],
        reason: str,
        events: list[ManagerEvent],
    ) -> None:
        for action, change in prepared:
            session_id = action.session_id
            if isinstance(action, PreemptSession):
                self._preempt(session_id, f"preempted ({reason})", events)
                continue
            entry = self._entries[session_id]
            obj, record = self._demote(entry, action.name) if isinstance(action, DemoteObject) else change
            new = entry.with_object(action.name, obj, record)
            removed = entry.records[action.name].storages
            freed = {k: -b for k, b in self._ledger.delta(removed, record.storages).items() if b}
            self._ledger.apply(removed, record.storages)
            self._store(session_id, new)
            if isinstance(action, EvictObject):
                self._counts["evictions"] += 1
                events.append(ManagerEvent("evict", session_id, action.name, dict(action.freed), reason))
            elif isinstance(action, DemoteObject):
                self._counts["demotions"] += 1
                events.append(ManagerEvent("demote", session_id, action.name, freed, reason))
            else:
                self._counts["parks"] += 1
                events.append(ManagerEvent("park", session_id, action.name, dict(action.moved), reason))

    def _preempt(self, session_id: Hashable, reason: str, events: list[ManagerEvent]) -> None:
        entry = self._forget(session_id)
        freed = distinct_bytes(entry.storages())
        self._ledger.apply(entry.storages(), ())
        self._remember_loss(session_id, reason)
        self._counts["preemptions"] += 1
        events.append(ManagerEvent("preempt", session_id, None, freed, reason))

    def _restore(self, session_id: Hashable, entry: Entry, events: list[ManagerEvent]) -> Entry:
        """Brings the session's parked and evicted objects back (making room first); the new entry."""
        parked, evicted = entry.names("parked"), entry.names("evicted")
        released = [storage for name in parked for storage in entry.records[name].storages]
        restored: dict[str, int] = {}
        for name in parked + evicted:
            for key, nbytes in entry.records[name].home_bytes.items():
                restored[key] = restored.get(key, 0) + nbytes
        self._make_room(
            session_id,
            f"restoring session {session_id!r}",
            entry,
            removed=released,
            restored=restored,
            events=events,
        )
        objects = dict(entry.session.objects)
        for name in parked:
            objects[name] = offload.restore(entry.records[name].parked)
        session = entry.session.replace(objects=objects)
        for name in evicted:
            objects[name] = self._rebuild(session_id, name, session, entry.records[name].placement)
        new = Entry.of(entry.session.replace(objects=objects)).carrying(entry)
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

    def _rebuild(
        self, session_id: Hashable, name: str, session: Session, placement: offload.Placement | None
    ) -> StateObject:
        original = session[name]
        where = f"rebuilding {name!r} of session {session_id!r}"
        try:
            rebuilt = self._rebuilds[name].fn(session)
        except Exception as error:
            raise RuntimeError(
                f"{where}: the registered rebuild function raised {type(error).__name__}: {error}. The "
                f"session is unchanged ({name!r} is still evicted); fix the function given to "
                f"register_rebuild({name!r})."
            ) from error
        if not isinstance(rebuilt, StateObject):
            got = type(rebuilt).__name__
        elif not rebuilt.resident:
            got = f"{rebuilt.describe()} (not resident)"
        else:
            got = rebuilt.describe()
        if got != original.describe():
            raise PayloadError(
                f"{where}: the rebuild function must return a resident {original.describe()}; it returned "
                f"{got}. The session is unchanged; fix the function given to register_rebuild({name!r})."
            )
        rebuilt = rebuilt.replace(
            recompute_source=original.recompute_source, recompute_cost=original.recompute_cost
        )
        return rebuilt if placement is None else placement.apply(rebuilt)

def checked_session(session: Any, operation: str, session_id: Hashable) -> Session:
    if not isinstance(session, Session):
        raise PayloadTypeError(
            f"{operation}({session_id!r}, session): expected a jss.Session; got {type(session).__name__}."
        )
    if offload.is_donated(session):
        raise PayloadError(
            f"{operation}({session_id!r}, session): some of its arrays were deleted (donated to a jitted "
            "step). Pass the step's output instead. Nothing changed."
        )
    return session
