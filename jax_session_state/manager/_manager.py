"""``SessionStateManager``: many sessions under per-device byte budgets, on the host.

The protocol: ``create`` a session, then for every step ``get`` it, run the
jitted (donating) step, and ``put`` the result back — or let ``update(sid, fn)``
do all three atomically.  When a create, a put, a lookup that brings
objects back, a checkout or a checkin would exceed a byte budget, the
manager frees bytes from other sessions (never a pinned one, one inside
``update`` or between a donating ``get`` and its ``put``, nor the one being
served) in this order (see :func:`jax_session_state.manager.planner.plan`):

1. it evicts objects it can recompute (a recompute function is registered with
   :meth:`SessionStateManager.register_recompute` and the object declares a
   ``recompute_source``), least recently used sessions first, cheapest
   recompute per byte first;
2. it demotes objects that declare a lower tier (a ``KVCache`` or
   ``PagedKVCache`` allocated with ``tiers=("int8",)``, a ``LatentBuffer``
   with ``demote_fn``), least recently used sessions first, most bytes saved
   first; a demotion is lossy and not undone;
3. it parks objects to host memory (unless ``park_memory_kind`` is None;
   ``host_budget`` bounds how much), least recently used sessions first,
   larger objects first;
4. when these rules fall short, an exact search over evictions, demotions
   and parks looks for a plan that fits before anything is preempted;
5. then, if ``evict_when_full``, it preempts least recently used sessions.

A buffer several objects hold (in one session or several) counts once, and
an object holding one is neither demoted nor parked: either would copy the
buffer and free nothing.  If nothing fits it refuses and changes nothing;
an action that fails on the way (a demotion or a recompute that raises)
leaves every session as it was.  A later ``get`` recomputes
evicted objects and copies parked ones back before returning the session
(demoted ones stay demoted).  Nothing is lost silently: every action is
reported through ``on_event`` and a preempted session raises
:class:`~jax_session_state.errors.SessionStateLostError`.
``checkout`` / ``checkin`` lend a session to a slot of a
:class:`~jax_session_state.SessionPool` and take it back.

The class is written in four parts: the public lookups and writes, lending
to pools (``checkout`` / ``checkin``: a session lives in exactly one place,
held here or in a pool slot; while it is out every lookup raises
:class:`~jax_session_state.errors.SessionCheckedOutError`, the planner cannot
see it and the budgets count the bytes of every pool holding one), snapshots
and reports, and the operations that run under the lock.

The state:

- ``_entries``: session id -> :class:`~jax_session_state.manager._table.Entry`
  (the session, per-object records, pins, the update() hold);
- ``_recency``: ids least recently used first; the value is the session
  while a lookup may hand it out at once, else None;
- ``_lost``: why recently lost ids were lost (for their lookup errors);
- ``_ledger``: reference counts of every buffer held, and byte totals;
- ``_recomputes``: registered recompute functions by object name, with a
  version the planner's cached figures are keyed by;
- ``_hits``, ``_misses``, ``_counts``: what ``stats()`` reports.

Making room (``_plan_room``) asks the pure planner for a
plan over every session's cached figures and prepares each action's new
object (:mod:`~jax_session_state.manager._prepare`) before anything changes;
a restore also copies back and recomputes its objects then; only then are the
actions applied (``_apply``): a refusal or an error leaves
every session as it was.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, Literal, Self

import jax

from jax_session_state._core._placement import is_donated
from jax_session_state.accounting import Storage, tree_storages
from jax_session_state.base import StateObject
from jax_session_state.errors import (
    BudgetExceededError,
    DonatedError,
    PayloadError,
    PayloadTypeError,
    SessionAdmissionError,
    SessionCheckedOutError,
    SessionStateLostError,
)
from jax_session_state.manager._agreement import ProcessAgreement, agree_on
from jax_session_state.manager._arguments import checked_session, manager_settings, recompute_arguments
from jax_session_state.manager._events import ManagerEvent, deliver
from jax_session_state.manager._prepare import Prepared, Room, prepared, recomputed, release_replaced, restored_session
from jax_session_state.manager._snapshot import Held, ManagerSnapshot, SnapshotSession
from jax_session_state.manager._table import Entry, Ledger, Recompute, distinct_bytes, split_shared
from jax_session_state.manager.planner import DemoteObject, EvictObject, Plan, SessionUsage, plan
from jax_session_state.pool import SessionPool
from jax_session_state.session import Session

__all__ = ["Held", "ManagerEvent", "ManagerSnapshot", "SessionStateManager", "SnapshotSession"]


LOST_REASONS_KEPT = 4096
"""How many lost (released or preempted) session ids keep their reason for later lookups."""

COUNTERS = ("evictions", "demotions", "preemptions", "parks", "restores", "recomputes", "refusals")
"""The action counters ``stats()`` reports."""


class _Donated(Exception):
    """Sessions a plan would act on whose arrays a step in progress has donated."""

    def __init__(self, session_ids: set[Hashable]):
        super().__init__(session_ids)
        self.session_ids = session_ids


_insert = jax.jit(SessionPool.insert, donate_argnums=0)
_extract = jax.jit(SessionPool.extract)
_release = jax.jit(SessionPool.release, donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class CheckedOut:
    """Where a checked-out session is: the pool's tag and the slot."""

    tag: int
    slot: int


class SessionStateManager:
    """Sessions by id on the host, under a count cap and per-device byte budgets; thread-safe.

    Use ``get`` / ``put``: ``get`` hands out the stored session itself, so a
    step that donates it deletes the stored copy's arrays; ``put`` the step's
    result back before anything else needs that session.  Between the two the
    manager leaves that session alone (it never evicts, parks or preempts a
    session whose arrays were donated).  ``update(sid, fn)`` does get, fn, put
    atomically for that id and is safe by construction.

    Args:
      max_sessions: the most sessions held at once.
      byte_budget: the most bytes held per device key (``{"cuda:0": 40 << 30}``);
        keys not named are unlimited; None: no byte budget.
      evict_when_full: whether the manager may release whole least recently
        used sessions (at the count cap, or when evicting and parking objects
        is not enough); if not, it refuses with
        :class:`~jax_session_state.errors.SessionAdmissionError` /
        :class:`~jax_session_state.errors.BudgetExceededError`.
      park_memory_kind: the host memory kind objects are parked to
        (``"pinned_host"``), or None to never park.
      host_budget: the most bytes held in ``park_memory_kind`` memory, all
        devices together: parks stop there; None: unlimited.
      lock_factory: makes the manager's lock, anything
        :class:`threading.Condition` accepts: ``threading.RLock`` (a recompute
        function, which runs under the lock, may then call the manager) or
        ``threading.Lock``.
      on_event: called with a :class:`ManagerEvent` for every action and
        refusal (``kind`` ``"evict"``, ``"demote"``, ``"park"``,
        ``"restore"``, ``"recompute"``, ``"preempt"`` or ``"refusal"``), after
        the manager's lock is released and the operation is done.  Every
        event of an operation reaches it even if it raises; its errors are
        raised to the caller of that completed operation after the last
        event (one error as itself, several as an ``ExceptionGroup``), or,
        when the operation itself failed, logged and noted on the
        operation's error.
      agreement_timeout: seconds a decision on a session spanning processes
        waits for theirs (:class:`~jax_session_state.errors.ProcessDisagreementError`).

    Raises:
      PayloadTypeError: ``max_sessions``, a ``byte_budget`` value or
        ``host_budget`` is not an int, a ``byte_budget`` key not a str,
        ``evict_when_full`` not a bool, or ``on_event`` neither callable nor
        None.
      PayloadError: ``max_sessions`` is below 1, a budget below 0,
        ``park_memory_kind`` neither ``"pinned_host"`` nor None, or
        ``agreement_timeout`` below 0 or not finite.

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
        agreement_timeout: float = 60.0,
    ):
        settings = manager_settings(
            max_sessions=max_sessions,
            byte_budget=byte_budget,
            evict_when_full=evict_when_full,
            park_memory_kind=park_memory_kind,
            host_budget=host_budget,
            on_event=on_event,
            agreement_timeout=agreement_timeout,
        )
        self.max_sessions: int = settings["max_sessions"]
        self.byte_budget: dict[str, int] = settings["byte_budget"]
        self.evict_when_full: bool = settings["evict_when_full"]
        self.park_memory_kind: str | None = settings["park_memory_kind"]
        self.host_budget: int | None = settings["host_budget"]
        self.on_event: Callable[[ManagerEvent], None] | None = settings["on_event"]
        self._agreement = ProcessAgreement(settings["agreement_timeout"])  # decisions on sessions spanning processes
        self._lock = lock_factory()
        self._idle = threading.Condition(self._lock)  # signalled when an update() ends
        self._entries: dict[Hashable, Entry] = {}
        # Recency, least recently used first; the value is the session while a lookup may hand it out
        # at once (whole, not in an update), else None: a hit reads nothing else.
        self._recency: collections.OrderedDict[Hashable, Session | None] = collections.OrderedDict()
        self._lost: collections.OrderedDict[Hashable, str] = collections.OrderedDict()
        self._ledger = Ledger()
        self._recomputes: dict[str, Recompute] = {}
        self._recomputes_version = 0
        self._table_version = 0  # counts changes of _entries (a recompute function may make some)
        self._hits = self._misses = 0
        self._counts = dict.fromkeys(COUNTERS, 0)
        # More reports for stats(), by name (a reuse.SharedStore adds "shared"); called outside the lock.
        self._stat_reports: dict[str, Callable[[], Any]] = {}
        # Sessions lent to pool slots, and each lending pool's storages as last seen.
        self._checked_out: dict[Hashable, CheckedOut] = {}
        self._pool_storages: dict[int, list[Storage]] = {}

    # ------------------------------------------------------------ mapping
    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return True

    # ------------------------------------------------------------ lookups
    def get(self, session_id: Hashable) -> Session:
        """The session, with anything evicted or parked brought back first.

        The session returned is the one stored: donating it to a jitted step
        deletes the stored copy's arrays, so ``put`` the step's result back.
        Demoting an object deletes the arrays it replaces (so their memory
        is freed), so a handle kept while other sessions are put may find
        its arrays deleted ("Array has been deleted"); ``get`` it again.

        Args:
          session_id: the id the session was created under.

        Returns:
          The stored session, its evicted and parked objects brought back.

        Raises:
          SessionStateLostError: the id is unknown, released or preempted
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
        events: list[ManagerEvent] = []
        with self._delivering(events):
            return self._lookup(session_id, events)[0]

    def update(self, session_id: Hashable, fn: Callable[[Session], Session]) -> Session:
        """Gets the session, applies ``fn`` and puts the result back, atomically for this id.

        While ``fn`` runs (outside the manager's lock) other lookups, puts and
        releases of this id wait, and the manager does not touch the session, so
        ``fn`` may donate it.

        Args:
          session_id: the id the session was created under.
          fn: ``fn(session) -> Session``, typically a jitted step that
            donates its argument; it must not call ``update`` for the same id.

        Returns:
          The new session, as stored.

        Raises:
          SessionStateLostError: the id is unknown, released or preempted.
          BudgetExceededError: the result does not fit; it is attached to the
            error as ``session`` and the stored session is the one ``fn`` got
            (dead if ``fn`` donated it: ``put`` the result once there is room).

        If ``fn`` raises, the stored session is the one ``fn`` got (dead if
        ``fn`` donated it before raising: ``put`` a state back).

        Example:
          >>> import jax
          >>> import jax_session_state as jss
          >>> manager = jss.SessionStateManager()
          >>> manager.create("a", jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))}))
          >>> step = jax.jit(lambda s: s.commit(carry=s.view()["carry"] + 1), donate_argnums=0)
          >>> for _ in range(3):
          ...     session = manager.update("a", step)
          >>> manager.get("a").view()["carry"]
          Array([3., 3.], dtype=float32)
        """
        me = threading.get_ident()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None and entry.busy == me:
                raise RuntimeError(f"update({session_id!r}) called inside update({session_id!r})'s own fn.")
        events: list[ManagerEvent] = []
        try:
            with self._delivering(events):  # a listener that raises leaves no hold behind (finally)
                session, _ = self._lookup(session_id, events, hold=True)
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
        """Keeps the session whole while the block runs: nothing is evicted, parked or preempted.

        Yields the session (brought back first, like ``get``).  Pins nest;
        ``put`` inside the block keeps the pin; ``release`` ends it.

        Args:
          session_id: the id the session was created under.

        Raises:
          SessionStateLostError: the id is unknown, released or preempted.
          BudgetExceededError: bringing its objects back does not fit.

        Example:
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(1, 4))})  # 33 bytes
          >>> events = []
          >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 70}, on_event=events.append)
          >>> manager.create("a", make())
          >>> manager.create("b", make())
          >>> with manager.pin("a"):
          ...     _ = manager.get("b")  # "a" is now the least recently used, but pinned
          ...     manager.create("c", make())
          >>> [(e.kind, e.session_id) for e in events]
          [('park', 'b')]
        """
        events: list[ManagerEvent] = []
        entry = None
        try:
            with self._delivering(events):  # a listener that raises leaves no pin behind (finally)
                session, entry = self._lookup(session_id, events, pin=True)
            yield session
        finally:
            with self._lock:
                current = self._entries.get(session_id)
                if entry is not None and current is not None and current.origin is entry.origin:
                    current.pins -= 1  # (not when released and created again meanwhile)

    def _lookup(
        self, session_id: Hashable, events: list[ManagerEvent], *, hold: bool = False, pin: bool = False
    ) -> tuple[Session, Entry]:
        """The slow lookup: waits for an update in progress, restores what is missing, counts.

        ``hold`` marks the entry as in this thread's update(); ``pin`` adds a pin.
        """
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

    # -------------------------------------------------------------- writes
    def create(self, session_id: Hashable, session: Session) -> None:
        """Admits a new session.

        At the count cap the least recently used session that is not pinned
        or in use is preempted if ``evict_when_full``; over a byte budget room
        is made as described in the module docs.

        Args:
          session_id: any hashable id not held yet (a released or preempted
            id may be created again).
          session: the new session; the manager stores it as given.

        Raises:
          PayloadError: the id is held already (``put`` replaces a session).
          SessionAdmissionError: at the count cap and no session may be
            preempted; nothing changed.
          BudgetExceededError: the session does not fit; nothing changed.
        """
        new = Entry.of(checked_session(session, "create", session_id))
        events: list[ManagerEvent] = []
        with self._delivering(events), self._lock:  # events go out once the lock is released
            self._admit(session_id, new, events)

    def put(self, session_id: Hashable, session: Session) -> Session:
        """Replaces the session (typically with a step's result) and returns it.

        Args:
          session_id: the id of a session held (``create`` admits new ones).
          session: the session to store in its place, usually the result of
            a step on what ``get`` returned.

        Returns:
          ``session``, as stored.

        Raises:
          SessionStateLostError: the id is unknown, released or preempted (use
            ``create`` to admit it again).
          BudgetExceededError: the session does not fit; the stored session
            stays as it was.

        Example:
          >>> import jax
          >>> import jax_session_state as jss
          >>> manager, carry = jss.SessionStateManager(), jss.FixedState.allocate(shapes=(2,))
          >>> manager.create("a", jss.Session(objects={"carry": carry}))
          >>> step = jax.jit(lambda s: s.commit(carry=s.view()["carry"] + 1), donate_argnums=0)
          >>> session = manager.put("a", step(manager.get("a")))  # the stored copy was donated: put it back
          >>> manager.get("a").view()["carry"]
          Array([1., 1.], dtype=float32)
        """
        new = Entry.of(checked_session(session, "put", session_id))
        events: list[ManagerEvent] = []
        with self._delivering(events), self._lock:  # events go out once the lock is released
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

    def release(self, session_id: Hashable) -> bool:
        """Releases the session, pinned or not; True if it was held (releasing twice is fine: False).

        Later lookups raise SessionStateLostError saying it was released.

        Args:
          session_id: the id to release.

        Returns:
          Whether the manager held it.
        """
        with self._lock:
            try:
                entry = self._wait_idle(session_id)
            except SessionStateLostError:
                return False
            self._forget(session_id)
            self._ledger.apply(entry.storages(), ())
            self._remember_loss(session_id, "it was released with release()")
            return True

    def register_recompute(
        self, name: str, fn: Callable[[Session], StateObject], *, cost: float | None = None
    ) -> None:
        """Lets the manager evict objects called ``name`` and recompute them on the next lookup.

        Only objects that declare a ``recompute_source`` are ever evicted.

        Args:
          name: the object name, in every session.
          fn: ``fn(session) -> StateObject`` recomputes the object from its
            (resident) sources; it must return an object of the same kind and
            spec (``describe()``), and is placed on the original's shardings.
            It runs under the manager's lock.
          cost: the recompute's cost for the planner (cheapest per byte is
            evicted first); None uses the object's ``recompute_cost``.

        Raises:
          PayloadTypeError: ``name`` is not a str, ``fn`` not callable, or
            ``cost`` neither a number nor None.
          PayloadError: ``name`` is empty, or ``cost`` below 0 (or NaN).

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> def make():  # "cond" (2049 bytes) can be recomputed from "prompt" (33 bytes)
          ...     cond = jss.FixedState.allocate(shapes=(1, 256), recompute_source=("prompt",))
          ...     return jss.Session(objects={"prompt": jss.FixedState.allocate(shapes=(1, 4)), "cond": cond})
          >>> events = []
          >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 2200}, on_event=events.append)
          >>> manager.register_recompute("cond", lambda s: s["cond"].empty().commit(jnp.tile(s["prompt"].view(), 64)))
          >>> manager.create("a", make())
          >>> manager.create("b", make())  # "a"'s cond is evicted
          >>> session = manager.get("a")  # recomputed; "b"'s is evicted to make room
          >>> [(e.kind, e.session_id, e.object_name) for e in events]
          [('evict', 'a', 'cond'), ('evict', 'b', 'cond'), ('recompute', 'a', 'cond')]
        """
        recompute_arguments(name, fn, cost)
        with self._lock:
            self._recomputes[name] = Recompute(fn, cost)
            self._recomputes_version += 1

    # ------------------------------------------------------------ pools
    def checked_out(self) -> dict[Hashable, tuple[int, int]]:
        """Every checked-out session: ``session_id -> (pool tag, slot)``."""
        with self._lock:
            return {sid: (where.tag, where.slot) for sid, where in self._checked_out.items()}

    def checkout(self, session_id: Hashable, pool: SessionPool, slot: int) -> SessionPool:
        """Moves the session into ``pool``'s empty ``slot``; returns the new pool (``pool`` is donated).

        What was evicted or parked is brought back first, within budget.
        From now until :meth:`checkin` the manager does not hold the session:
        lookups raise :class:`SessionCheckedOutError` and the planner never
        touches it; the budgets count ``pool``'s bytes.

        Example:
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(1, 4))})
          >>> manager = jss.SessionStateManager()
          >>> manager.create("a", make())
          >>> pool = manager.checkout("a", jss.SessionPool.allocate(make(), slots=4), 2)
          >>> "a" in manager, manager.checked_out()["a"][1]
          (False, 2)
          >>> pool = manager.checkin("a", pool, 2)
          >>> "a" in manager, pool.active_slots()
          (True, [])

        Raises:
          SessionStateLostError: the id is unknown, released or preempted.
          SessionCheckedOutError: it is checked out already.
          BudgetExceededError: restoring it or counting the pool does not fit.
          ValueError / TypeError / IndexError: the slot is live or out of
            range, or the session's structure differs from the pool's;
            in every case nothing changed (restored objects stay restored).
        """
        _require_pool(pool, "checkout", session_id)
        events: list[ManagerEvent] = []
        with self._delivering(events), self._lock:  # events go out once the lock is released
            if session_id in self._checked_out:
                raise self._checked_out_error(session_id)
            entry = self._wait_idle(session_id)
            index, _ = pool._slot_index(slot, "checkout")
            if bool(pool.active[index]):
                raise PayloadError(
                    f"checkout({session_id!r}): slot {int(index)} of the pool holds a live session; "
                    f"pick an empty one (live: {pool.active_slots()})."
                )
            if entry.whole:
                self._hits += 1
            else:
                self._misses += 1
                entry = self._restore(session_id, entry, events)
            session = entry.session
            pool._require_like(session, "checkout")  # before anything is written
            tag = int(pool.tag)
            # A pool new to the books enters them with this checkout: the planner sees its bytes as the
            # proposal's; a pool already counted is one of the manager's pool usages.
            before = self._pool_storages.get(tag)
            lent = Session(objects={}, attrs={} if before is not None else {"pool": pool})
            self._make_room(
                session_id,
                f"checking out session {session_id!r} into a pool",
                Entry.of(lent),
                removed=[*entry.storages(), *(before or ())],
                added=tree_storages(pool),
                exclude=session_id,
                events=events,
            )
            # On the pool's device and committed there (no copy when it is there already), so the
            # insert compiles once whether the session was just created or brought back from host.
            new_pool = _insert(pool, index, jax.device_put(session, pool.active.sharding))
            self._forget(session_id)
            self._ledger.apply([*entry.storages(), *(before or ())], tree_storages(new_pool))
            self._pool_storages[tag] = tree_storages(new_pool)
            self._checked_out[session_id] = CheckedOut(tag, int(index))
            return new_pool

    def checkin(self, session_id: Hashable, pool: SessionPool, slot: int) -> SessionPool:
        """Moves the session in ``pool``'s ``slot`` back into the manager; returns the pool with the slot empty.

        ``pool`` is donated.  The session is admitted like ``create``: over a
        budget the planner frees bytes from other sessions, and at the count
        cap the least recently used one may be preempted.  When no other
        session is checked out into ``pool`` its bytes leave the books.

        Args:
          session_id: the id the session was checked out under.
          pool: the pool it was checked out into, or one stepped from it
            (same ``tag``).
          slot: the slot it was checked out into.

        Returns:
          The pool with ``slot`` empty (its other slots as they were).

        Example:
          >>> import jax_session_state as jss
          >>> make = lambda: jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(1, 4))})
          >>> manager = jss.SessionStateManager()
          >>> manager.create("a", make())
          >>> pool = manager.checkout("a", jss.SessionPool.allocate(make(), slots=2), 0)
          >>> pool, _ = pool.map(lambda s: (s.commit(carry=s.view()["carry"] + 1), None))  # a step in the pool
          >>> pool = manager.checkin("a", pool, 0)
          >>> manager.get("a").view()["carry"], pool.active_slots()
          (Array([[1., 1., 1., 1.]], dtype=float32), [])

        Raises:
          SessionStateLostError: the id is unknown to the manager.
          PayloadError: it is not checked out, or into another pool or slot.
          BudgetExceededError / SessionAdmissionError: it does not fit; it
            stays checked out and ``pool`` is unchanged.
        """
        _require_pool(pool, "checkin", session_id)
        events: list[ManagerEvent] = []
        with self._delivering(events), self._lock:  # events go out once the lock is released
            where = self._checked_out.get(session_id)
            if where is None:
                if session_id in self._entries:
                    raise PayloadError(f"checkin({session_id!r}): the manager holds it; it is not checked out.")
                raise self._lost_error(session_id)
            tag = int(pool.tag)
            slot = int(pool._slot_index(slot, "checkin")[0])
            if (where.tag, where.slot) != (tag, slot):
                raise PayloadError(
                    f"checkin({session_id!r}, pool, {slot!r}): it is checked out into slot {where.slot} of "
                    f"pool {where.tag}; this is {'slot ' + repr(slot) + ' of ' if where.tag == tag else ''}"
                    f"pool {tag}. Nothing changed."
                )
            if not bool(pool.active[slot]):
                raise PayloadError(
                    f"checkin({session_id!r}): slot {slot} of the pool is empty, so the session was released "
                    "from it outside the manager and is lost; checked out sessions leave only by checkin()."
                )
            session = _extract(pool, slot)
            new = Entry.of(session)
            others = [sid for sid, w in self._checked_out.items() if w.tag == tag and sid != session_id]
            pool_leaves = [] if others else self._pool_storages.get(tag, [])
            victim = None
            if len(self._entries) >= self.max_sessions:
                victim = self._count_cap_victim()
                if victim is None or not self.evict_when_full:
                    self._refuse_admission(session_id, events)
            removed = [*pool_leaves, *(self._entries[victim].storages() if victim is not None else ())]
            action = f"checking in session {session_id!r} from a pool"
            if not others:  # the pool leaves the books with this checkin
                self._pool_storages.pop(tag, None)
            try:
                self._make_room(
                    session_id, action, new, removed=removed, added=list(new.storages()), exclude=victim,
                    events=events,
                )
            except Exception:
                if not others:
                    self._pool_storages[tag] = pool_leaves
                raise
            if victim is not None:
                reason = f"preempted at the count cap (max_sessions={self.max_sessions}) while {action}"
                self._preempt(victim, reason, events)
            new_pool = _release(pool, slot)
            del self._checked_out[session_id]
            if others:
                self._ledger.apply(self._pool_storages[tag], tree_storages(new_pool))
                self._pool_storages[tag] = tree_storages(new_pool)
            else:
                self._ledger.apply(pool_leaves, ())
            self._ledger.apply((), new.storages())
            self._store(session_id, new)
            return new_pool

    # ------------------------------------------------------------ snapshots
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
        ``on_event`` and registered recompute functions are not part of it.

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
                if is_donated(entry.session):
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

        This manager's own settings, ``on_event`` and registered recompute functions
        apply: evicted objects with a registered recompute are recomputed before
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
                for name in sorted(held.evicted & self._recomputes.keys()):
                    objects[name] = recomputed(self._recomputes[name].fn, held.session_id, name, held.session, None)
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
          recomputed), ``demotions`` (objects replaced by their lower tier),
          ``preemptions`` (whole sessions released), ``parks``, ``restores``
          (parked objects copied back), ``recomputes``, ``refusals``;
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
           'preemptions': 0, 'parks': 0, 'restores': 0, 'recomputes': 0, 'refusals': 0, 'bytes': {'cpu:0': 33}}
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
                    is_donated(entry.session),
                    bool(entry.pins),
                )
                for session_id, entry in self._by_recency()
            }

    # ------------------------------------------------- under the lock
    # Every method below runs with the lock held (the public methods take it) and reports what it did
    # by appending a ManagerEvent to the ``events`` list it is given; _delivering hands them to
    # on_event once the lock is released.
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

    def _remember_loss(self, session_id: Hashable, reason: str) -> None:
        self._lost[session_id] = reason
        self._lost.move_to_end(session_id)
        while len(self._lost) > LOST_REASONS_KEPT:
            self._lost.popitem(last=False)

    def _count_cap_victim(self) -> Hashable | None:
        for session_id, entry in self._by_recency():
            if not entry.pins and entry.busy is None and not is_donated(entry.session):
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
        if session_id in self._checked_out:
            raise self._checked_out_error(session_id)
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
                    "sessions, register recompute functions, or allow parking and eviction."
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
        sessions hold count once, in a pinned session of their own (:func:`split_shared`); pools holding
        checked-out sessions are counted against the budgets and never acted on."""
        views = []
        for tick, (other_id, entry) in enumerate(self._by_recency()):
            if other_id != session_id and other_id != exclude:
                pinned = bool(entry.pins) or entry.busy is not None or other_id in untouchable
                views.append((entry, entry.usage(other_id, tick, pinned, self._recomputes, self._recomputes_version)))
        last = len(self._entries)
        if restoring:
            views.append((proposal, proposal.restored_usage(session_id, last, self._recomputes)))
        else:
            views.append((proposal, proposal.usage(session_id, last, True, self._recomputes, self._recomputes_version)))
        return [*split_shared(views), *self._pool_usages()]

    def _prepare(self, result: Plan) -> list[Prepared]:
        """Each action's new object (evicted, demoted or parked), computed before anything changes.

        Raises:
          _Donated: naming every acted-on session whose arrays were donated.
        """
        # A step in progress holds such a session: untouchable till its put.
        donated = {a.session_id for a in result.actions if is_donated(self._entries[a.session_id].session)}
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
        recomputed, and only then is the room made: a refusal or a failing recompute
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
        new = Entry.of(restored_session(session_id, entry, self._recomputes)).carrying(entry)
        self._apply(planned if self._table_version == version else room())  # a recompute function changed the table
        self._ledger.apply(entry.storages(), new.storages())
        self._store(session_id, new)
        reason = f"session {session_id!r} looked up"
        for name in parked:
            self._counts["restores"] += 1
            events.append(ManagerEvent("restore", session_id, name, new.records[name].home_bytes, reason))
        for name in evicted:
            self._counts["recomputes"] += 1
            events.append(ManagerEvent("recompute", session_id, name, new.records[name].home_bytes, reason))
        return new

    def _pool_usages(self) -> list[SessionUsage]:
        """The planner's figures of each lending pool: bytes it counts and may never free."""
        return [
            SessionUsage(("pool", tag), (), -1, True, distinct_bytes(storages))
            for tag, storages in self._pool_storages.items()
        ]

    def _checked_out_error(self, session_id: Hashable) -> SessionCheckedOutError:
        where = self._checked_out[session_id]
        return SessionCheckedOutError(
            f"session {session_id!r} is checked out into slot {where.slot} of pool {where.tag}; the manager "
            f"does not hold it. checkin({session_id!r}, pool, {where.slot}) first."
        )


def _require_pool(pool: Any, operation: str, session_id: Hashable) -> None:
    if not isinstance(pool, SessionPool):
        raise PayloadTypeError(
            f"{operation}({session_id!r}, pool, slot): expected a SessionPool; got {type(pool).__name__}."
        )
