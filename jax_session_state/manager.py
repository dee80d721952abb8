"""``SessionStateManager``: many sessions under per-device byte budgets, on the host.

The protocol: ``create`` a session, then for every step ``get`` it, run the
jitted (donating) step, and ``put`` the result back — or let ``update(sid, fn)``
do all three atomically.  When a put, a create or a restore would exceed a
byte budget the manager frees bytes in this order (see
:func:`jax_session_state.planner.plan`): it drops objects it can rebuild
(registered with :meth:`SessionStateManager.register_rebuild`), parks others to
host memory, and, if ``evict_when_full``, preempts least recently used
sessions; otherwise it refuses and changes nothing.  A later ``get`` brings
dropped and parked objects back before returning the session.  Nothing is
lost silently: every action is reported through ``on_event`` and a preempted
session raises :class:`~jax_session_state.errors.SessionStateLostError`.
``checkout`` / ``checkin`` lend a session to a slot of a
:class:`~jax_session_state.SessionPool` and take it back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, Literal

from jax_session_state import offload
from jax_session_state._checkout import PoolCheckouts
from jax_session_state._held import Entry, Ledger, ObjectRecord, Rebuild, distinct_bytes
from jax_session_state.accounting import Storage
from jax_session_state.base import StateObject
from jax_session_state.errors import (
    BudgetExceededError,
    SessionAdmissionError,
    SessionCheckedOutError,
    SessionStateLostError,
)
from jax_session_state.planner import Action, DropObject, Plan, PreemptSession, SessionUsage, plan
from jax_session_state.session import Session

__all__ = ["Held", "ManagerEvent", "SessionStateManager"]

EventKind = Literal["drop", "park", "restore", "rebuild", "preempt", "refusal"]

LOST_REASONS_KEPT = 4096
"""How many lost (dropped or preempted) session ids keep their reason for later lookups."""

_COUNTERS = ("evictions", "preemptions", "parks", "restores", "rebuilds", "refusals")


@dataclasses.dataclass(frozen=True)
class ManagerEvent:
    """Something the manager did to a session, or refused to do.

    Attributes:
      kind: ``"drop"`` (an object evicted, to be rebuilt), ``"park"`` (an
        object moved to host memory), ``"restore"`` (a parked object copied
        back), ``"rebuild"`` (a dropped object rebuilt), ``"preempt"`` (a whole
        session released: later lookups raise SessionStateLostError) or
        ``"refusal"`` (a create, put or restore refused; nothing changed).
      session_id: the session acted on (for a refusal, the one refused).
      object_name: the object acted on; None for whole sessions.
      bytes_by_device: the bytes moved, freed or taken, by device key (for a
        refusal, the shortfall).
      reason: why, in words.
    """

    kind: EventKind
    session_id: Hashable
    object_name: str | None
    bytes_by_device: Mapping[str, int]
    reason: str


@dataclasses.dataclass(frozen=True)
class Held:
    """How the manager holds one session now (see :meth:`SessionStateManager.held`).

    Attributes:
      session: the session; its parked and dropped objects are not resident here.
      parked: the parked objects by name (their arrays in host memory).
      dropped: names of the objects dropped, to be rebuilt on the next lookup.
      donated: whether its arrays were deleted by a step in progress (between
        a ``get`` and its ``put``).
    """

    session: Session
    parked: Mapping[str, offload.Parked]
    dropped: frozenset[str]
    donated: bool


class _Donated(Exception):
    """Sessions a plan would act on whose arrays a step in progress has donated."""

    def __init__(self, session_ids: set[Hashable]):
        super().__init__(session_ids)
        self.session_ids = session_ids


class SessionStateManager(PoolCheckouts):
    """Sessions by id on the host, under a count cap and per-device byte budgets; thread-safe.

    Use ``get`` / ``put``: ``get`` hands out the stored session itself, so a
    step that donates it deletes the stored copy's arrays; ``put`` the step's
    result back before anything else needs that session.  Between the two the
    manager leaves that session alone (it never drops, parks or preempts a
    session whose arrays were donated).  ``update(sid, fn)`` does get, fn, put
    atomically for that id and is safe by construction.

    Args:
      max_sessions: the most sessions held at once.
      byte_budget: the most bytes held per device key (``{"cuda:0": 40 << 30}``);
        keys not named are unlimited; None: no byte budget.
      evict_when_full: whether the manager may release whole least recently
        used sessions (at the count cap, or when dropping and parking objects
        is not enough); if not, it refuses with
        :class:`~jax_session_state.errors.SessionAdmissionError` /
        :class:`~jax_session_state.errors.BudgetExceededError`.
      park_memory_kind: the host memory kind objects are parked to
        (``"pinned_host"``), or None to never park.
      host_budget: the most bytes held in ``park_memory_kind`` memory, all
        devices together: parks stop there; None: unlimited.
      lock_factory: makes the manager's lock, anything
        :class:`threading.Condition` accepts: ``threading.RLock`` (a rebuild
        function, which runs under the lock, may then call the manager) or
        ``threading.Lock``.
      on_event: called with a :class:`ManagerEvent` for every drop, park,
        restore, rebuild, preemption and refusal, after the manager's lock is
        released and the operation is done (an exception it raises reaches
        the caller of that completed operation).

    A manager is always truthy (so ``manager or default`` never replaces an
    empty one); ``len(manager)`` is the number of sessions held.

    Example:
      >>> import jax_session_state as jss
      >>> def make():
      ...     return jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(1, 256))})
      >>> events = []
      >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 5000}, on_event=events.append)
      >>> for sid in "abc":
      ...     manager.create(sid, make())
      >>> [(e.kind, e.session_id, e.object_name) for e in events]  # room for two carries of 2049 bytes
      [('park', 'a', 'carry')]
      >>> manager.nbytes_by_device()
      {'cpu:0': 4098, 'cpu:0/pinned_host': 2049}
      >>> session = manager.get("a")  # copied back; "b" is parked to make room
      >>> [(e.kind, e.session_id) for e in events[1:]]
      [('park', 'b'), ('restore', 'a')]
    """

    def __init__(
        self,
        *,
        max_sessions: int = 64,
        byte_budget: Mapping[str, int] | None = None,
        evict_when_full: bool = True,
        park_memory_kind: Literal["pinned_host"] | None = "pinned_host",
        host_budget: int | None = None,
        lock_factory: Callable[[], Any] = threading.RLock,
        on_event: Callable[[ManagerEvent], None] | None = None,
    ):
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"SessionStateManager: max_sessions must be an int >= 1; got {max_sessions!r}.")
        budgets = dict(byte_budget or {})
        for key, nbytes in budgets.items():
            if not isinstance(key, str) or not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(
                    "SessionStateManager: byte_budget maps device keys ('cpu:0', 'cuda:0', "
                    f"'cuda:0/pinned_host') to bytes >= 0; got {key!r}: {nbytes!r}."
                )
        if park_memory_kind not in ("pinned_host", None):
            raise ValueError(
                f"SessionStateManager: park_memory_kind is 'pinned_host' or None; got {park_memory_kind!r}."
            )
        if host_budget is not None and (not isinstance(host_budget, int) or host_budget < 0):
            raise ValueError(
                f"SessionStateManager: host_budget must be bytes >= 0 or None; got {host_budget!r}."
            )
        self.max_sessions = max_sessions
        self.byte_budget = budgets
        self.evict_when_full = evict_when_full
        self.park_memory_kind = park_memory_kind
        self.host_budget = host_budget
        self.on_event = on_event
        self._lock = lock_factory()
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
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._init_checkouts()

    # ------------------------------------------------------------ mapping
    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return True

    # ------------------------------------------------------------ lookups
    def get(self, session_id: Hashable) -> Session:
        """The session, with anything dropped or parked brought back first.

        The session returned is the one stored: donating it to a jitted step
        deletes the stored copy's arrays, so ``put`` the step's result back.

        Raises:
          SessionStateLostError: the id is unknown, dropped or preempted
            (nothing is created).
          BudgetExceededError: bringing its objects back does not fit; the
            session stays as it was.
        """
        with self._lock:
            session = self._recency.get(session_id)
            if session is not None:
                self._recency.move_to_end(session_id)
                self._hits += 1
                return session
        return self._checkout(session_id)[0]

    def update(self, session_id: Hashable, fn: Callable[[Session], Session]) -> Session:
        """Gets the session, applies ``fn`` and puts the result back, atomically for this id.

        While ``fn`` runs (outside the manager's lock) other lookups, puts and
        drops of this id wait, and the manager does not touch the session, so
        ``fn`` may donate it.

        Returns:
          The new session, as stored.

        Raises:
          SessionStateLostError: the id is unknown, dropped or preempted.
          BudgetExceededError: the result does not fit; it is attached to the
            error as ``session`` and the stored session is the one ``fn`` got
            (dead if ``fn`` donated it: ``put`` the result once there is room).

        If ``fn`` raises, the stored session is the one ``fn`` got (dead if
        ``fn`` donated it before raising: ``put`` a state back).
        """
        me = threading.get_ident()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None and entry.busy == me:
                raise RuntimeError(f"update({session_id!r}) called inside update({session_id!r})'s own fn.")
        session, entry = self._checkout(session_id, hold=True)
        try:
            new = fn(session)
            try:
                return self.put(session_id, new)
            except BudgetExceededError as error:
                error.session = new
                raise
        finally:
            with self._lock:
                entry = self._entries.get(session_id)
                if entry is not None and entry.busy == me:
                    entry.busy = None
                    self._store(session_id, entry)
                self._idle.notify_all()

    @contextlib.contextmanager
    def pin(self, session_id: Hashable) -> Iterator[Session]:
        """Keeps the session whole while the block runs: nothing is dropped, parked or preempted.

        Yields the session (brought back first, like ``get``).  Pins nest;
        ``put`` inside the block keeps the pin; ``drop`` ends it.
        """
        session, entry = self._checkout(session_id, pin=True)
        try:
            yield session
        finally:
            with self._lock:
                current = self._entries.get(session_id)
                if current is not None and current.origin is entry.origin:  # not dropped and created again
                    current.pins -= 1

    def _checkout(
        self, session_id: Hashable, *, hold: bool = False, pin: bool = False
    ) -> tuple[Session, Entry]:
        """The slow lookup: waits for an update in progress, restores what is missing, counts."""
        events: list[ManagerEvent] = []
        try:
            with self._lock:
                try:
                    entry = self._wait_idle(session_id)
                except SessionStateLostError:
                    self._misses += 1
                    raise
                if entry.whole:
                    self._hits += 1
                else:
                    self._misses += 1
                    entry = self._restore(session_id, entry, events)
                self._recency.move_to_end(session_id)
                if pin:
                    entry.pins += 1
                if hold:
                    entry.busy = threading.get_ident()
                    self._store(session_id, entry)
                return entry.session, entry
        finally:
            self._emit(events)

    def _wait_idle(self, session_id: Hashable) -> Entry:
        me = threading.get_ident()
        while True:
            entry = self._entries.get(session_id)
            if entry is None:
                raise self._lost_error(session_id)
            if entry.busy is None or entry.busy == me:
                return entry
            self._idle.wait()

    def _lost_error(self, session_id: Hashable) -> SessionStateLostError | SessionCheckedOutError:
        if session_id in self._checked_out:
            return self._checked_out_error(session_id)
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

    # -------------------------------------------------------------- writes
    def create(self, session_id: Hashable, session: Session) -> None:
        """Admits a new session.

        At the count cap the least recently used session that is not pinned
        or in use is preempted if ``evict_when_full``; over a byte budget room
        is made as described in the module docs.

        Raises:
          ValueError: the id is held already (``put`` replaces a session).
          SessionAdmissionError: at the count cap and no session may be
            preempted; nothing changed.
          BudgetExceededError: the session does not fit; nothing changed.
        """
        new = Entry.of(_checked_session(session, "create", session_id))
        events: list[ManagerEvent] = []
        try:
            with self._lock:
                if session_id in self._checked_out:
                    raise self._checked_out_error(session_id)
                if session_id in self._entries:
                    raise ValueError(
                        f"create({session_id!r}): that session exists already. put() replaces it; "
                        "drop() it first to start over."
                    )
                victim = None
                if len(self._entries) >= self.max_sessions:
                    victim = self._count_cap_victim()
                    if victim is None or not self.evict_when_full:
                        self._refuse_admission(session_id, events)
                removed = list(self._entries[victim].storages()) if victim is not None else []
                action = f"creating session {session_id!r}"
                self._make_room(
                    session_id,
                    action,
                    new,
                    removed=removed,
                    added=list(new.storages()),
                    exclude=victim,
                    events=events,
                )
                if victim is not None:
                    reason = f"preempted at the count cap (max_sessions={self.max_sessions}) while {action}"
                    self._preempt(victim, reason, events)
                self._ledger.apply((), new.storages())
                self._store(session_id, new)
                self._lost.pop(session_id, None)
        finally:
            self._emit(events)

    def put(self, session_id: Hashable, session: Session) -> Session:
        """Replaces the session (typically with a step's result) and returns it.

        Raises:
          SessionStateLostError: the id is unknown, dropped or preempted (use
            ``create`` to admit it again).
          BudgetExceededError: the session does not fit; the stored session
            stays as it was.
        """
        new = Entry.of(_checked_session(session, "put", session_id))
        events: list[ManagerEvent] = []
        try:
            with self._lock:
                old = self._wait_idle(session_id)
                removed, added = list(old.storages()), list(new.storages())
                self._make_room(
                    session_id,
                    f"putting session {session_id!r}",
                    new,
                    removed=removed,
                    added=added,
                    events=events,
                )
                self._ledger.apply(old.storages(), new.storages())
                self._store(session_id, new.carrying(old))
                self._recency.move_to_end(session_id)
                return session
        finally:
            self._emit(events)

    def drop(self, session_id: Hashable) -> bool:
        """Releases the session, pinned or not; True if it was held (dropping twice is fine: False).

        Later lookups raise SessionStateLostError saying it was dropped.
        """
        with self._lock:
            try:
                entry = self._wait_idle(session_id)
            except SessionStateLostError:
                return False
            self._forget(session_id)
            self._ledger.apply(entry.storages(), ())
            self._remember_loss(session_id, "it was dropped with drop()")
            return True

    def register_rebuild(
        self, name: str, fn: Callable[[Session], StateObject], *, cost: float | None = None
    ) -> None:
        """Lets the manager drop objects called ``name`` and rebuild them on the next lookup.

        Only objects that declare a ``recompute_source`` are ever dropped.

        Args:
          name: the object name, in every session.
          fn: ``fn(session) -> StateObject`` rebuilds the object from its
            (resident) sources; it must return an object of the same kind and
            spec (``describe()``), and is placed on the original's shardings.
            It runs under the manager's lock.
          cost: the rebuild's cost for the planner (cheapest per byte is
            dropped first); None uses the object's ``recompute_cost``.
        """
        if not callable(fn):
            raise TypeError(f"register_rebuild({name!r}, fn): fn must be callable; got {type(fn).__name__}.")
        if cost is not None and not cost >= 0:
            raise ValueError(f"register_rebuild({name!r}): cost must be >= 0 or None; got {cost!r}.")
        with self._lock:
            self._rebuilds[name] = Rebuild(fn, cost)
            self._rebuilds_version += 1

    # ------------------------------------------------------------ reports
    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes held by device key (parked bytes under ``"cpu:0/pinned_host"`` etc.), each buffer once."""
        with self._lock:
            return dict(self._ledger.totals)

    def stats(self) -> dict[str, Any]:
        """Counters and bytes.

        Returns:
          ``sessions``; ``hits`` and ``misses`` (lookups by get, update and
          pin: a miss found the id lost or had to bring objects back) and
          their sum ``lookups``; ``evictions`` (objects dropped to be
          rebuilt), ``preemptions`` (whole sessions released), ``parks``,
          ``restores`` (parked objects copied back), ``rebuilds``, ``refusals``;
          ``bytes`` by device key.
        """
        with self._lock:
            return {
                "sessions": len(self._entries),
                "lookups": self._hits + self._misses,
                "hits": self._hits,
                "misses": self._misses,
                **self._counts,
                "bytes": dict(self._ledger.totals),
            }

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
                    frozenset(entry.names("dropped")),
                    offload.is_donated(entry.session),
                )
                for session_id, entry in self._by_recency()
            }

    def config(self) -> dict[str, Any]:
        """The constructor's settings a checkpoint records (not the lock, callbacks or rebuilds)."""
        return {
            "max_sessions": self.max_sessions,
            "byte_budget": dict(self.byte_budget),
            "evict_when_full": self.evict_when_full,
            "park_memory_kind": self.park_memory_kind,
            "host_budget": self.host_budget,
        }

    def _load(self, sessions: Iterable[tuple[Hashable, Session, frozenset[str]]]) -> None:
        """Fills an empty manager from a checkpoint, least recently used first; counters start at 0.

        Objects named in each ``frozenset`` were dropped when saved: those with
        a registered rebuild are rebuilt before the session is admitted, the
        others stay non-resident.  Admission follows ``create``'s rules.  No
        other thread may use the manager meanwhile.  If a session cannot be
        admitted, every session loaded so far is dropped again and the error
        raised: nothing is half-restored.
        """
        with self._lock:
            if self._entries:
                raise ValueError(
                    f"restoring a manager checkpoint needs an empty manager; this one holds {len(self)} sessions."
                )
        loaded = []
        try:
            for session_id, session, dropped in sessions:
                objects = dict(session.objects)
                for name in sorted(dropped & self._rebuilds.keys()):
                    objects[name] = self._rebuild(session_id, name, session, None)
                self.create(session_id, session.replace(objects=objects))
                loaded.append(session_id)
        except Exception:
            for session_id in loaded:
                self.drop(session_id)
            with self._lock:
                self._lost.clear()
            raise
        with self._lock:
            self._hits = self._misses = 0
            self._counts = dict.fromkeys(_COUNTERS, 0)

    # --------------------------------------------------------- internals
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

    def _emit(self, events: list[ManagerEvent]) -> None:
        if self.on_event is not None:
            for event in events:
                self.on_event(event)

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
            f"sessions and {why}. Nothing changed; drop() a session, raise max_sessions, or allow eviction."
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
        session leaving at the same time.
        """
        change = self._ledger.delta(removed, added)
        for key, nbytes in (restored or {}).items():
            change[key] = change.get(key, 0) + nbytes
        over = {
            key: self._ledger.totals.get(key, 0) + change.get(key, 0) - budget
            for key, budget in self.byte_budget.items()
            if self._ledger.totals.get(key, 0) + change.get(key, 0) > budget
        }
        if not over:
            return
        reason = ", ".join(
            f"{key} over its budget of {self.byte_budget[key]} bytes by {n}" for key, n in over.items()
        )
        reason = f"{reason} while {action}"
        untouchable: set[Hashable] = set()
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
                    f"free it is still {result.message}. Nothing changed. Raise byte_budget, drop() or unpin "
                    "sessions, register rebuild functions, or allow parking and eviction."
                )
                events.append(
                    ManagerEvent("refusal", session_id, None, dict(result.shortfall_by_device), message)
                )
                raise BudgetExceededError(message)
            try:
                prepared = self._prepare(result)
            except _Donated as donated:
                untouchable |= donated.session_ids
                continue
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
        """The planner's view: every session, least recently used first, the proposal last."""
        usages = []
        for tick, (other_id, entry) in enumerate(self._by_recency()):
            if other_id != session_id and other_id != exclude:
                pinned = bool(entry.pins) or entry.busy is not None or other_id in untouchable
                usages.append(entry.usage(other_id, tick, pinned, self._rebuilds, self._rebuilds_version))
        usages.extend(self._pool_usages())  # pools holding checked-out sessions: counted, never acted on
        last = len(self._entries)
        if restoring:
            usages.append(proposal.restored_usage(session_id, last, self._rebuilds))
        else:
            usages.append(proposal.usage(session_id, last, True, self._rebuilds, self._rebuilds_version))
        return usages

    def _prepare(self, result: Plan) -> list[tuple[Action, tuple[StateObject, ObjectRecord] | None]]:
        """Each action's new object (evicted or parked), computed before anything changes.

        Raises:
          _Donated: naming every acted-on session whose arrays were donated.
        """
        donated = set()
        prepared = []
        for action in result.actions:
            entry = self._entries[action.session_id]
            if offload.is_donated(entry.session):  # a step in progress holds it: untouchable till its put
                donated.add(action.session_id)
            elif isinstance(action, PreemptSession):
                prepared.append((action, None))
            elif isinstance(action, DropObject):
                obj = entry.session[action.name]
                record = entry.records[action.name].dropped(offload.Placement.of(obj))
                prepared.append((action, (obj.evict()[0], record)))
            else:
                obj = entry.session[action.name]
                record = entry.records[action.name].parked_as(offload.park(obj, self.park_memory_kind))
                prepared.append((action, (obj.reset(), record)))
        if donated:
            raise _Donated(donated)
        return prepared

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
            obj, record = change
            new = entry.with_object(action.name, obj, record)
            self._ledger.apply(entry.records[action.name].storages, record.storages)
            self._store(session_id, new)
            if isinstance(action, DropObject):
                self._counts["evictions"] += 1
                events.append(ManagerEvent("drop", session_id, action.name, dict(action.freed), reason))
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
        """Brings the session's parked and dropped objects back (making room first); the new entry."""
        parked, dropped = entry.names("parked"), entry.names("dropped")
        released = [storage for name in parked for storage in entry.records[name].storages]
        restored: dict[str, int] = {}
        for name in parked + dropped:
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
        for name in dropped:
            objects[name] = self._rebuild(session_id, name, session, entry.records[name].placement)
        new = Entry.of(entry.session.replace(objects=objects)).carrying(entry)
        self._ledger.apply(entry.storages(), new.storages())
        self._store(session_id, new)
        reason = f"session {session_id!r} looked up"
        for name in parked:
            self._counts["restores"] += 1
            events.append(ManagerEvent("restore", session_id, name, new.records[name].home_bytes, reason))
        for name in dropped:
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
                f"session is unchanged ({name!r} is still dropped); fix the function given to "
                f"register_rebuild({name!r})."
            ) from error
        if not isinstance(rebuilt, StateObject):
            got = type(rebuilt).__name__
        elif not rebuilt.resident:
            got = f"{rebuilt.describe()} (not resident)"
        else:
            got = rebuilt.describe()
        if got != original.describe():
            raise ValueError(
                f"{where}: the rebuild function must return a resident {original.describe()}; it returned "
                f"{got}. The session is unchanged; fix the function given to register_rebuild({name!r})."
            )
        rebuilt = rebuilt.replace(
            recompute_source=original.recompute_source, recompute_cost=original.recompute_cost
        )
        return rebuilt if placement is None else placement.apply(rebuilt)


def _checked_session(session: Any, operation: str, session_id: Hashable) -> Session:
    if not isinstance(session, Session):
        raise TypeError(
            f"{operation}({session_id!r}, session): expected a jss.Session; got {type(session).__name__}."
        )
    if offload.is_donated(session):
        raise ValueError(
            f"{operation}({session_id!r}, session): some of its arrays were deleted (donated to a jitted "
            "step). Pass the step's output instead. Nothing changed."
        )
    return session
