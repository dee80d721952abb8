"""The planner's exact search for evictions, demotions and parks that fit every budget.

Used when the planner's greedy, rule-ordered pass falls short: greedy choices
can block each other (evicting a dependent pins its source, parking a large
object can leave no host room for the two that would have fitted, demoting
an object keeps it from being parked whole).  Each session contributes its
Pareto-optimal evict/demote/park options (one action per object); a
depth-first search with a lower bound on what the remaining sessions can
still free picks one option per session.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jax_session_state.manager._plan_records import Action, ObjectUsage, Plan, PreemptSession, SessionUsage

PINNED_HOST_SUFFIX = "/pinned_host"


def parking_destination(device_key: str) -> str | None:
    """The key that parked bytes of ``device_key`` move to.

    Only default memory kinds are parked: ``"cuda:1"`` -> ``"cuda:1/pinned_host"``.
    Keys that already name a memory kind (``"cpu:0/pinned_host"``) and
    ``"host"`` give None.

    Example:
      >>> from jax_session_state.manager.planner import parking_destination
      >>> parking_destination("cuda:1"), parking_destination("cpu:0/pinned_host"), parking_destination("host")
      ('cuda:1/pinned_host', None, None)
    """
    if "/" in device_key or device_key == "host":
        return None
    return device_key + PINNED_HOST_SUFFIX


def add_footprint(total: dict[str, int], session: SessionUsage) -> dict[str, int]:
    """Adds all bytes of a session (attrs, non-evicted objects) to ``total``."""
    for key, count in session.attrs_bytes_by_device.items():
        total[key] = total.get(key, 0) + count
    for obj in session.objects:
        if obj.state != "evicted":
            for key, count in obj.bytes_by_device.items():
                total[key] = total.get(key, 0) + count
    return total


def evictable(session: SessionUsage) -> list[ObjectUsage]:
    """Objects evictable before planning: resident, recomputable, sources resident,
    and not a source of an already evicted object."""
    resident = {o.name for o in session.objects if o.state == "resident"}
    needed = {s for o in session.objects if o.state == "evicted" for s in o.sources}
    return [
        o
        for o in session.objects
        if o.recomputable and o.name in resident and o.name not in needed and resident.issuperset(o.sources)
    ]


def demotable(session: SessionUsage) -> list[tuple[ObjectUsage, dict[str, int]]]:
    """Resident objects with a lower tier, and the bytes by device key demoting each frees."""
    return [(obj, obj.demotion_frees) for obj in session.objects if obj.state == "resident" and obj.demotion_frees]


def parkable(session: SessionUsage) -> list[tuple[ObjectUsage, dict[str, int]]]:
    """Resident, parkable objects with their default-kind bytes, largest first."""
    parks = []
    for obj in session.objects:
        moved = {k: b for k, b in obj.bytes_by_device.items() if parking_destination(k)}
        if obj.state == "resident" and obj.parkable and moved:
            parks.append((obj, moved))
    parks.sort(key=lambda p: (-sum(p[1].values()), p[0].name))
    return parks


class Candidates(NamedTuple):
    """A session's objects an eviction, demotion or park of which frees an over-budget key.

    Attributes:
      index: the session's position among the planner's actors.
      evictions: evictable objects (``ObjectUsage``).
      parks: ``(object, moved bytes by device key)`` of parkable objects.
      demotions: ``(object, freed bytes by device key)`` of demotable objects.
    """

    index: int
    evictions: list[Any]
    parks: list[tuple[Any, dict[str, int]]]
    demotions: list[tuple[Any, dict[str, int]]]


class Option(NamedTuple):
    """One way a session can take part in a plan without preemption."""

    delta: tuple[int, ...]  # usage change per constrained key
    room: int  # bytes moved into parked storage
    evictions: frozenset[str]
    parks: frozenset[str]
    demotions: frozenset[str] = frozenset()


def _may_fit(start: Any, candidates: Iterable[Candidates]) -> bool:
    """Cheap necessary condition for evictions and parks to fit, ignoring conflicts."""
    evict_free = dict.fromkeys(start.over, 0)
    park_free = dict.fromkeys(start.over, 0)
    for _, evictions, parks, demotions in candidates:
        freeing = [obj.bytes_by_device for obj in evictions] + [freed for _, freed in demotions]
        for freed in freeing:  # an object both evictable and demotable counts twice: still a bound
            for key, count in freed.items():
                if key in evict_free:
                    evict_free[key] += count
        for _, moved in parks:
            for key, count in moved.items():
                if key in park_free:
                    park_free[key] += count
    missing = {k: start.usage[k] - start.budgets[k] - evict_free[k] for k in start.over}
    return (
        all(m <= park_free[k] for k, m in missing.items())
        and sum(max(m, 0) for m in missing.values()) <= start.room_left
    )


def _session_menu(
    candidates: Candidates,
    column: Mapping[str, int],
    room_left: float,
    destination: Callable[[str], str | None],
    limit: int,
) -> list[Option] | None:
    """Pareto-optimal evict/demote/park options of one session (one action per object); None if over ``limit``."""
    width = len(column)
    menu = [Option((0,) * width, 0, frozenset(), frozenset())]
    by_name = {obj.name: obj for obj in candidates.evictions}
    parkable = {obj.name: moved for obj, moved in candidates.parks}
    demotable = {obj.name: freed for obj, freed in candidates.demotions}
    objects = {obj.name: obj for obj, _ in (*candidates.parks, *candidates.demotions)} | by_name
    for name in sorted(objects):
        obj = objects[name]
        evict_delta, demote_delta = [0] * width, [0] * width
        for delta, freed in ((evict_delta, obj.bytes_by_device), (demote_delta, demotable.get(name, {}))):
            for key, count in freed.items():
                if key in column:
                    delta[column[key]] -= count
        park_delta = [0] * width
        for key, count in parkable.get(name, {}).items():
            for k, sign in ((key, -1), (destination(key), 1)):
                if k in column:
                    park_delta[column[k]] += sign * count
        park_room = sum(parkable.get(name, {}).values())
        grown = []
        for option in menu:
            grown.append(option)
            if (
                name in by_name
                and option.evictions.isdisjoint(obj.sources)
                and not any(name in by_name[d].sources for d in option.evictions)
            ):
                delta = tuple(map(sum, zip(option.delta, evict_delta)))
                grown.append(option._replace(delta=delta, evictions=option.evictions | {name}))
            if name in demotable:
                delta = tuple(map(sum, zip(option.delta, demote_delta)))
                grown.append(option._replace(delta=delta, demotions=option.demotions | {name}))
            if name in parkable and option.room + park_room <= room_left:
                delta = tuple(map(sum, zip(option.delta, park_delta)))
                grown.append(option._replace(delta=delta, room=option.room + park_room, parks=option.parks | {name}))
        if len(grown) > limit:
            return None
        menu = grown
    front: list[Option] = []
    for option in sorted(menu, key=lambda o: (sum(o.delta), o.room)):
        if not any(
            f.room <= option.room and all(a <= b for a, b in zip(f.delta, option.delta)) for f in front
        ):
            front.append(option)
    return front


def search(
    start: Any,
    candidates: Callable[[], Iterable[Candidates]],
    destination: Callable[[str], str | None],
    limit: int,
) -> tuple[dict[int, Option] | None, bool]:
    """Exact search for evictions, demotions and parks (no preemption) that fit every budget.

    Args:
      start: the planner's ledger before any action (``usage``, ``budgets``,
        ``over``, ``room_left``).
      candidates: yields each actor's candidates (parks only where parking is
        on); called twice, so that the cheap bound is streamed and only a
        search that may succeed keeps them all.
      destination: where parked bytes of a device key go.
      limit: options per session and backtracking steps before giving up.

    Returns:
      ``(option by actor index, exhaustive)``; the selection is None when
      nothing fits, or when ``limit`` was exceeded (then exhaustive is False).
    """
    if not _may_fit(start, candidates()):
        return None, True
    kept = [c for c in candidates() if c.evictions or c.parks or c.demotions]
    destinations = {destination(k) for c in kept for _, moved in c.parks for k in moved}
    keys = sorted(start.over | (destinations & start.budgets.keys()))
    column = {key: j for j, key in enumerate(keys)}
    slack = [start.budgets[k] - start.usage.get(k, 0) for k in keys]
    indices, menus = [], []
    for session_candidates in kept:
        menu = _session_menu(session_candidates, column, start.room_left, destination, limit)
        if menu is None:
            return None, False
        indices.append(session_candidates.index)
        menus.append(menu)
    best_rest = [[0] * len(keys)]  # reversed below: best_rest[i] bounds what menus[i:] can free
    for menu in reversed(menus):
        best_rest.append([r + min(o.delta[j] for o in menu) for j, r in enumerate(best_rest[-1])])
    best_rest.reverse()
    usage_change, room, chosen, backtracks = [0] * len(keys), 0, [], 0

    def take(option: Option, sign: int) -> None:
        nonlocal room
        room += sign * option.room
        for j, d in enumerate(option.delta):
            usage_change[j] += sign * d

    while True:
        depth = len(chosen)
        if room <= start.room_left:
            if all(c <= s for c, s in zip(usage_change, slack)):
                return {indices[d]: menus[d][i] for d, i in enumerate(chosen)}, True
            if depth < len(menus) and all(
                c + r <= s for c, r, s in zip(usage_change, best_rest[depth], slack)
            ):
                chosen.append(0)
                take(menus[depth][0], 1)
                continue
        while True:  # backtrack to the deepest session with an untried option
            if not chosen:
                return None, True
            depth = len(chosen) - 1
            tried = chosen.pop()
            take(menus[depth][tried], -1)
            backtracks += 1
            if backtracks > limit:
                return None, False
            if tried + 1 < len(menus[depth]):
                chosen.append(tried + 1)
                take(menus[depth][tried + 1], 1)
                break


class Projection:
    """Projected usage as a plan grows, with the keys still over budget."""

    def __init__(self, usage: Mapping[str, int], budgets: Mapping[str, int], host_room: int | None):
        self.usage = dict(usage)
        self.budgets = budgets
        self.over = {k for k, b in budgets.items() if self.usage.get(k, 0) > b}
        self.room_left = math.inf if host_room is None else host_room
        self.actions: list[Action] = []
        self.acted_on: dict[tuple[int, str], Action] = {}  # (actor index, object name)

    def shift(self, key: str, amount: int) -> None:
        self.usage[key] = self.usage.get(key, 0) + amount
        if key in self.budgets and self.usage[key] > self.budgets[key]:
            self.over.add(key)
        else:
            self.over.discard(key)

    def release(self, bytes_by_device: Mapping[str, int], sign: int = -1) -> None:
        """Moves ``bytes_by_device`` off their keys (``sign=1``: back onto them)."""
        for key, count in bytes_by_device.items():
            self.shift(key, sign * count)

    def record(self, index: int, name: str, action: Action, released: Mapping[str, int]) -> None:
        """``action`` on object ``name`` of actor ``index`` taken: its ``released`` bytes come off."""
        self.release(released)
        self.actions.append(action)
        self.acted_on[index, name] = action

    def gain(self, bytes_by_device: Mapping[str, int]) -> int:
        """Bytes that releasing ``bytes_by_device`` frees on over-budget keys."""
        return sum(b for k, b in bytes_by_device.items() if k in self.over)

    def to_plan(self) -> Plan:
        """The plan so far, less evictions and parks superseded by a preemption."""
        preempted = {a.session_id for a in self.actions if isinstance(a, PreemptSession)}
        actions = tuple(
            a for a in self.actions if isinstance(a, PreemptSession) or a.session_id not in preempted
        )
        return Plan(actions, types.MappingProxyType({k: b for k, b in sorted(self.usage.items()) if b}))


def actors(
    sessions: Sequence[SessionUsage], protect: Hashable | None, over: Collection[str]
) -> list[SessionUsage]:
    """Unpinned, unprotected sessions holding bytes on an over-budget key, LRU first."""
    actors = [
        s
        for s in sessions
        if not s.pinned
        and (protect is None or s.session_id != protect)
        and (
            any(k in over for k in s.attrs_bytes_by_device)
            or any(k in over for o in s.objects if o.state != "evicted" for k in o.bytes_by_device)
        )
    ]
    actors.sort(key=lambda s: s.last_used)  # stable: input order breaks ties
    return actors
