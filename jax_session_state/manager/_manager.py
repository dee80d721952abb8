"""``SessionStateManager``: many sessions under per-device byte budgets, on the host.

The protocol: ``create`` a session, then for every step ``get`` it, run the
jitted (donating) step, and ``put`` the result back — or let ``update(sid, fn)``
do all three atomically.  When a create, a put, a lookup that brings
objects back, a checkout or a checkin would exceed a byte budget, the
manager frees bytes from other sessions (never a pinned one, one inside
``update`` or between a donating ``get`` and its ``put``, nor the one being
served) in this order (see :func:`jax_session_state.manager.planner.plan`):

1. it evicts objects it can rebuild (a rebuild is registered with
   :meth:`SessionStateManager.register_rebuild` and the object declares a
   ``recompute_source``), least recently used sessions first, cheapest
   rebuild per byte first;
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
an action that fails on the way (a demotion or a rebuild that raises)
leaves every session as it was.  A later ``get`` rebuilds
evicted objects and copies parked ones back before returning the session
(demoted ones stay demoted).  Nothing is lost silently: every action is
reported through ``on_event`` and a preempted session raises
:class:`~jax_session_state.errors.SessionStateLostError`.
``checkout`` / ``checkin`` lend a session to a slot of a
:class:`~jax_session_state.SessionPool` and take it back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Literal

from jax_session_state.base import StateObject
from jax_session_state.errors import BudgetExceededError, SessionStateLostError
from jax_session_state.manager._arguments import checked_session, manager_settings, rebuild_arguments
from jax_session_state.manager._checkout import PoolCheckouts
from jax_session_state.manager._core import ManagerCore
from jax_session_state.manager._events import ManagerEvent
from jax_session_state.manager._snapshot import (
    Held,
    ManagerSnapshot,
    ManagerSnapshots,
    SnapshotSession,
)
from jax_session_state.manager._table import Entry, Rebuild
from jax_session_state.session import Session

__all__ = ["Held", "ManagerEvent", "ManagerSnapshot", "SessionStateManager", "SnapshotSession"]



class SessionStateManager(PoolCheckouts, ManagerSnapshots):
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
        :class:`threading.Condition` accepts: ``threading.RLock`` (a rebuild
        function, which runs under the lock, may then call the manager) or
        ``threading.Lock``.
      on_event: called with a :class:`ManagerEvent` for every action and
        refusal (``kind`` ``"evict"``, ``"demote"``, ``"park"``,
        ``"restore"``, ``"rebuild"``, ``"preempt"`` or ``"refusal"``), after
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
        ManagerCore.__init__(self, lock=lock_factory(), **settings)
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

    def register_rebuild(
        self, name: str, fn: Callable[[Session], StateObject], *, cost: float | None = None
    ) -> None:
        """Lets the manager evict objects called ``name`` and rebuild them on the next lookup.

        Only objects that declare a ``recompute_source`` are ever evicted.

        Args:
          name: the object name, in every session.
          fn: ``fn(session) -> StateObject`` rebuilds the object from its
            (resident) sources; it must return an object of the same kind and
            spec (``describe()``), and is placed on the original's shardings.
            It runs under the manager's lock.
          cost: the rebuild's cost for the planner (cheapest per byte is
            evicted first); None uses the object's ``recompute_cost``.

        Raises:
          PayloadTypeError: ``name`` is not a str, ``fn`` not callable, or
            ``cost`` neither a number nor None.
          PayloadError: ``name`` is empty, or ``cost`` below 0 (or NaN).

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> def make():  # "cond" (2049 bytes) can be rebuilt from "prompt" (33 bytes)
          ...     cond = jss.FixedState.allocate(shapes=(1, 256), recompute_source=("prompt",))
          ...     return jss.Session(objects={"prompt": jss.FixedState.allocate(shapes=(1, 4)), "cond": cond})
          >>> events = []
          >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 2200}, on_event=events.append)
          >>> manager.register_rebuild("cond", lambda s: s["cond"].empty().commit(jnp.tile(s["prompt"].view(), 64)))
          >>> manager.create("a", make())
          >>> manager.create("b", make())  # "a"'s cond is evicted
          >>> session = manager.get("a")  # rebuilt; "b"'s is evicted to make room
          >>> [(e.kind, e.session_id, e.object_name) for e in events]
          [('evict', 'a', 'cond'), ('evict', 'b', 'cond'), ('rebuild', 'a', 'cond')]
        """
        rebuild_arguments(name, fn, cost)
        with self._lock:
            self._rebuilds[name] = Rebuild(fn, cost)
            self._rebuilds_version += 1
