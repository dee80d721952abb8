"""The planner: hand-built rule cases, and properties checked against an independent
simulator and an exhaustive brute-force oracle."""

import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.manager.planner import (
    DemoteObject,
    EvictObject,
    ObjectUsage,
    ParkObject,
    Plan,
    PreemptSession,
    Refusal,
    SessionUsage,
    plan,
)

# ----------------------------------------------------------------------------- helpers


def obj(name, nbytes, **kw):
    return ObjectUsage(name, nbytes, **kw)


def sess(sid, *objects, last_used=0, **kw):
    return SessionUsage(sid, tuple(objects), last_used=last_used, **kw)


def steps(result):
    assert isinstance(result, Plan), result
    out = []
    for a in result.actions:
        kind = {EvictObject: "drop", DemoteObject: "demote", ParkObject: "park", PreemptSession: "preempt"}[type(a)]
        out.append((kind, a.session_id) if kind == "preempt" else (kind, a.session_id, a.name))
    return out


def is_default_kind(key):
    return "/" not in key and key != "host"


def usage_of(state):
    """state: {sid: {"objects": {name: [state, bytes, obj]}, "attrs": {...}}}"""
    total = {}
    for s in state.values():
        for key, b in s["attrs"].items():
            total[key] = total.get(key, 0) + b
        for st_, nbytes, _ in s["objects"].values():
            if st_ != "evicted":
                for key, b in nbytes.items():
                    total[key] = total.get(key, 0) + b
    return {k: v for k, v in total.items() if v}


def over_keys(usage, budgets):
    return {k for k, b in budgets.items() if usage.get(k, 0) > b}


def initial_state(sessions):
    return {
        s.session_id: {
            "objects": {o.name: [o.state, dict(o.bytes_by_device), o] for o in s.objects},
            "attrs": dict(s.attrs_bytes_by_device),
        }
        for s in sessions
    }


def simulate(sessions, result, budgets, protect=None, park=False, host_room=None, allow_preempt=False):
    """Applies `result` independently of the planner, checking every rule.

    Returns the usage after the plan.
    """
    by_id = {s.session_id: s for s in sessions}
    state = initial_state(sessions)
    room = float("inf") if host_room is None else host_room
    phase_rank = {EvictObject: 0, ParkObject: 1, PreemptSession: 2}
    last_rank = 0
    touched = set()
    dests = {k + "/pinned_host" for a in result.actions if isinstance(a, ParkObject) for k in a.moved}
    for action in result.actions:
        sid = action.session_id
        usage = usage_of(state)
        over = over_keys(usage, budgets)
        assert over, f"action {action} taken after every key fits"
        assert phase_rank[type(action)] >= last_rank, "phases out of order"
        last_rank = phase_rank[type(action)]
        assert sid in state, f"session {sid} unknown or already preempted"
        assert not by_id[sid].pinned, f"pinned session {sid} touched"
        assert protect is None or sid != protect, f"protected session {sid} touched"
        objects = state[sid]["objects"]
        if isinstance(action, EvictObject):
            st_, nbytes, o = objects[action.name]
            assert st_ == "resident", f"drop of {st_} object"
            assert o.recomputable, "drop of non-recomputable object"
            for src in o.sources:
                assert src in objects and objects[src][0] == "resident", (
                    f"drop of {action.name} whose source {src} is not resident"
                )
            for other, (ost, _, oo) in objects.items():
                assert not (ost == "evicted" and action.name in oo.sources), (
                    f"drop of {action.name} needed by dropped {other}"
                )
            assert dict(action.freed) == {k: b for k, b in nbytes.items() if b}
            helps = any(b and k in over for k, b in nbytes.items())
            makes_room = any(b and k in dests and k in budgets for k, b in nbytes.items())
            assert helps or makes_room, f"needless drop {action}"
            objects[action.name][0] = "evicted"
            touched.add(sid)
        elif isinstance(action, ParkObject):
            assert park, "park while parking disabled"
            st_, nbytes, o = objects[action.name]
            assert st_ == "resident", f"park of {st_} object"
            moved = {k: b for k, b in nbytes.items() if b and is_default_kind(k)}
            assert dict(action.moved) == moved
            assert any(k in over for k in moved), f"needless park {action}"
            assert sum(moved.values()) <= room, "host room exceeded"
            room -= sum(moved.values())
            new = {k: b for k, b in nbytes.items() if k not in moved}
            for k, b in moved.items():
                new[k + "/pinned_host"] = new.get(k + "/pinned_host", 0) + b
            objects[action.name] = ["parked", new, o]
            after = usage_of(state)
            for k in moved:
                d = k + "/pinned_host"
                assert d not in budgets or after.get(d, 0) <= budgets[d], f"park overfills {d}"
            touched.add(sid)
        else:
            assert allow_preempt, "preempt while preemption disallowed"
            assert sid not in touched, f"preempted {sid} also has earlier actions"
            footprint = usage_of({sid: state[sid]})
            assert dict(action.freed) == footprint
            assert any(k in over for k in footprint), f"needless preempt {action}"
            del state[sid]
    final = usage_of(state)
    assert {k: v for k, v in result.usage_after.items() if v} == final
    return final


def session_options(s, over, park):
    """All (drops, parks) of one session whose every action frees an over key."""
    objects = {o.name: o for o in s.objects}
    dropped_before = [o for o in s.objects if o.state == "evicted"]

    def on_over(nbytes, only_default=False):
        return any(b and k in over and (is_default_kind(k) or not only_default) for k, b in nbytes.items())

    drop_ok = [
        o.name
        for o in s.objects
        if o.state == "resident"
        and o.recomputable
        and on_over(o.bytes_by_device)
        and all(src in objects and objects[src].state == "resident" for src in o.sources)
        and not any(o.name in d.sources for d in dropped_before)
    ]
    park_ok = [
        o.name
        for o in s.objects
        if park and o.state == "resident" and on_over(o.bytes_by_device, only_default=True)
    ]
    names = sorted(set(drop_ok) | set(park_ok))
    for choice in itertools.product(("keep", "drop", "park"), repeat=len(names)):
        drops = {n for n, c in zip(names, choice) if c == "drop"}
        parks = {n for n, c in zip(names, choice) if c == "park"}
        if not drops <= set(drop_ok) or not parks <= set(park_ok):
            continue
        if any(src in drops for n in drops for src in objects[n].sources):
            continue  # a drop whose source is dropped too, in either order, is invalid
        yield drops, parks


def brute_force_fits(sessions, budgets, protect=None, park=False, host_room=None, allow_preempt=False):
    """Whether any valid action set (drops, parks, preempts) fits every budget."""
    state0 = initial_state(sessions)
    over = over_keys(usage_of(state0), budgets)
    if not over:
        return True
    actors = [
        s
        for s in sessions
        if not s.pinned
        and (protect is None or s.session_id != protect)
        and any(k in over for k in usage_of({s.session_id: state0[s.session_id]}))
    ]
    menus = []
    for s in actors:
        menu = [("act", d, p) for d, p in session_options(s, over, park)]
        if allow_preempt:
            menu.append(("preempt", None, None))
        menus.append(menu)
    room = float("inf") if host_room is None else host_room
    for combo in itertools.product(*menus):
        state = initial_state(sessions)
        for s, (_, drops, _) in zip(actors, combo):
            for n in drops or ():
                state[s.session_id]["objects"][n][0] = "evicted"
        moved_total, parked_into = 0, set()
        for s, (_, _, parks) in zip(actors, combo):
            for n in parks or ():
                entry = state[s.session_id]["objects"][n]
                moved = {k: b for k, b in entry[1].items() if b and is_default_kind(k)}
                moved_total += sum(moved.values())
                parked_into |= {k + "/pinned_host" for k in moved}
                new = {k: b for k, b in entry[1].items() if k not in moved}
                for k, b in moved.items():
                    new[k + "/pinned_host"] = new.get(k + "/pinned_host", 0) + b
                state[s.session_id]["objects"][n] = ["parked", new, entry[2]]
        if moved_total > room:
            continue
        after_parks = usage_of(state)
        if any(d in budgets and after_parks.get(d, 0) > budgets[d] for d in parked_into):
            continue  # some park left its destination over budget
        for s, (kind, _, _) in zip(actors, combo):
            if kind == "preempt":
                del state[s.session_id]
        if not over_keys(usage_of(state), budgets):
            return True
    return False


# ----------------------------------------------------------------------------- unit tests


def test_within_budget_returns_empty_plan():
    s = sess("a", obj("x", {"cuda:0": 10}, recomputable=True))
    result = plan([s], budgets={"cuda:0": 10, "cpu:0": 0})
    assert result == Plan((), {"cuda:0": 10})


def test_drops_cheapest_recompute_per_byte_first():
    s = sess(
        "a",
        obj("expensive", {"cuda:0": 100}, recomputable=True, recompute_cost=50.0),
        obj("cheap", {"cuda:0": 100}, recomputable=True, recompute_cost=1.0),
        obj("big_cheap_per_byte", {"cuda:0": 1000}, recomputable=True, recompute_cost=5.0),
    )
    # per byte: big 0.005 < cheap 0.01 < expensive 0.5
    assert steps(plan([s], budgets={"cuda:0": 1150})) == [("drop", "a", "big_cheap_per_byte")]
    assert steps(plan([s], budgets={"cuda:0": 100})) == [
        ("drop", "a", "big_cheap_per_byte"),
        ("drop", "a", "cheap"),
    ]


def test_cost_per_byte_counts_only_over_budget_keys():
    s = sess(
        "a",
        obj("mostly_cpu", {"cpu:0": 1000, "cuda:0": 10}, recomputable=True, recompute_cost=1.0),
        obj("gpu", {"cuda:0": 10}, recomputable=True, recompute_cost=0.5),
    )
    # Over only on cuda:0: 1/10 vs 0.5/10 -> "gpu" is cheaper per freed byte.
    assert steps(plan([s], budgets={"cuda:0": 15})) == [("drop", "a", "gpu")]


def test_drop_ties_broken_by_name():
    s = sess("a", obj("b", {"cuda:0": 10}, recomputable=True), obj("a", {"cuda:0": 10}, recomputable=True))
    assert steps(plan([s], budgets={"cuda:0": 15})) == [("drop", "a", "a")]


def test_drops_least_recently_used_session_first():
    old = sess("old", obj("x", {"cuda:0": 10}, recomputable=True, recompute_cost=9.0), last_used=1)
    new = sess("new", obj("x", {"cuda:0": 10}, recomputable=True, recompute_cost=0.0), last_used=2)
    assert steps(plan([new, old], budgets={"cuda:0": 15})) == [("drop", "old", "x")]
    # Equal recency: input order decides.
    tie = sess("tie", obj("x", {"cuda:0": 10}, recomputable=True), last_used=1)
    assert steps(plan([tie, old], budgets={"cuda:0": 15})) == [("drop", "tie", "x")]


def test_non_recomputable_objects_are_never_dropped():
    s = sess("a", obj("kv", {"cuda:0": 100}))
    result = plan([s], budgets={"cuda:0": 50})
    assert isinstance(result, Refusal) and result.proven


def _prompt_chain(prompt_cost=500.0, state="resident"):
    return sess(
        "s",
        obj("prompt", {"cuda:0": 1000}, recomputable=True, recompute_cost=prompt_cost),
        obj(
            "cond_kv", {"cuda:0": 10}, sources=("prompt",), recomputable=True, recompute_cost=1.0, state=state
        ),
    )


def test_chain_small_shortfall_drops_cheap_dependent_only():
    assert steps(plan([_prompt_chain()], budgets={"cuda:0": 1005})) == [("drop", "s", "cond_kv")]


def test_chain_greedy_block_is_repaired_by_dropping_the_source():
    # Greedy drops cond_kv (0.1/byte < 0.5/byte), which pins prompt; only
    # dropping prompt fits, and preemption and parking are off.
    result = plan([_prompt_chain()], budgets={"cuda:0": 500})
    assert steps(result) == [("drop", "s", "prompt")]
    assert dict(result.usage_after) == {"cuda:0": 10}


def test_chain_repair_avoids_preemption():
    other = sess("other", obj("kv", {"cuda:0": 600}), last_used=5)
    result = plan([_prompt_chain(), other], budgets={"cuda:0": 700}, allow_preempt=True)
    assert steps(result) == [("drop", "s", "prompt")]


def test_source_of_dropped_dependent_is_never_dropped():
    result = plan([_prompt_chain(state="evicted")], budgets={"cuda:0": 500})
    assert isinstance(result, Refusal) and result.proven
    assert dict(result.shortfall_by_device) == {"cuda:0": 500}


def test_object_with_non_resident_source_is_not_dropped():
    s = sess(
        "s",
        obj("prompt", {"cpu:0/pinned_host": 1000}, state="parked", recomputable=True),
        obj("cond_kv", {"cuda:0": 10}, sources=("prompt",), recomputable=True),
    )
    result = plan([s], budgets={"cuda:0": 5})
    assert isinstance(result, Refusal)


def test_parks_move_bytes_to_pinned_host_largest_first():
    s = sess("a", obj("small", {"cuda:0": 10}), obj("large", {"cuda:0": 30, "host": 7}))
    result = plan([s], budgets={"cuda:0": 35}, park=True)
    assert steps(result) == [("park", "a", "large")]
    assert dict(result.actions[0].moved) == {"cuda:0": 30}  # "host" bytes stay
    assert dict(result.usage_after) == {"cuda:0": 10, "cuda:0/pinned_host": 30, "host": 7}


def test_drops_come_before_parks():
    s = sess(
        "a", obj("kv", {"cuda:0": 50}), obj("frames", {"cuda:0": 20}, recomputable=True, recompute_cost=100.0)
    )
    assert steps(plan([s], budgets={"cuda:0": 55}, park=True)) == [("drop", "a", "frames")]


def test_parking_disabled_means_no_parks():
    s = sess("a", obj("kv", {"cuda:0": 50}))
    assert isinstance(plan([s], budgets={"cuda:0": 10}), Refusal)


def test_parking_respects_host_room():
    s = sess("a", obj("kv", {"cuda:0": 50}), obj("frames", {"cuda:0": 20}))
    assert steps(plan([s], budgets={"cuda:0": 60}, park=True, host_room=30)) == [("park", "a", "frames")]
    assert isinstance(plan([s], budgets={"cuda:0": 60}, park=True, host_room=19), Refusal)


def test_parking_host_room_subset_sum_is_found():
    # Largest-first parks 6 and then nothing fits in room 10; 5 + 5 does.
    s = sess("a", obj("six", {"cuda:0": 6}), obj("five_a", {"cuda:0": 5}), obj("five_b", {"cuda:0": 5}))
    result = plan([s], budgets={"cuda:0": 6}, park=True, host_room=10)
    assert steps(result) == [("park", "a", "five_a"), ("park", "a", "five_b")]


def test_parking_respects_pinned_host_budget():
    s = sess("a", obj("kv", {"cuda:0": 50}), obj("frames", {"cuda:0": 20}))
    budgets = {"cuda:0": 60, "cuda:0/pinned_host": 25}
    assert steps(plan([s], budgets=budgets, park=True)) == [("park", "a", "frames")]
    budgets = {"cuda:0": 40, "cuda:0/pinned_host": 25}
    assert isinstance(plan([s], budgets=budgets, park=True), Refusal)


def test_greedy_park_respects_pinned_host_budget_before_preemption():
    # Parking b.y as well would overfill pinned_host (40 > 25); instead b is
    # preempted (a holds no cuda:0 bytes once parked, so it is not preempted).
    sessions = [
        sess("a", obj("x", {"cuda:0": 20}), last_used=0),
        sess("b", obj("y", {"cuda:0": 20}), last_used=1),
        sess("c", obj("z", {"cuda:0": 30}), last_used=2),
    ]
    budgets = {"cuda:0": 45, "cuda:0/pinned_host": 25}
    result = plan(sessions, budgets=budgets, park=True, allow_preempt=True)
    assert steps(result) == [("park", "a", "x"), ("preempt", "b")]
    simulate(sessions, result, budgets, park=True, allow_preempt=True)


def test_replayed_drop_makes_room_for_a_park():
    # Greedy drops r1 (fixing pinned_host), skips r2 (no longer helps), then
    # cannot park p (5 + 8 > 8). The search's selection drops both to make
    # room for the park, and the replay keeps r2 for that reason.
    s = sess(
        "s",
        obj("r1", {"cuda:0/pinned_host": 5}, recomputable=True),
        obj("r2", {"cuda:0/pinned_host": 5}, recomputable=True),
        obj("p", {"cuda:0": 8}),
    )
    budgets = {"cuda:0": 3, "cuda:0/pinned_host": 8}
    result = plan([s], budgets=budgets, park=True)
    assert steps(result) == [("drop", "s", "r1"), ("drop", "s", "r2"), ("park", "s", "p")]
    assert simulate([s], result, budgets, park=True) == {"cuda:0/pinned_host": 8}


def test_preempts_least_recently_used_sessions_until_within_budget():
    sessions = [sess(i, obj("kv", {"cuda:0": 10}), last_used=t) for i, t in ((0, 3), (1, 1), (2, 2), (3, 4))]
    result = plan(sessions, budgets={"cuda:0": 20}, allow_preempt=True)
    assert steps(result) == [("preempt", 1), ("preempt", 2)]
    assert dict(result.actions[0].freed) == {"cuda:0": 10}


def test_preemptions_made_needless_by_later_ones_are_left_out():
    # The LRU session holds 1 byte on cuda:0 (the rest is parked); preempting it alone is not
    # enough, and once "big" is preempted it was not needed at all.
    small = sess(
        "small",
        obj("kv", {"cuda:0/pinned_host": 50}, state="parked"),
        last_used=0,
        attrs_bytes_by_device={"cuda:0": 1},
    )
    big = sess("big", obj("kv", {"cuda:0": 40}), last_used=1)
    keep = sess("keep", obj("kv", {"cuda:0": 40}), last_used=2)
    sessions = [small, big, keep]
    result = plan(sessions, budgets={"cuda:0": 45}, allow_preempt=True)
    assert steps(result) == [("preempt", "big")]
    assert dict(result.usage_after) == {"cuda:0": 41, "cuda:0/pinned_host": 50}
    simulate(sessions, result, {"cuda:0": 45}, allow_preempt=True)


def test_preemption_frees_parked_bytes_and_supersedes_earlier_actions():
    a = sess(
        "a",
        obj("kv", {"cuda:0": 10}),
        obj("old", {"cuda:0/pinned_host": 4}, state="parked"),
        obj("frames", {"cuda:0": 5}, recomputable=True),
        last_used=1,
        attrs_bytes_by_device={"cuda:0": 1},
    )
    b = sess("b", obj("kv", {"cuda:0": 10}), last_used=2)
    result = plan([a, b], budgets={"cuda:0": 10}, allow_preempt=True)
    # frames is dropped first, then a is preempted anyway: only the preemption remains.
    assert steps(result) == [("preempt", "a")]
    assert dict(result.actions[0].freed) == {"cuda:0": 16, "cuda:0/pinned_host": 4}
    assert dict(result.usage_after) == {"cuda:0": 10}


def test_refusal_names_keys_and_shortfalls():
    pinned = sess("p", obj("kv", {"cuda:0": 100, "cuda:1": 40}), pinned=True)
    other = sess("o", obj("kv", {"cuda:1": 30}))
    result = plan([pinned, other], budgets={"cuda:0": 70, "cuda:1": 50, "cpu:0": 0}, allow_preempt=True)
    assert isinstance(result, Refusal) and result.proven
    assert dict(result.shortfall_by_device) == {"cuda:0": 30}
    assert "cuda:0 by 30 bytes" in result.message


def test_pinned_and_protected_sessions_are_untouched():
    pinned = sess("p", obj("x", {"cuda:0": 50}, recomputable=True), pinned=True, last_used=0)
    protected = sess("q", obj("x", {"cuda:0": 50}, recomputable=True), last_used=1)
    free = sess("f", obj("x", {"cuda:0": 5}, recomputable=True), last_used=9)
    result = plan(
        [pinned, protected, free], budgets={"cuda:0": 100}, protect="q", park=True, allow_preempt=True
    )
    assert steps(result) == [("drop", "f", "x")]
    result = plan(
        [pinned, protected, free], budgets={"cuda:0": 90}, protect="q", park=True, allow_preempt=True
    )
    assert isinstance(result, Refusal) and dict(result.shortfall_by_device) == {"cuda:0": 10}


def test_no_needless_actions():
    a = sess(
        "a",
        obj("cpu_only", {"cpu:0": 100}, recomputable=True),
        obj("gpu", {"cuda:0": 10}, recomputable=True),
        obj("gpu2", {"cuda:0": 10}, recomputable=True),
        last_used=0,
    )
    b = sess("b", obj("gpu", {"cuda:0": 10}, recomputable=True), last_used=1)
    result = plan([a, b], budgets={"cuda:0": 25, "cpu:0": 1000}, park=True, allow_preempt=True)
    assert steps(result) == [("drop", "a", "gpu")]


def test_search_limit_exhaustion_is_reported_as_unproven():
    # Must park 5 of 48 bytes in objects of 4 with room 7: one is too few, two
    # overflow the room. The cheap bound (5 <= 7) cannot tell; the search must.
    sessions = [sess(i, obj("x", {"cuda:0": 4})) for i in range(12)]
    budgets = {"cuda:0": 48 - 5}
    tight = plan(sessions, budgets=budgets, park=True, host_room=7, search_limit=3)
    assert isinstance(tight, Refusal) and not tight.proven and "search_limit" in tight.message
    full = plan(sessions, budgets=budgets, park=True, host_room=7)
    assert isinstance(full, Refusal) and full.proven
    assert steps(plan(sessions, budgets=budgets, park=True, host_room=8)) == [
        ("park", 0, "x"),
        ("park", 1, "x"),
    ]


def test_search_giving_up_still_plans_by_preemption():
    sessions = [sess(i, obj("x", {"cuda:0": 4})) for i in range(12)]
    budgets = {"cuda:0": 48 - 5}
    result = plan(sessions, budgets=budgets, park=True, host_room=7, allow_preempt=True, search_limit=3)
    # s0 is parked (room 7 fits one), so it holds no cuda:0 bytes; s1 is preempted.
    assert steps(result) == [("park", 0, "x"), ("preempt", 1)]
    simulate(sessions, result, budgets, park=True, host_room=7, allow_preempt=True)


def test_inputs_are_validated_and_frozen():
    with pytest.raises(
        PayloadError,
        match=r"^ObjectUsage 'x': bytes_by_device must map device keys to byte counts >= 0; got \{'cuda:0': -1\}\.$",
    ):
        obj("x", {"cuda:0": -1, "cpu:0": 4})
    with pytest.raises(
        PayloadError,
        match=r"^ObjectUsage 'x': demoted_bytes_by_device must map device keys to byte counts >= 0; "
        r"got \{'cpu:0': -2\}\.$",
    ):
        obj("x", {"cpu:0": 4}, demoted_bytes_by_device={"cpu:0": -2})
    with pytest.raises(
        PayloadError,
        match=r"^SessionUsage 's0': attrs_bytes_by_device must map device keys to byte counts >= 0; "
        r"got \{'cpu:0': -3\}\.$",
    ):
        sess("s0", obj("x", {"cpu:0": 4}), attrs_bytes_by_device={"cpu:0": -3})
    with pytest.raises(
        PayloadError, match=r"^ObjectUsage 'x': state must be 'resident', 'evicted' or 'parked'; got 'gone'\.$"
    ):
        obj("x", {"cuda:0": 1}, state="gone")
    with pytest.raises(PayloadError, match=r"^ObjectUsage 'x': recompute_cost must be >= 0; got -1\.0\.$"):
        obj("x", {"cuda:0": 1}, recompute_cost=-1.0)
    o = obj("x", {"cuda:0": 1})
    # Python's own TypeError: bytes_by_device is a read-only mappingproxy.
    with pytest.raises(TypeError, match="'mappingproxy' object does not support item assignment"):
        o.bytes_by_device["cuda:0"] = 2


_COUNTS = r"must map device keys to byte counts \(ints >= 0\); got "


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (  # a byte count is an int count: a bool is not one
            lambda: obj("x", {"cuda:0": True, "cpu:0": 4}),
            PayloadTypeError,
            rf"^ObjectUsage 'x': bytes_by_device {_COUNTS}\{{'cuda:0': True\}}\.$",
        ),
        (
            lambda: obj("x", {"cuda:0": "4"}),
            PayloadTypeError,
            rf"^ObjectUsage 'x': bytes_by_device {_COUNTS}\{{'cuda:0': '4'\}}\.$",
        ),
        *(
            (
                lambda count=count: obj("x", {"cuda:0": count}),
                PayloadTypeError,
                rf"^ObjectUsage 'x': bytes_by_device {_COUNTS}\{{'cuda:0': {count}\}}\.$",
            )
            for count in (1.5, float("nan"), float("inf"))  # a byte count is an int
        ),
        (
            lambda: obj("x", {"cpu:0": 4}, demoted_bytes_by_device={"cpu:0": None}),
            PayloadTypeError,
            rf"^ObjectUsage 'x': demoted_bytes_by_device {_COUNTS}\{{'cpu:0': None\}}\.$",
        ),
        (
            lambda: sess("s0", obj("x", {"cpu:0": 4}), attrs_bytes_by_device={"cpu:0": False}),
            PayloadTypeError,
            rf"^SessionUsage 's0': attrs_bytes_by_device {_COUNTS}\{{'cpu:0': False\}}\.$",
        ),
        (
            lambda: obj("x", {"cuda:0": 1}, recompute_cost="1"),
            PayloadTypeError,
            r"^ObjectUsage 'x': recompute_cost must be a number >= 0; got '1'\.$",
        ),
        (
            lambda: obj("x", {"cuda:0": 1}, recompute_cost=None),
            PayloadTypeError,
            r"^ObjectUsage 'x': recompute_cost must be a number >= 0; got None\.$",
        ),
        (
            lambda: obj("x", {"cuda:0": 1}, recompute_cost=float("nan")),
            PayloadError,
            r"^ObjectUsage 'x': recompute_cost must be >= 0; got nan\.$",
        ),
    ],
)
def test_inputs_tell_a_figure_of_the_wrong_type_from_a_negative_one(make, error, message):
    with pytest.raises(error, match=message) as raised:
        make()
    assert not isinstance(raised.value, TypeError if error is PayloadError else ValueError)


def test_numpy_figures_are_numbers():
    o = obj("x", {"cuda:0": np.int64(4)}, recompute_cost=np.float32(2.0))
    assert dict(o.bytes_by_device) == {"cuda:0": 4} and o.recompute_cost == 2.0


# ----------------------------------------------------------------------------- properties

KEYS = ("cuda:0", "cpu:0", "cuda:0/pinned_host", "host")


@st.composite
def scenarios(draw, max_sessions=3, max_objects=3):
    sessions = []
    for sid in range(draw(st.integers(1, max_sessions))):
        objects = []
        names = ["a", "b", "c"][: draw(st.integers(1, max_objects))]
        for i, name in enumerate(names):
            state = draw(st.sampled_from(["resident"] * 6 + ["evicted", "parked"]))
            keys = draw(
                st.lists(st.sampled_from(KEYS[:2] * 3 + KEYS[2:]), min_size=1, max_size=2, unique=True)
            )
            if state == "parked":
                keys = [k + "/pinned_host" if "/" not in k and k != "host" else k for k in keys]
            nbytes = {k: draw(st.integers(0, 12)) for k in keys}
            sources = draw(st.lists(st.sampled_from(names[:i]), unique=True)) if i else []
            objects.append(
                obj(
                    name,
                    nbytes,
                    state=state,
                    sources=tuple(sources),
                    recompute_cost=draw(st.sampled_from([0.0, 1.0, 3.0, 20.0])),
                    recomputable=draw(st.sampled_from([True, True, False])),
                )
            )
        sessions.append(
            sess(
                sid,
                *objects,
                last_used=draw(st.integers(0, 3)),
                pinned=draw(st.integers(0, 5)) == 0,
                attrs_bytes_by_device={"cuda:0": draw(st.integers(0, 2))},
            )
        )
    usage = usage_of(initial_state(sessions))
    budget_keys = draw(
        st.lists(st.sampled_from(KEYS + ("cpu:0/pinned_host",)), min_size=1, max_size=3, unique=True)
    )
    # Mostly a little under the usage, so that small plans are the common case.
    budgets = {
        k: max(0, usage.get(k, 0) - draw(st.one_of(st.integers(-2, 8), st.integers(0, 40))))
        for k in budget_keys
    }
    hypothesis.assume(over_keys(usage, budgets))
    options = dict(
        protect=draw(st.sampled_from([None, None, None, 0, 1])),
        park=draw(st.booleans()),
        host_room=draw(st.sampled_from([None, 0, 4, 8, 15])),
        allow_preempt=draw(st.sampled_from([False, False, True])),
    )
    return sessions, budgets, options


@st.composite
def conflict_scenarios(draw):
    """Dependency chains, varied costs and tight host room, no preemption:
    where the greedy pass most often blocks itself."""
    sessions = []
    for sid in range(draw(st.integers(1, 3))):
        names = ["a", "b", "c", "d"][: draw(st.integers(2, 4))]
        objects = [
            obj(
                name,
                {
                    k: draw(st.integers(1, 12))
                    for k in draw(
                        st.lists(
                            st.sampled_from(["cuda:0", "cuda:0", "cpu:0"]),
                            min_size=1,
                            max_size=2,
                            unique=True,
                        )
                    )
                },
                sources=tuple(draw(st.lists(st.sampled_from(names[:i]), min_size=1, max_size=2, unique=True)))
                if i
                else (),
                recompute_cost=draw(st.sampled_from([0.5, 1.0, 4.0, 30.0])),
                recomputable=draw(st.sampled_from([True, True, True, False])),
            )
            for i, name in enumerate(names)
        ]
        sessions.append(sess(sid, *objects, last_used=draw(st.integers(0, 2))))
    usage = usage_of(initial_state(sessions))
    budgets = {
        k: max(0, usage.get(k, 0) - draw(st.integers(-3, 25)))
        for k in draw(
            st.lists(
                st.sampled_from(["cuda:0", "cpu:0", "cuda:0/pinned_host"]),
                min_size=1,
                max_size=3,
                unique=True,
            )
        )
    }
    hypothesis.assume(over_keys(usage, budgets))
    options = dict(park=draw(st.booleans()), host_room=draw(st.sampled_from([None, 5, 9, 14])))
    return sessions, budgets, options


@hypothesis.settings(max_examples=250, deadline=None)
@hypothesis.given(st.one_of(scenarios(), conflict_scenarios()))
def test_property_plans_are_valid_fit_and_refusals_are_genuine(scenario):
    sessions, budgets, options = scenario
    result = plan(sessions, budgets=budgets, **options)
    if isinstance(result, Plan):
        hypothesis.event(f"plan with {len(result.actions)} actions")
        hypothesis.event("plan kinds: " + "+".join(sorted({type(a).__name__ for a in result.actions})))
        final = simulate(sessions, result, budgets, **options)
        assert not over_keys(final, budgets), final
    else:
        hypothesis.event("refusal")
        assert result.proven
        assert result.shortfall_by_device and all(v > 0 for v in result.shortfall_by_device.values())
        assert not brute_force_fits(sessions, budgets, **options)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.one_of(scenarios(), conflict_scenarios()), st.randoms())
def test_property_object_order_does_not_change_the_plan(scenario, rnd):
    sessions, budgets, options = scenario
    shuffled = [with_shuffled_objects(s, rnd) for s in sessions]
    assert plan(sessions, budgets=budgets, **options) == plan(shuffled, budgets=budgets, **options)


def with_shuffled_objects(s, rnd):
    objects = list(s.objects)
    rnd.shuffle(objects)
    return SessionUsage(s.session_id, tuple(objects), s.last_used, s.pinned, s.attrs_bytes_by_device)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(st.one_of(scenarios(max_sessions=4, max_objects=3), conflict_scenarios()))
def test_property_plan_exists_iff_brute_force_fits(scenario):
    sessions, budgets, options = scenario
    result = plan(sessions, budgets=budgets, **options)
    fits = brute_force_fits(sessions, budgets, **options)
    hypothesis.event("fits" if fits else "nothing fits")
    assert isinstance(result, Plan) == fits


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(scenarios(max_sessions=8, max_objects=3))
def test_property_larger_plans_are_valid_and_fit(scenario):
    sessions, budgets, options = scenario
    result = plan(sessions, budgets=budgets, **options)
    if isinstance(result, Plan):
        assert not over_keys(simulate(sessions, result, budgets, **options), budgets)
    else:
        assert result.proven


# ----------------------------------------------------------------------------- demotion


def tiered(name, nbytes, demoted, **kw):
    return ObjectUsage(name, {"d": nbytes}, demoted_bytes_by_device={"d": demoted}, **kw)


def test_demotion_comes_after_eviction_and_before_parking():
    sessions = [
        sess(
            "a", tiered("kv", 1000, 270), obj("cond", {"d": 100}, recomputable=True), obj("x", {"d": 500}), last_used=0
        ),
        sess("b", tiered("kv", 1000, 270), last_used=1),
    ]
    # 2600 held: evicting cond (100) is not enough, demoting a's kv (730) is.
    result = plan(sessions, budgets={"d": 2000}, park=True, allow_preempt=True)
    assert steps(result) == [("drop", "a", "cond"), ("demote", "a", "kv")]
    assert dict(result.usage_after) == {"d": 2600 - 100 - 730}
    assert dict(result.actions[1].freed) == {"d": 730}
    # Tighter: both kvs demoted (LRU first), then a park, never a preemption.
    result = plan(sessions, budgets={"d": 1000}, park=True, allow_preempt=True)
    assert steps(result) == [("drop", "a", "cond"), ("demote", "a", "kv"), ("demote", "b", "kv"), ("park", "a", "x")]
    assert result.usage_after["d"] == 2600 - 100 - 730 - 730 - 500


def test_demotion_takes_the_largest_saving_first_and_stops_when_it_fits():
    s = sess("a", tiered("small", 400, 100), tiered("big", 1000, 250), last_used=0)
    result = plan([s], budgets={"d": 1000})
    assert steps(result) == [("demote", "a", "big")]
    assert result.usage_after["d"] == 650


def test_demotion_prefers_least_recently_used_sessions():
    old = sess("old", tiered("kv", 1000, 250), last_used=0)
    new = sess("new", tiered("kv", 1000, 250), last_used=5)
    assert steps(plan([new, old], budgets={"d": 1500})) == [("demote", "old", "kv")]


def test_the_exact_search_demotes_where_the_greedy_order_cannot_fit():
    """Greedy demotes both kvs and then may park neither; parking one whole and demoting the other fits."""
    sessions = [sess("a", tiered("kv", 1000, 270), last_used=0), sess("b", tiered("kv", 600, 200), last_used=1)]
    budgets = {"d": 300}  # 1600 held; host room for one of them only
    for allow_preempt in (False, True):
        result = plan(sessions, budgets=budgets, park=True, host_room=1000, allow_preempt=allow_preempt)
        assert steps(result) == [("demote", "b", "kv"), ("park", "a", "kv")]
        assert dict(result.usage_after) == {"d": 1600 - 400 - 1000, "d/pinned_host": 1000}
    # Without the tiers nothing but preemption fits: the demotion is what makes the plan.
    flat = [sess(s.session_id, obj("kv", dict(s.objects[0].bytes_by_device)), last_used=s.last_used) for s in sessions]
    assert isinstance(plan(flat, budgets=budgets, park=True, host_room=1000), Refusal)
    assert any(isinstance(a, PreemptSession)
               for a in plan(flat, budgets=budgets, park=True, host_room=1000, allow_preempt=True).actions)


def test_pinned_protected_and_non_resident_objects_are_never_demoted():
    sessions = [
        sess("pinned", tiered("kv", 1000, 250), last_used=0, pinned=True),
        sess("parked", tiered("kv", 1000, 250, state="parked"), last_used=1),
        sess("me", tiered("kv", 1000, 250), last_used=2),
    ]
    result = plan(sessions, budgets={"d": 1500}, protect="me")
    assert isinstance(result, Refusal) and result.shortfall_by_device["d"] == 3000 - 1500


def test_a_demotion_that_saves_nothing_is_not_taken_and_preemption_counts_demoted_bytes():
    same = sess("a", tiered("kv", 1000, 1000), last_used=0)
    assert isinstance(plan([same], budgets={"d": 900}), Refusal)
    sessions = [sess("a", tiered("kv", 1000, 250), last_used=0), sess("b", obj("x", {"d": 1000}), last_used=1)]
    result = plan(sessions, budgets={"d": 200}, allow_preempt=True)
    # a is demoted, then still too much: preempting a frees only its demoted 250, so b goes too.
    assert [type(a) for a in result.actions] == [PreemptSession, PreemptSession]
    assert result.usage_after.get("d", 0) == 0


@hypothesis.given(
    st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 2000)), min_size=1, max_size=5),
    st.integers(0, 6000),
)
def test_demotions_are_counted_exactly_and_only_while_over_budget(sizes, budget):
    objects = tuple(tiered(f"o{i}", b, min(d, b)) for i, (b, d) in enumerate(sizes))
    result = plan([sess("a", *objects)], budgets={"d": budget})
    before = sum(b for b, _ in sizes)
    best = before - sum(b - min(d, b) for b, d in sizes)
    if best > budget:
        assert isinstance(result, Refusal)
        return
    assert isinstance(result, Plan)
    assert all(isinstance(a, DemoteObject) for a in result.actions)
    freed = sum(a.freed.get("d", 0) for a in result.actions)
    assert result.usage_after.get("d", 0) == before - freed <= budget
    if result.actions:  # the last demotion was needed: without it the key was over
        assert before - freed + result.actions[-1].freed["d"] > budget
