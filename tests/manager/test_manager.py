"""SessionStateManager: the reference design's scenarios, byte budgets, restores, errors and events."""

import gc
import threading

import jax
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.manager import _manager as _manager_module
from tests.manager.frozen import assert_frozen, frozen_state
from tests.support.devices import DEVICE, PINNED
from tests.support.world import (
    TRACES,
    _step as world_step,
    assert_same,
    contents,
    make_session,
    recompute_cond,
    session_bytes,
    step,
)

SIZES = session_bytes()
ONE = SIZES["session"]


def manager(**kw):
    events = []
    m = jss.SessionStateManager(on_event=events.append, **kw)
    m.register_recompute("cond", recompute_cond)
    return m, events


def kinds(events):
    return [(e.kind, e.session_id, e.object_name) for e in events]


# ----------------------------------------------------------- reference design's scenarios
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_sessions": 0}, jss.PayloadError, r"max_sessions must be >= 1; got 0\."),
        ({"max_sessions": True}, jss.PayloadTypeError, r"max_sessions must be an int >= 1; got True\."),
        ({"max_sessions": 2.0}, jss.PayloadTypeError, r"max_sessions must be an int >= 1; got 2\.0\."),
        ({"byte_budget": {"cpu:0": -1}}, jss.PayloadError, r"byte_budget\['cpu:0'\] must be >= 0; got -1\."),
        ({"byte_budget": {"cpu:0": "1GB"}}, jss.PayloadTypeError, r"byte_budget\['cpu:0'\] must be an int"),
        ({"byte_budget": {0: 100}}, jss.PayloadTypeError, r"byte_budget is keyed by device keys.*got the key 0\."),
        ({"host_budget": -5}, jss.PayloadError, r"host_budget must be >= 0; got -5\."),
        ({"host_budget": 1.5}, jss.PayloadTypeError, r"host_budget must be an int >= 0; got 1\.5\."),
        ({"park_memory_kind": "device"}, jss.PayloadError, r"park_memory_kind is 'pinned_host' or None; got 'device'"),
        ({"evict_when_full": "no"}, jss.PayloadTypeError, r"evict_when_full must be True or False; got 'no'\."),
        ({"on_event": "log"}, jss.PayloadTypeError, r"on_event must be callable .* or None; got str 'log'\."),
        ({"agreement_timeout": float("inf")}, jss.PayloadError, r"agreement_timeout must be a finite number"),
        ({"agreement_timeout": -1.0}, jss.PayloadError, r"agreement_timeout must be >= 0; got -1\.0\."),
    ],
)
def test_constructor_arguments_are_checked_and_named(kwargs, error, message):
    with pytest.raises(error, match=r"^SessionStateManager: " + message):
        jss.SessionStateManager(**kwargs)


def test_numpy_integer_limits_are_taken_as_ints():
    manager = jss.SessionStateManager(max_sessions=np.int64(2), evict_when_full=False, host_budget=np.int64(0))
    manager.create("a", make_session(0))
    manager.create("b", make_session(1))
    with pytest.raises(jss.SessionAdmissionError, match=r"max_sessions=2\b"):
        manager.create("c", make_session(2))
    assert sorted(manager.held()) == ["a", "b"]


def test_count_cap_of_three_with_five_sessions():
    m, events = manager(max_sessions=3)
    sessions = {f"s{i}": make_session(i) for i in range(5)}
    for sid, session in sessions.items():
        m.create(sid, session)
    assert len(m) == 3 and [sid for sid in sessions if sid in m] == ["s2", "s3", "s4"]
    assert kinds(events) == [("preempt", "s0", None), ("preempt", "s1", None)]
    assert "count cap" in events[0].reason and events[0].bytes_by_device == {DEVICE: ONE}
    with pytest.raises(jss.SessionStateLostError, match=r"'s0' is gone: preempted at the count cap"):
        m.get("s0")
    assert_same(m.get("s2"), sessions["s2"])
    assert m.stats()["preemptions"] == 2 and m.nbytes_by_device() == {DEVICE: 3 * ONE}


def test_refusal_when_not_evicting_then_resident_sessions_still_served_then_admission_after_drop():
    m, events = manager(max_sessions=3, evict_when_full=False)
    sessions = {f"s{i}": make_session(i) for i in range(4)}
    for sid in ["s0", "s1", "s2"]:
        m.create(sid, sessions[sid])
    before = frozen_state(m)
    with pytest.raises(
        jss.SessionAdmissionError, match=r"cannot create session 's3'.*max_sessions=3.*evict_when_full"
    ):
        m.create("s3", sessions["s3"])
    assert "s3" not in m and kinds(events) == [("refusal", "s3", None)]
    assert_frozen(before, m)
    assert m.stats()["refusals"] == 1
    assert_same(m.get("s1"), sessions["s1"])  # a resident session is still served when full
    assert m.stats()["hits"] == 1
    assert m.release("s0") is True and m.release("s0") is False  # idempotent
    m.create("s3", sessions["s3"])  # admitted again after a drop
    assert_same(m.get("s3"), sessions["s3"])
    with pytest.raises(jss.SessionStateLostError, match=r"'s0' is gone: it was released with release\(\)"):
        m.get("s0")


def test_continuing_an_unknown_session_fails_and_creates_nothing():
    m, _ = manager()
    m.create("a", make_session(0))
    for call in (
        lambda: m.get("ghost"),
        lambda: m.put("ghost", make_session(1)),
        lambda: m.update("ghost", step),
        lambda: m.pin("ghost").__enter__(),
    ):
        with pytest.raises(
            jss.SessionStateLostError, match=r"'ghost' is unknown.*Nothing was created.*create\('ghost'"
        ):
            call()
    assert "ghost" not in m and len(m) == 1 and m.nbytes_by_device() == {DEVICE: ONE}
    assert m.stats()["misses"] == 3 and m.stats()["lookups"] == 3  # get, update and pin look up


def test_a_hundred_create_drop_cycles_leak_nothing():
    m, _ = manager(byte_budget={DEVICE: 2 * ONE})
    gc.collect()
    live = len(jax.live_arrays())
    for i in range(100):
        m.create(i % 7, make_session(i))
        m.get(i % 7)
        m.create("other", make_session(i + 1000))  # over budget: parks and drops objects of i % 7
        m.get(i % 7)
        assert m.release(i % 7) and m.release("other")
    assert len(m) == 0 and m.nbytes_by_device() == {} and m.stats()["bytes"] == {}
    assert m.nbytes_by_device() == {} and m.stats()["bytes"] == {} and len(m) == 0 and m.held() == {}
    for sid in [*range(7), "other"]:  # each released id still says why it is gone
        with pytest.raises(jss.SessionStateLostError, match=rf"{sid!r} is gone: it was released with release\(\)"):
            m.get(sid)
    gc.collect()
    assert len(jax.live_arrays()) == live


def test_only_the_last_losses_keep_their_reason(monkeypatch):
    monkeypatch.setattr(_manager_module, "LOST_REASONS_KEPT", 3)
    m, _ = manager(max_sessions=1)
    for i in range(4):
        m.create(i, make_session(i))
        assert m.release(i)
    m.create("p", make_session(4))
    m.create("q", make_session(5))  # over the count cap: preempts "p", the fifth loss

    def forgotten(sid):
        return pytest.raises(
            jss.SessionStateLostError,
            match=rf"session {sid!r} is unknown to this manager: it was never created \(or was lost longer ago "
            r"than the last 3 losses\)\. Nothing was created",
        )

    released = r"is gone: it was released with release\(\)"
    for sid in (0, 1):  # the oldest two of five losses
        with forgotten(sid):
            m.get(sid)
    for sid in (2, 3):
        with pytest.raises(jss.SessionStateLostError, match=rf"session {sid} {released}"):
            m.get(sid)
    with pytest.raises(jss.SessionStateLostError, match=r"session 'p' is gone: preempted at the count cap"):
        m.get("p")
    assert m.release("q")  # a sixth loss: 2 is forgotten, the newest three stay
    with forgotten(2):
        m.get(2)
    for sid, reason in ((3, released), ("p", "is gone: preempted at the count cap"), ("q", released)):
        with pytest.raises(jss.SessionStateLostError, match=rf"session {sid!r} {reason}"):
            m.get(sid)


def test_create_of_a_held_id_and_puts_of_other_things_are_refused():
    m, _ = manager()
    m.create("a", make_session(0))
    with pytest.raises(jss.PayloadError, match=r"create\('a'\): that session exists already"):
        m.create("a", make_session(1))
    with pytest.raises(jss.PayloadTypeError, match=r"expected a jss\.Session; got dict"):
        m.put("a", {"kv": 1})
    dead = make_session(2)
    step(dead)
    for call in (lambda: m.put("a", dead), lambda: m.create("b", dead)):
        with pytest.raises(jss.PayloadError, match=r"arrays were deleted.*Pass the step's output instead"):
            call()
    assert "b" not in m and m.nbytes_by_device() == {DEVICE: ONE}


# ------------------------------------------------------------------ budgets, drops and parks
def test_recompute_chain_drops_cond_first_parks_the_rest_and_restores_bit_for_bit():
    m, events = manager(byte_budget={DEVICE: ONE + 10})
    a = step(make_session(0))  # compiled by now
    traces = TRACES[16]
    original = contents(a)
    m.create("a", a)
    m.create("b", make_session(1))
    # Only "a" may give way; cond is recomputable (dropped first), the rest is parked, largest first.
    assert kinds(events) == [
        ("evict", "a", "cond"),
        ("park", "a", "kv"),
        ("park", "a", "prompt"),
        ("park", "a", "carry"),
    ]
    assert events[0].bytes_by_device == {DEVICE: SIZES["cond"]}
    assert f"{DEVICE} over its budget" in events[0].reason and "creating session 'b'" in events[0].reason
    held = m.held()["a"]
    assert held.evicted == {"cond"} and set(held.parked) == {"kv", "prompt", "carry"}
    assert not any(held.session[name].resident for name in ("cond", "kv", "prompt", "carry"))
    parked_bytes = SIZES["kv"] + SIZES["prompt"] + SIZES["carry"]
    assert m.nbytes_by_device() == {DEVICE: ONE + 4, PINNED: parked_bytes}
    for name in held.parked:
        leaf = jax.tree_util.tree_leaves(held.parked[name].obj)[0]
        assert leaf.sharding.memory_kind == "pinned_host"

    events.clear()
    restored = m.get("a")  # "b" makes room the same way
    assert kinds(events)[:4] == [
        ("evict", "b", "cond"),
        ("park", "b", "kv"),
        ("park", "b", "prompt"),
        ("park", "b", "carry"),
    ]
    assert sorted(kinds(events)[4:7]) == [
        ("restore", "a", "carry"),
        ("restore", "a", "kv"),
        ("restore", "a", "prompt"),
    ]
    assert kinds(events)[7:] == [("recompute", "a", "cond")]  # after its source is back
    assert contents(restored).keys() == original.keys()
    for key, value in contents(restored).items():
        assert value.tobytes() == original[key].tobytes(), key
    device = jax.devices()[0]
    for leaf in jax.tree_util.tree_leaves(restored):
        assert (
            leaf.sharding == jax.sharding.SingleDeviceSharding(device)
            and leaf.sharding.memory_kind == "device"
        )
    stats = m.stats()
    assert (stats["evictions"], stats["parks"], stats["restores"], stats["recomputes"]) == (2, 6, 3, 1)
    assert stats["bytes"] == {DEVICE: ONE + 4, PINNED: parked_bytes}
    m.put("a", step(restored))
    assert TRACES[16] == traces == 1  # the restored session is the same to jit: no retrace


def test_put_within_budget_plans_nothing_and_over_budget_refusal_changes_nothing():
    m, events = manager(byte_budget={DEVICE: 2 * ONE + 600}, park_memory_kind=None)
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    m.put("a", step(m.get("a")))
    assert events == []
    before = frozen_state(m)
    bigger = make_session(2, capacity=64)  # cond of both others could go, but not enough
    with pytest.raises(jss.BudgetExceededError, match=r"putting session 'a' does not fit.*Nothing changed"):
        m.put("a", bigger)
    assert_frozen(before, m)
    assert m.stats()["refusals"] == 1 and kinds(events) == [("refusal", "a", None)]
    assert events[0].bytes_by_device and all(v > 0 for v in events[0].bytes_by_device.values())
    m.put("a", make_session(3, capacity=28))  # 768 bytes more: fits once b's cond is dropped
    assert kinds(events)[1:] == [("evict", "b", "cond")]


def test_preemption_when_parking_is_off_and_lost_reason_names_the_budget():
    m, events = manager(byte_budget={DEVICE: 2 * ONE}, park_memory_kind=None)
    for sid in "abc":
        m.create(sid, make_session(ord(sid)))
    # Greedy drops (a's cond, then b's) come before preemption; a's drop is superseded by its preemption.
    assert kinds(events) == [("evict", "b", "cond"), ("preempt", "a", None)]
    with pytest.raises(
        jss.SessionStateLostError,
        match=rf"preempted \({DEVICE} over its budget of \d+ bytes by \d+ while creating session 'c'\)",
    ):
        m.get("a")


def test_host_budget_limits_parking():
    m, events = manager(byte_budget={DEVICE: ONE + 10}, host_budget=SIZES["kv"] - 1, evict_when_full=False)
    m.create("a", make_session(0))
    before = frozen_state(m)
    with pytest.raises(jss.BudgetExceededError, match="'b'"):  # a's kv must be parked too, and does not fit
        m.create("b", make_session(1))
    assert_frozen(before, m)
    assert "b" not in m
    m, events = manager(byte_budget={DEVICE: ONE + 10}, host_budget=SIZES["kv"] + 500)
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    m.create("c", make_session(2))  # no host room left for b's objects: b is preempted instead
    assert m.nbytes_by_device()[PINNED] == SIZES["kv"] + SIZES["prompt"] + SIZES["carry"]
    assert kinds(events)[-1] == ("preempt", "b", None)


def test_restore_that_does_not_fit_is_refused_and_leaves_the_session_parked():
    m, _ = manager(byte_budget={DEVICE: ONE + 10})
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    with m.pin("b"):
        before = frozen_state(m)
        with pytest.raises(jss.BudgetExceededError, match="restoring session 'a' does not fit"):
            m.get("a")
        after = frozen_state(m)
        assert after[0]["misses"] == before[0]["misses"] + 1  # the lookup counts; nothing else changed
        assert after[1:3] == before[1:3] and sorted(m.held()["a"].parked) == ["carry", "kv", "prompt"]
    assert_same(m.get("a"), make_session(0))


def test_pinned_sessions_are_never_touched_and_pins_nest():
    m, events = manager(byte_budget={DEVICE: 2 * ONE})
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    with m.pin("a") as session, m.pin("a"):
        assert_same(session, make_session(0))
        m.create("c", make_session(2))
        assert {e.session_id for e in events} == {"b"}
        m.put("a", step(session))  # a put inside the pin keeps the pin
        m.create("d", make_session(3))
        assert "a" not in {e.session_id for e in events}
    events.clear()
    m.create("e", make_session(4))  # a is the least recently used unpinned one now
    assert events[0].session_id == "a"


def test_events_of_a_failing_recompute_and_a_wrong_spec_leave_the_session_restorable():
    m, _ = manager(byte_budget={DEVICE: ONE + 10})
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    m.release("b")
    m.register_recompute("cond", lambda session: session["kv"])
    with pytest.raises(
        jss.PayloadError,
        match=r"recomputing 'cond' of session 'a'.*must return a resident EncodeOnceKV.*returned KVCache",
    ):
        m.get("a")
    m.register_recompute("cond", lambda session: 1 / 0)
    with pytest.raises(
        RuntimeError, match=r"recompute function raised ZeroDivisionError.*'cond' is still evicted"
    ):
        m.get("a")
    assert m.held()["a"].evicted == {"cond"}
    m.register_recompute("cond", recompute_cond, cost=3.0)
    assert_same(m.get("a"), make_session(0))


def test_objects_without_a_recompute_or_a_recompute_source_are_never_evicted():
    m = jss.SessionStateManager(byte_budget={DEVICE: ONE + 10}, park_memory_kind=None, evict_when_full=False)
    # no recompute registered for cond: it may not be evicted either
    m.register_recompute("carry", lambda session: session["carry"])  # carry declares no source: never dropped
    m.create("a", make_session(0))
    before = frozen_state(m)
    with pytest.raises(jss.BudgetExceededError, match="'b'"):
        m.create("b", make_session(1))
    assert_frozen(before, m)
    assert m.stats()["evictions"] == 0 and "b" not in m


def test_register_recompute_checks_its_arguments():
    m, _ = manager()
    with pytest.raises(jss.PayloadTypeError, match="fn must be callable"):
        m.register_recompute("cond", 3)
    with pytest.raises(jss.PayloadTypeError, match=r"name must be an object name \(a str\); got tuple \('cond',\)\."):
        m.register_recompute(("cond",), recompute_cond)
    with pytest.raises(jss.PayloadError, match="name must be an object name; got the empty string"):
        m.register_recompute("", recompute_cond)
    for bad in (
        dict(max_sessions=0),
        dict(byte_budget={DEVICE: -1}),
        dict(park_memory_kind="device"),
        dict(host_budget=-5),
    ):
        with pytest.raises(jss.PayloadError, match="SessionStateManager"):
            jss.SessionStateManager(**bad)


@pytest.mark.parametrize(
    ("cost", "error", "message"),
    [
        (-1, jss.PayloadError, r"^register_recompute\('cond'\): cost must be >= 0; got -1\.$"),
        (float("nan"), jss.PayloadError, r"^register_recompute\('cond'\): cost must be >= 0; got nan\.$"),
        ("1", jss.PayloadTypeError, r"^register_recompute\('cond'\): cost must be a number >= 0; got '1'\.$"),
        ((1,), jss.PayloadTypeError, r"^register_recompute\('cond'\): cost must be a number >= 0; got \(1,\)\.$"),
    ],
)
def test_register_recompute_tells_a_cost_of_the_wrong_type_from_a_negative_one(cost, error, message):
    m, _ = manager()
    with pytest.raises(error, match=message) as raised:
        m.register_recompute("cond", recompute_cond, cost=cost)
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)
    for cost in (None, 0, 2.5, np.float32(1.0)):  # None: the object's own recompute_cost
        m.register_recompute("cond", recompute_cond, cost=cost)


def test_an_empty_manager_is_truthy_and_contains_nothing():
    m = jss.SessionStateManager()
    assert m and len(m) == 0 and "a" not in m
    assert m.stats() == {
        "sessions": 0,
        "lookups": 0,
        "hits": 0,
        "misses": 0,
        "evictions": 0,
        "demotions": 0,
        "preemptions": 0,
        "parks": 0,
        "restores": 0,
        "recomputes": 0,
        "refusals": 0,
        "bytes": {},
    }


# -------------------------------------------------------------------------- donation hazard
def test_a_donated_session_between_get_and_put_is_left_alone():
    m, events = manager(byte_budget={DEVICE: 2 * ONE})
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    session = m.get("a")
    m.get("b")  # a is the least recently used now, and its stored copy is about to die
    new = step(session)
    assert jss._core._placement.is_donated(m.held()["a"].session) and m.held()["a"].donated
    m.create("c", make_session(2))  # must not touch a: b gives way
    assert {e.session_id for e in events} == {"b"}
    with m.pin("c"):
        with pytest.raises(jss.BudgetExceededError):  # only a could make room: refused, a not preempted
            m.create("d", make_session(3))
    assert "a" in m
    m.put("a", new)
    assert_same(m.get("a"), new)
    m.create("d", make_session(3))  # a is alive again and may give way
    assert "a" in {e.session_id for e in events}


def test_sessions_donated_after_planning_are_skipped_when_the_plan_is_prepared():
    m, events = manager(byte_budget={DEVICE: 2 * ONE})
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    session = m.get("a")
    new = step(session)  # a's stored copy is dead; only preparing a plan on it finds out
    m.get("b")
    m.create("c", make_session(2))
    assert {e.session_id for e in events} == {"b"} and "a" in m
    m.put("a", new)


def test_update_is_atomic_for_its_session_and_safe_with_donation():
    m, _ = manager()
    m.create("a", make_session(0, capacity=64))
    start = int(m.get("a").attrs["step"])

    def work():
        for _ in range(20):
            m.update("a", step)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert int(m.get("a").attrs["step"]) == start + 60  # no lost update
    assert int(m.get("a")["kv"].view().lengths[0]) == 3 + 60


def test_update_inside_its_own_fn_is_an_error_and_the_session_survives():
    m, _ = manager()
    m.create("a", make_session(0))
    with pytest.raises(RuntimeError, match=r"update\('a'\) called inside update\('a'\)"):
        m.update("a", lambda session: m.update("a", step))
    assert_same(m.get("a"), make_session(0))


def test_update_that_does_not_fit_carries_its_result():
    m, _ = manager(byte_budget={DEVICE: ONE + 10}, evict_when_full=False, park_memory_kind=None)
    m.create("a", make_session(0))
    bigger = make_session(1, capacity=64)
    with pytest.raises(jss.BudgetExceededError) as error:
        m.update("a", lambda session: bigger)
    assert error.value.session is bigger
    assert_same(m.get("a"), make_session(0))


# ------------------------------------------------------------------------------- summary
def test_summary_of_a_manager_shows_every_session_and_how_it_is_held():
    m, _ = manager(byte_budget={DEVICE: ONE + 10})
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    table = jss.summary(m)
    rows = {(row["session"], row["name"]): row for row in table.rows}
    assert {sid for sid, _ in rows} == {"a", "b"} and table.columns[:2] == ["session", "held"]
    assert rows["a", "cond"]["held"] == "evicted" and rows["a", "cond"]["resident"] is False
    assert rows["a", "kv"]["held"] == "parked" and rows["a", "kv"][PINNED] == SIZES["kv"]
    assert rows["b", "kv"]["held"] == "resident" and rows["b", "kv"][DEVICE] == SIZES["kv"]
    totals = {}
    for row in table.rows:
        for key in (DEVICE, PINNED):
            totals[key] = totals.get(key, 0) + row.get(key, 0)
    assert totals == m.nbytes_by_device()
    assert "parked" in str(table) and "evicted" in str(table)
    new = step(m.get("b"))  # b's stored copy dies until it is put back: shown, not read
    rows = [row for row in jss.summary(m).rows if row["session"] == "b"]
    assert {row["held"] for row in rows} == {"in use (donated)"} and len(rows) == 4
    m.put("b", new)
    rows = [row for row in jss.summary(m).rows if row["session"] == "b" and row["name"] != "attrs"]
    assert {row["held"] for row in rows} == {"resident"} and len(rows) == 4


def test_the_lock_comes_from_lock_factory():
    made = []

    def factory(kind=threading.RLock):
        made.append(kind())
        return made[-1]

    m = jss.SessionStateManager(lock_factory=factory, byte_budget={DEVICE: ONE + 10})
    held_while_recomputing = []

    def recompute(session):
        held_while_recomputing.append(made[0]._is_owned())
        return recompute_cond(session)

    m.register_recompute("cond", recompute)
    m.create("a", make_session(0))
    m.create("b", make_session(1))
    assert_same(m.get("a"), make_session(0))
    assert len(made) == 1 and held_while_recomputing == [True] and not made[0]._is_owned()
    plain = jss.SessionStateManager(lock_factory=lambda: factory(threading.Lock))  # not reentrant: works too
    plain.create("a", make_session(0))
    plain.update("a", step)
    assert made[1].locked() is False and int(plain.get("a").attrs["step"]) == 1


def listener_failing_on(calls):
    """An on_event that records every event and raises on the given (0-based) calls."""
    seen = []

    def listener(event):
        seen.append(event)
        if len(seen) - 1 in calls:
            raise RuntimeError(f"listener failed on {event.kind}")

    return listener, seen


def test_every_event_reaches_a_listener_that_raises_and_the_manager_is_as_if_it_had_not():
    def build(on_event):
        m = jss.SessionStateManager(byte_budget={DEVICE: 2 * ONE + 10}, host_budget=SIZES["kv"], on_event=on_event)
        m.create("a", make_session(0))
        m.create("b", make_session(1))
        return m

    calm_events = []
    calm = build(calm_events.append)
    calm_events.clear()
    calm.create("c", make_session(2, capacity=32))  # host room for one K/V: parks a's, preempts b
    assert kinds(calm_events) == [("park", "a", "kv"), ("preempt", "b", None)]
    listener, seen = listener_failing_on({0})
    m = build(listener)
    seen.clear()
    with pytest.raises(RuntimeError, match="listener failed on park"):
        m.create("c", make_session(2, capacity=32))  # the listener raises on its first call: the park
    assert kinds(seen) == kinds(calm_events)  # every event, the preemption included
    assert m.stats() == calm.stats() and list(m.held()) == list(calm.held())
    assert m.nbytes_by_device() == calm.nbytes_by_device()
    assert_same(m.get("c"), make_session(2, capacity=32))  # the create completed


def test_a_listener_raising_on_several_events_raises_them_all_together_after_the_last():
    listener, seen = listener_failing_on({0, 1, 2, 3})
    m = jss.SessionStateManager(byte_budget={DEVICE: ONE + 10}, on_event=listener)
    m.create("a", make_session(0))
    with pytest.raises(ExceptionGroup, match="on_event raised for 4 of 4 events") as raised:
        m.create("b", make_session(1))  # parks a's four objects
    assert [str(e) for e in raised.value.exceptions] == ["listener failed on park"] * 4
    assert len(seen) == 4 and m.stats()["parks"] == 4 and "b" in m


def test_a_listener_that_raises_leaves_no_pin_or_update_hold_behind():
    m = jss.SessionStateManager(byte_budget={DEVICE: ONE + 10})
    for sid in "ab":
        m.create(sid, make_session(ord(sid)))
    m.on_event, _ = listener_failing_on(set(range(100)))
    # "a" is restored, "b" parked: the listener raises on each event
    with pytest.raises(ExceptionGroup), m.pin("a"):
        pytest.fail("the block of a pin whose lookup raised must not run")
    assert not m.held()["a"].pinned
    with pytest.raises(ExceptionGroup):
        m.update("b", lambda s: pytest.fail("fn of an update whose lookup raised must not run"))
    assert m.update("b", lambda s: s) is m.get("b")  # no hold was left: the next update runs


def test_a_refusal_stays_the_error_when_the_listener_raises_too():
    listener, seen = listener_failing_on({0})
    m = jss.SessionStateManager(
        byte_budget={DEVICE: ONE + 10}, park_memory_kind=None, evict_when_full=False, on_event=listener
    )
    m.create("a", make_session(0))
    with pytest.raises(jss.BudgetExceededError) as refused:
        m.create("b", make_session(1))
    assert [e.kind for e in seen] == ["refusal"] and "b" not in m
    assert any("on_event also raised RuntimeError: listener failed on refusal" in n for n in refused.value.__notes__)


BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **kw: (
        BACKEND_COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


@pytest.mark.parametrize("recompute", [False, True], ids=["parked", "parked-and-recomputed"])
def test_parked_and_recomputed_sessions_come_back_without_a_compile(recompute):
    fresh_step = jax.jit(world_step, donate_argnums=0)
    m = jss.SessionStateManager(byte_budget={DEVICE: ONE + ONE // 2})
    if recompute:
        m.register_recompute("cond", recompute_cond)
    m.create("a", fresh_step(make_session(0)))  # uncommitted arrays, as jnp makes them
    m.create("b", fresh_step(make_session(1)))
    compiles = []
    for _cycle in range(21):  # the first cycle compiles what parks, restores and recomputes
        compiles.append(len(BACKEND_COMPILES))
        for sid in "ab":  # each get brings one session back and parks (or evicts) the other
            m.put(sid, fresh_step(m.get(sid)))
    stats = m.stats()
    assert stats["restores"] >= 20 and (stats["recomputes"] >= 20) is recompute
    assert compiles[1] == compiles[-1] == len(BACKEND_COMPILES)  # no compile after: one executable for the step


