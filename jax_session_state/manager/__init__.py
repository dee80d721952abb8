"""Many sessions on the host: the ``SessionStateManager``, its planner and what it parks.

Owns the manager (``_manager``: the public class, one class: its lookups
and writes, lending to pools, snapshots and reports, and the operations run
under its lock; ``_arguments``: the checks of what callers pass it;
``_prepare``: the new objects of its actions, all computed before any is
applied; ``_table``: byte figures per session and object; ``_events``: what
it reports; ``_snapshot``: the records it reports and exports;
``_agreement``: the decisions on sessions spanning several JAX processes,
agreed through the distributed runtime's key-value store), the planner it
calls (:mod:`.planner`, with ``_plan_records`` and ``_plan_search``: a pure
function of byte figures and the recompute graph, no lock, no clock) and
:mod:`.parking` (objects parked in a host memory kind and restored).

May import: ``errors``, ``accounting``, ``_core``, ``base``, ``building_blocks``,
``session`` and ``pool``. Only ``checkpoint`` and ``reports`` import it.
"""

from jax_session_state.manager._manager import (
    Held,
    ManagerEvent,
    ManagerSnapshot,
    SessionStateManager,
    SnapshotSession,
)

__all__ = ["Held", "ManagerEvent", "ManagerSnapshot", "SessionStateManager", "SnapshotSession"]
