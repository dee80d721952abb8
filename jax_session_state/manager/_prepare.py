"""The new objects of the manager's actions, computed before anything changes.

Making room and bringing a session back first compute every new object --
evicted, demoted, parked, copied back or recomputed -- from the objects as they
are, donating nothing; only once all of them exist does the manager swap
them in (:class:`~jax_session_state.SessionStateManager`).  A failure
on the way (a recompute function that raises, a device out of memory) then
leaves every session as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import NamedTuple

import jax

from jax_session_state._core._placement import Placement
from jax_session_state.accounting import storages
from jax_session_state.base import StateObject
from jax_session_state.errors import PayloadError
from jax_session_state.manager import parking
from jax_session_state.manager._events import ManagerEvent
from jax_session_state.manager._table import Entry, Ledger, ObjectRecord, Recompute
from jax_session_state.manager.planner import Action, DemoteObject, EvictObject, PreemptSession
from jax_session_state.session import Session

_demoted = jax.jit(lambda obj: obj.demote())
"""An object's next lower tier in new buffers, its own left alone (compiled once per spec): the peak is
the object plus its demoted copy, and :func:`release_replaced` frees the old storage once it is applied."""


class Prepared(NamedTuple):
    """A planned action, and the object it leaves with its record (None for a preemption)."""

    action: Action
    change: tuple[StateObject, ObjectRecord] | None


class Room(NamedTuple):
    """The prepared actions that make room for an operation, in order; why, and where their events go."""

    actions: list[Prepared]
    reason: str
    events: list[ManagerEvent]


def prepared(action: Action, entry: Entry, park_memory_kind: str | None) -> Prepared:
    """``action`` on ``entry``'s session, its new object computed (and finished: errors surface here)."""
    if isinstance(action, PreemptSession):
        return Prepared(action, None)
    obj, record = entry.session[action.name], entry.records[action.name]
    try:
        if isinstance(action, EvictObject):
            return Prepared(action, (obj.evict()[0], record.evicted(Placement.of(obj))))
        if isinstance(action, DemoteObject):
            demoted = jax.block_until_ready(_demoted(obj))
            return Prepared(action, (demoted, ObjectRecord.of(demoted)))
        return Prepared(action, (obj.reset(), record.parked_as(parking.park(obj, park_memory_kind))))
    except Exception as error:
        verb = {EvictObject: "evicting", DemoteObject: "demoting"}.get(type(action), "parking")
        error.add_note(
            f"The manager was {verb} {action.name!r} of session {action.session_id!r} to make room; no "
            "session changed."
        )
        raise


def release_replaced(old: StateObject, ledger: Ledger) -> None:
    """Frees the arrays of ``old``, an object just replaced by its demotion, that the manager no longer holds.

    What only the manager held is deleted, so its memory is free even while
    a handle from an earlier lookup still refers to it (as a donation would
    leave it); a buffer another held object or session reads stays.
    """
    for leaf in jax.tree_util.tree_leaves(old):
        if isinstance(leaf, jax.Array) and not any(storage in ledger.refs for storage in storages(leaf)):
            leaf.delete()


def restored_session(session_id: Hashable, entry: Entry, recomputes: Mapping[str, Recompute]) -> Session:
    """``entry``'s session with its parked objects copied back and its evicted ones recomputed.

    Raises:
      RuntimeError: a recompute function raised.
      PayloadError: a recompute function returned another kind or spec.
    """
    objects = dict(entry.session.objects)
    for name in entry.names("parked"):
        objects[name] = parking.restore(entry.records[name].parked)
    sources = entry.session.replace(objects=dict(objects))
    for name in entry.names("evicted"):
        objects[name] = recomputed(recomputes[name].fn, session_id, name, sources, entry.records[name].placement)
    return entry.session.replace(objects=objects)


def recomputed(
    fn: Callable[[Session], StateObject],
    session_id: Hashable,
    name: str,
    session: Session,
    placement: Placement | None,
) -> StateObject:
    """Object ``name`` of ``session`` recomputed by ``fn`` and put on ``placement`` (None: where ``fn`` put it).

    Raises:
      RuntimeError: ``fn`` raised.
      PayloadError: ``fn`` returned another kind or spec than the original.
    """
    original = session[name]
    where = f"recomputing {name!r} of session {session_id!r}"
    try:
        recomputed = fn(session)
    except Exception as error:
        raise RuntimeError(
            f"{where}: the registered recompute function raised {type(error).__name__}: {error}. The "
            f"session is unchanged ({name!r} is still evicted); fix the function given to "
            f"register_recompute({name!r})."
        ) from error
    if not isinstance(recomputed, StateObject):
        got = type(recomputed).__name__
    elif not recomputed.resident:
        got = f"{recomputed.describe()} (not resident)"
    else:
        got = recomputed.describe()
    if got != original.describe():
        raise PayloadError(
            f"{where}: the recompute function must return a resident {original.describe()}; it returned "
            f"{got}. The session is unchanged; fix the function given to register_recompute({name!r})."
        )
    recomputed = recomputed.replace(recompute_source=original.recompute_source, recompute_cost=original.recompute_cost)
    return recomputed if placement is None else placement.apply(recomputed)
