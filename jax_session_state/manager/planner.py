"""The byte-budget planner: from per-session byte figures to an ordered plan of actions.

A pure function over byte figures: no arrays, locks, clocks or I/O.  The
session manager hands it a snapshot of every session and either applies the
returned :class:`Plan` (evictions, demotions, parks, preemptions, in order) or raises
:class:`~jax_session_state.errors.BudgetExceededError` from the returned
:class:`Refusal`.  ``Action`` is any one of :class:`EvictObject`,
:class:`DemoteObject`, :class:`ParkObject` and :class:`PreemptSession`.

Example:
  >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
  >>> kv = ObjectUsage("kv", {"cuda:0": 600})
  >>> cond = ObjectUsage("cond", {"cuda:0": 300}, sources=("prompt",), recomputable=True)
  >>> prompt = ObjectUsage("prompt", {"cuda:0": 100})
  >>> result = plan([SessionUsage("s", (kv, cond, prompt), last_used=0)],
  ...               budgets={"cuda:0": 800}, park=True)
  >>> [(type(a).__name__, a.name) for a in result.actions]
  [('EvictObject', 'cond')]
  >>> dict(result.usage_after)
  {'cuda:0': 700}
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence

from jax_session_state.errors import PayloadError
from jax_session_state.manager import _plan_search
from jax_session_state.manager._plan_records import (
    Action,
    DemoteObject,
    EvictObject,
    ObjectUsage,
    ParkObject,
    Plan,
    PreemptSession,
    Refusal,
    SessionUsage,
    byte_counts,
)
from jax_session_state.manager._plan_search import (
    Projection,
    add_footprint,
    demotable,
    evictable,
    parkable,
    parking_destination,
)

__all__ = [
    "Action",
    "DemoteObject",
    "EvictObject",
    "ObjectUsage",
    "ParkObject",
    "Plan",
    "PreemptSession",
    "Refusal",
    "SessionUsage",
    "parking_destination",
    "plan",
]

@dataclasses.dataclass(frozen=True)
class _Selection:
    """What a replay of the exact search may take: each phase's object names by session index, and the
    destination keys its parks need room in (an eviction or demotion freeing bytes there counts as a gain)."""

    evictions: Mapping[int, Collection[str]]
    demotions: Mapping[int, Collection[str]]
    parks: Mapping[int, Collection[str]]
    room_keys: Collection[str]


def _frees_room(gain: int, freed: Mapping[str, int], selection: _Selection | None) -> bool:
    """Whether an action freeing ``freed`` is worth taking: it gains on an over-budget key (``gain``), or it
    frees a key the replayed ``selection``'s parks need room in."""
    return bool(gain) or (selection is not None and any(k in selection.room_keys for k in freed))


def _evict_phase(ledger: Projection, actors: Sequence[SessionUsage], selection: _Selection | None = None) -> None:
    """Drops, LRU session first, cheapest recompute per over-budget byte first (each :func:`_frees_room`)."""
    for index, session in enumerate(actors):
        if not ledger.over:
            return
        candidates = evictable(session)
        if selection is not None:
            candidates = [o for o in candidates if o.name in selection.evictions.get(index, ())]
        evicted: set[str] = set()
        needed_by_evicted: set[str] = set()
        while ledger.over:
            best = None
            for obj in candidates:
                if (
                    obj.name in evicted
                    or obj.name in needed_by_evicted
                    or not evicted.isdisjoint(obj.sources)
                ):
                    continue
                gain = ledger.gain(obj.bytes_by_device)
                if not _frees_room(gain, obj.bytes_by_device, selection):
                    continue
                rank = (obj.recompute_cost / gain if gain else math.inf, obj.name)
                if best is None or rank < best[0]:
                    best = (rank, obj)
            if best is None:
                break
            obj = best[1]
            evicted.add(obj.name)
            needed_by_evicted.update(obj.sources)
            ledger.record(index, obj.name, EvictObject(session.session_id, obj.name, obj.bytes_by_device),
                          obj.bytes_by_device)


def _demote_phase(ledger: Projection, actors: Sequence[SessionUsage], selection: _Selection | None = None) -> None:
    """Demotions (each :func:`_frees_room`), LRU session first, most bytes saved on over-budget keys first,
    ties by name."""
    for index, session in enumerate(actors):
        if not ledger.over:
            return
        candidates = [
            (obj, freed)
            for obj, freed in demotable(session)
            if (index, obj.name) not in ledger.acted_on
            and (selection is None or obj.name in selection.demotions.get(index, ()))
        ]
        candidates.sort(key=lambda c: (-ledger.gain(c[1]), c[0].name))
        for obj, freed in candidates:
            if not ledger.over:
                return
            if not _frees_room(ledger.gain(freed), freed, selection):
                continue
            ledger.record(index, obj.name, DemoteObject(session.session_id, obj.name, types.MappingProxyType(freed)),
                          freed)


def _park_phase(ledger: Projection, actors: Sequence[SessionUsage], selection: _Selection | None = None) -> None:
    """Parks, LRU session first, larger objects first, where room allows (not objects acted on)."""
    for index, session in enumerate(actors):
        if not ledger.over or ledger.room_left <= 0:  # every parkable object moves bytes
            return
        for obj, moved in parkable(session):
            if not ledger.over:
                return
            total = sum(moved.values())
            if (
                (selection is not None and obj.name not in selection.parks.get(index, ()))
                or (index, obj.name) in ledger.acted_on
                or not ledger.gain(moved)
                or total > ledger.room_left
                or any(
                    ledger.usage.get(parking_destination(k), 0) + b
                    > ledger.budgets.get(parking_destination(k), math.inf)
                    for k, b in moved.items()
                )
            ):
                continue
            ledger.room_left -= total
            ledger.release({parking_destination(key): count for key, count in moved.items()}, sign=1)
            ledger.record(index, obj.name, ParkObject(session.session_id, obj.name, types.MappingProxyType(moved)),
                          moved)


def _preempt_phase(ledger: Projection, actors: Sequence[SessionUsage]) -> None:
    """Preempts LRU sessions that still hold bytes on an over-budget key, then leaves out the
    ones that later preemptions made needless (each loses a session's history)."""
    taken: list[tuple[PreemptSession, dict[str, int]]] = []
    for index, session in enumerate(actors):
        if not ledger.over:
            break
        current = dict(session.attrs_bytes_by_device)
        for obj in session.objects:
            action = ledger.acted_on.get((index, obj.name))
            if obj.state == "evicted" or isinstance(action, EvictObject):
                continue
            for key, count in obj.bytes_by_device.items():
                if isinstance(action, ParkObject) and key in action.moved:
                    key = parking_destination(key)
                if isinstance(action, DemoteObject):
                    count -= action.freed.get(key, 0)
                current[key] = current.get(key, 0) + count
        if ledger.gain(current):
            ledger.release(current)
            preempt = PreemptSession(session.session_id, types.MappingProxyType(add_footprint({}, session)))
            ledger.actions.append(preempt)
            taken.append((preempt, current))
    if ledger.over:
        return
    needless = set()
    for preempt, current in taken[:-1]:
        ledger.release(current, sign=1)
        if ledger.over:
            ledger.release(current)
        else:
            needless.add(id(preempt))
    if needless:
        ledger.actions = [a for a in ledger.actions if id(a) not in needless]


def _searched_plan(
    usage: Mapping[str, int],
    budgets: Mapping[str, int],
    host_room: int | None,
    actors: Sequence[SessionUsage],
    park: bool,
    search_limit: int,
) -> tuple[Plan | None, str]:
    """The exact search's evictions, demotions and parks, replayed in rule order, and why a refusal would not be
    proven ("" when it would be); (None, why) if no replayed plan fits."""
    start = Projection(usage, budgets, host_room)
    over = start.over

    def candidates() -> Iterator[_plan_search.Candidates]:
        for index, session in enumerate(actors):
            yield _plan_search.Candidates(
                index,
                [o for o in evictable(session) if any(k in over for k in o.bytes_by_device)],
                [(o, m) for o, m in parkable(session) if any(k in over for k in m)] if park else [],
                [(o, freed) for o, freed in demotable(session) if any(k in over for k in freed)],
            )

    selection, proven = _plan_search.search(start, candidates, parking_destination, search_limit)
    if selection is None:
        return None, "" if proven else f"search gave up at search_limit={search_limit}"
    replay = Projection(usage, budgets, host_room)
    parks = {i: option.parks for i, option in selection.items()}
    room_keys = {
        parking_destination(k)
        for i, names in parks.items()
        for obj, moved in parkable(actors[i])
        if obj.name in names
        for k in moved
    } & budgets.keys()
    chosen = _Selection(
        evictions={i: option.evictions for i, option in selection.items()},
        demotions={i: option.demotions for i, option in selection.items()},
        parks=parks,
        room_keys=room_keys,
    )
    _evict_phase(replay, actors, chosen)
    _demote_phase(replay, actors, chosen)
    _park_phase(replay, actors, chosen)
    if replay.over:  # a plan is returned only when it fits
        return None, "the search's selection did not fit once replayed in rule order"
    return replay.to_plan(), ""


def plan(
    sessions: Sequence[SessionUsage],
    *,
    budgets: Mapping[str, int],
    protect: Hashable | None = None,
    park: bool = False,
    host_room: int | None = None,
    allow_preempt: bool = False,
    search_limit: int = 100_000,
) -> Plan | Refusal:
    """Plans evictions, demotions, parks and preemptions that bring usage within ``budgets``.

    Usage of a key is the bytes of every non-evicted object (parked bytes sit
    under the pinned_host keys) plus session attrs.  Pinned sessions and the
    ``protect`` session count but are never touched.  An action is a
    *candidate* if it is on another session and frees bytes on a key over
    budget before planning:

    - evict: an object that is resident, recomputable, whose sources are all
      resident, and that no evicted object (before or earlier in the plan)
      lists as a source;
    - demote: a resident object with ``demoted_bytes_by_device`` (a lower
      tier); it frees the difference and stays resident, lossy;
    - park (if ``park``): a resident, ``parkable`` object; its default-kind
      bytes on k move to k + "/pinned_host";
    - preempt (if ``allow_preempt``): a session; frees all its bytes.

    A *valid* plan is evictions, demotions, parks, then preemptions, all candidates,
    where the evictions are evictable in turn, the parks move at most
    ``host_room`` bytes in total (None: unlimited), and each park leaves its
    budgeted destination keys within budget.  It *fits* if every budgeted key
    ends within budget.

    Rules: while a key is over budget, (1) evict, LRU session first, cheapest
    ``recompute_cost`` per byte freed on over-budget keys first (ties by
    name); (2) demote, LRU session first, most bytes saved on over-budget keys
    first; (3) park, LRU session first, larger objects first (an object
    demoted in the plan is not also parked); (4) preempt LRU sessions first.
    Each action frees bytes on a key over budget when taken (a replayed
    search eviction or demotion may instead free room its parks need), and
    the plan stops as soon as every key fits.  A preemption that later ones made needless
    is left out (preemption loses history, so the plan keeps as few as this
    greedy order allows).

    Completeness: a Plan is returned whenever some valid plan fits (of
    evictions, demotions, parks and preemptions).  Greedy choices can block
    each other (evicting a dependent pins its source, demoting an object
    keeps it from being parked whole), so when they fall short an exact
    search over per-session Pareto-optimal evict/demote/park options (one
    action per object) replaces them (before resorting to preemption), and
    the chosen actions are replayed in rule order.  With ``allow_preempt`` this is
    complete always: preempting every candidate session is the least usage
    any plan reaches.  Without it the search is exact unless a session has
    more than ``search_limit`` options or the search backtracks more than
    ``search_limit`` times; then it gives up with ``Refusal.proven`` False
    (as it does in the rare case where the search's selection does not fit
    once replayed in rule order).

    Args:
      sessions: every session, with unique ids.
      budgets: byte budget per device key; keys without one are unlimited.
      protect: id of the session being put, created or restored, or None.
      park: whether objects may be parked to host memory.
      host_room: bytes the parks may move in total; None for unlimited.
      allow_preempt: whether whole sessions may be preempted.
      search_limit: work bound of the exact search (see Completeness).

    Returns:
      A :class:`Plan` (its ``usage_after`` within every budget), or a
      :class:`Refusal` if no valid plan fits.

    Raises:
      PayloadTypeError: a budget is not an int.
      PayloadError: a budget is below 0, or two sessions have one id.

    Example:
      The greedy pass evictions the cheap ``cond_kv`` first, which pins
      ``prompt``; the search sees that only evicting ``prompt`` fits:

      >>> prompt = ObjectUsage("prompt", {"cuda:0": 1000}, recomputable=True, recompute_cost=500.0)
      >>> cond_kv = ObjectUsage("cond_kv", {"cuda:0": 10}, sources=("prompt",), recomputable=True,
      ...                       recompute_cost=1.0)
      >>> result = plan([SessionUsage("s", (prompt, cond_kv), last_used=1)], budgets={"cuda:0": 500})
      >>> [(type(a).__name__, a.name) for a in result.actions]
      [('EvictObject', 'prompt')]
      >>> dict(result.usage_after)
      {'cuda:0': 10}
    """
    budgets = byte_counts("plan", "budgets", budgets, keep_zeros=True)
    _require_unique_ids(sessions)
    usage: dict[str, int] = {}
    for session in sessions:
        add_footprint(usage, session)
    greedy = Projection(usage, budgets, host_room)
    if not greedy.over:
        return greedy.to_plan()
    actors = _plan_search.actors(sessions, protect, greedy.over)
    _evict_phase(greedy, actors)
    _demote_phase(greedy, actors)
    if park:
        _park_phase(greedy, actors)
    if not greedy.over:
        return greedy.to_plan()
    searched, unproven = _searched_plan(usage, budgets, host_room, actors, park, search_limit)
    if searched is not None:
        return searched
    if allow_preempt:
        _preempt_phase(greedy, actors)
        if not greedy.over:
            return greedy.to_plan()
        unproven = ""
    shortfall = {k: greedy.usage[k] - budgets[k] for k in sorted(greedy.over)}
    message = "over budget: " + ", ".join(f"{k} by {b} bytes" for k, b in shortfall.items())
    if unproven:
        message += f" ({unproven})"
    return Refusal(types.MappingProxyType(shortfall), not unproven, message)


def _require_unique_ids(sessions: Sequence[SessionUsage]) -> None:
    counts = collections.Counter(session.session_id for session in sessions)
    repeated = [session_id for session_id, count in counts.items() if count > 1]
    if repeated:
        raise PayloadError(f"plan: every session needs its own id; {repeated!r} appear more than once.")

