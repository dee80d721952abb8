"""Lending a manager's sessions to pool slots: ``checkout`` and ``checkin``.

A session lives in exactly one place: held by the manager (resident, parked
or partly evicted) or checked out into a slot of a :class:`SessionPool`.
``checkout`` brings back what was evicted or parked, writes the session into
the slot and lets go of the manager's copy; ``checkin`` reads the slot back,
admits the session again (making room like ``create``) and empties the slot.
While a session is checked out the planner cannot see it (it is in no
entry), every lookup of it raises :class:`SessionCheckedOutError`, and the
budgets count the bytes of every pool holding a checked-out session: a
pool's bytes enter the books with its first checkout and leave with its last
checkin.  Every refusal (no room, a live slot, a session of another
structure) changes nothing.

The manager identifies a pool by its ``tag``, which every pool stepped from
it carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import jax

from jax_session_state.accounting import Storage, tree_storages
from jax_session_state.errors import PayloadError, PayloadTypeError, SessionCheckedOutError
from jax_session_state.manager._table import Entry, distinct_bytes
from jax_session_state.manager.planner import SessionUsage
from jax_session_state.pool import SessionPool
from jax_session_state.session import Session

if TYPE_CHECKING:
    from jax_session_state.manager._events import ManagerEvent

__all__ = ["PoolCheckouts"]

_insert = jax.jit(SessionPool.insert, donate_argnums=0)
_extract = jax.jit(SessionPool.extract)
_release = jax.jit(SessionPool.release, donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class CheckedOut:
    """Where a checked-out session is: the pool's tag and the slot."""

    tag: int
    slot: int


class PoolCheckouts:
    """``checkout`` / ``checkin`` for :class:`~jax_session_state.SessionStateManager` (a mixin).

    Uses the manager's lock, table, ledger and planner; keeps which session
    is in which slot, and each lending pool's storages as last seen.
    """

    def _init_checkouts(self) -> None:
        self._checked_out: dict[Hashable, CheckedOut] = {}
        self._pool_storages: dict[int, list[Storage]] = {}

    def _lost_error(self, session_id: Hashable) -> Exception:
        if session_id in self._checked_out:
            return self._checked_out_error(session_id)
        return super()._lost_error(session_id)

    def _admit(self, session_id: Hashable, new: Entry, events: list[ManagerEvent]) -> None:
        if session_id in self._checked_out:
            raise self._checked_out_error(session_id)
        super()._admit(session_id, new, events)

    def _usages(self, *args: Any, **kwargs: Any) -> list[SessionUsage]:
        # Pools holding checked-out sessions: counted against the budgets, never acted on.
        return [*super()._usages(*args, **kwargs), *self._pool_usages()]

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
            range, or the session's structure differs from the pool's.
          In every case nothing changed (restored objects stay restored).
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
