"""Managers of several JAX processes agreeing on what they do to a session that spans them.

With one :class:`~jax_session_state.SessionStateManager` per process (SPMD),
a session whose arrays are not fully addressable lives on several processes
at once, and evicting, demoting, parking, restoring or preempting it is
collective: if one process's planner decides otherwise than another's (a
different budget, a different local session in the way), the processes would
split its state silently or hang in the next collective.  So every
operation that makes room for such a session -- a create, put, restore,
checkout or checkin of it -- is one *spanning decision*: it gets the next
sequence number of this manager, every process publishes a fingerprint of
its decision (the operation, what it restores, whether it refuses, and the
planner's actions on spanning sessions) under
``jss/agree/<manager>/<seq>/<process>`` in the distributed runtime's
key-value store, and reads every other process's with a timeout.  A
different fingerprint, or none within ``agreement_timeout`` seconds, raises
:class:`~jax_session_state.errors.ProcessDisagreementError` before anything
is applied.  Actions on sessions local to this process are left out: they
may differ between processes.

Sessions fully on this process's devices never pay for this (no exchange),
and an operation on one of them never acts on a spanning session (those are
left to their own spanning decisions).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import jax

from jax_session_state._core._coordination import KeyValueStore, store
from jax_session_state.errors import ProcessDisagreementError

__all__ = ["DEFAULT_TIMEOUT_S", "ProcessAgreement", "agree_on"]

DEFAULT_TIMEOUT_S = 60.0
"""How long a process waits for the others' fingerprint of one spanning decision, by default."""

_MANAGERS = itertools.count()


def _spans(tree: Any) -> bool:
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree_util.tree_leaves(tree))


class ProcessAgreement:
    """One manager's spanning decisions: which sessions span processes, and the exchange of fingerprints.

    Managers are numbered in the order a process creates them, so every
    process must create its managers in the same order (as SPMD code does).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.manager = next(_MANAGERS)
        self._seq = 0
        self._spanning: dict[Hashable, bool] = {}

    def spans(self, session_id: Hashable, entry: Any) -> bool:
        """Whether the session's arrays span processes (remembered while its objects are parked or evicted)."""
        if jax.process_count() == 1:
            return False
        found = _spans(entry.session) or any(_spans(r.parked.obj) for r in entry.records.values() if r.parked)
        if found:
            self._spanning[session_id] = True
        return found or self._spanning.get(session_id, False)

    def spanning_ids(self, entries: Mapping[Hashable, Any]) -> set[Hashable]:
        """The held sessions that span processes (none with one process)."""
        if jax.process_count() == 1:
            return set()
        return {sid for sid, entry in entries.items() if self.spans(sid, entry)}

    def agree(
        self,
        session_id: Hashable,
        operation: str,
        *,
        restoring: Iterable[str] = (),
        victim: Hashable | None = None,
        actions: Iterable[Any] = (),
        refused: bool = False,
    ) -> None:
        """Exchanges this decision's fingerprint with every other process; raises unless all are equal.

        Args:
          session_id: the spanning session the operation serves.
          operation: what is being done ("putting session 'a'").
          restoring: the names of the objects a restore brings back.
          victim: a spanning session preempted at the count cap, if any.
          actions: the planner's actions on spanning sessions.
          refused: whether this process refuses the operation.

        Raises:
          ProcessDisagreementError: another process decided otherwise, or did
            not publish its decision within the timeout.
        """
        kv = store()
        if kv is None:
            return
        described = [f"{type(a).__name__}({a.session_id!r}, {getattr(a, 'name', None)!r})" for a in actions]
        decision = (
            f"{operation}: restore {sorted(restoring)}, preempt {victim!r}, "
            f"actions [{', '.join(described)}], {'refused' if refused else 'proceeds'}"
        )
        fingerprint = hashlib.sha256(decision.encode()).hexdigest()[:16]
        seq, self._seq = self._seq, self._seq + 1
        me, prefix = jax.process_index(), f"jss/agree/{self.manager}/{seq}"
        kv.set(f"{prefix}/{me}", f"{fingerprint} {decision}")
        try:
            self._compare(kv, prefix, me, session_id, operation, fingerprint, decision)
        finally:
            if seq:  # every process has published seq, so each read our seq - 1 already
                kv.delete(f"jss/agree/{self.manager}/{seq - 1}/{me}")

    def _compare(
        self,
        kv: KeyValueStore,
        prefix: str,
        me: int,
        session_id: Hashable,
        operation: str,
        fingerprint: str,
        decision: str,
    ) -> None:
        for other in range(jax.process_count()):
            if other == me:
                continue
            value = kv.wait(f"{prefix}/{other}", self.timeout_s)
            where = f"manager {self.manager}, spanning decision {prefix.rsplit('/', 1)[1]}, session {session_id!r}"
            if value is None:
                raise ProcessDisagreementError(
                    f"{where}: process {other} did not publish its decision for {operation} within "
                    f"{self.timeout_s:g} s (agreement_timeout); this process (process {me}) decided: "
                    f"{decision}. Every process must make the same calls on a session that spans "
                    "processes, in the same order; nothing was changed here."
                )
            theirs, _, their_decision = value.partition(" ")
            if theirs != fingerprint:
                raise ProcessDisagreementError(
                    f"{where}: the processes' managers disagree. Process {me} decided: {decision}; process "
                    f"{other} decided: {their_decision}. A session spanning processes needs the same "
                    "calls, budgets and sessions in the way on every process; nothing was changed here."
                )


def agree_on(
    agreement: ProcessAgreement,
    entries: Mapping[Hashable, Any],
    session_id: Hashable,
    operation: str,
    proposal: Any,
    *,
    restoring: bool,
    victim: Hashable | None,
    actions: Iterable[Any] = (),
    refused: bool = False,
) -> None:
    """:meth:`ProcessAgreement.agree` on a room-making decision of the manager, from its table.

    Only actions on spanning sessions, and a spanning count-cap victim, enter
    the fingerprint; ``restoring`` adds the names of ``proposal``'s parked and
    evicted objects.
    """
    spanning = [a for a in actions if a.session_id in entries and agreement.spans(a.session_id, entries[a.session_id])]
    if victim is not None and not agreement.spans(victim, entries[victim]):
        victim = None
    names = [*proposal.names("parked"), *proposal.names("evicted")] if restoring else []
    agreement.agree(session_id, operation, restoring=names, victim=victim, actions=spanning, refused=refused)
