"""What a session manager shows of what it holds: :class:`Held` per session, and :class:`ManagerSnapshot`.

The records :meth:`~jax_session_state.SessionStateManager.held` reports and
:meth:`~jax_session_state.SessionStateManager.snapshot` exports (what
checkpoints save, and ``load()`` / ``from_snapshot()`` import).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

from jax_session_state.manager import parking
from jax_session_state.session import Session

__all__ = ["Held", "ManagerSnapshot", "SnapshotSession"]


@dataclasses.dataclass(frozen=True)
class Held:
    """How the manager holds one session now (see :meth:`SessionStateManager.held`).

    Attributes:
      session: the session; its parked and evicted objects are not resident here.
      parked: the parked objects by name (their arrays in host memory).
      evicted: names of the objects evicted, to be recomputed on the next lookup.
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
    parked: Mapping[str, parking.Parked]
    evicted: frozenset[str]
    donated: bool
    pinned: bool = False


class SnapshotSession(NamedTuple):
    """One session of a :class:`ManagerSnapshot`.

    Attributes:
      session_id: its id.
      session: the session; parked objects hold their arrays in host memory,
        evicted objects are non-resident.
      evicted: names of the objects the manager evicted (to be recomputed).
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
    parked: Mapping[str, parking.Parked] = types.MappingProxyType({})


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
