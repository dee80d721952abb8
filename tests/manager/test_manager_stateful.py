"""The manager against a plain model of its rules, driven by random operations.

After every step: no budgeted device is over budget; the byte totals equal a
recount of what is held; every session the model holds is held, and each of
its objects is resident and equal to the model, parked and equal, or dropped
(and recomputed equal on the next lookup); every session the manager lost was
reported through ``on_event`` and raises SessionStateLostError.
"""

import contextlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import jax_session_state as jss
from tests.support.devices import DEVICE, PINNED
from tests.support.world import contents, make_session, recompute_cond, session_bytes, step

IDS = st.sampled_from("abcd")
CAPACITIES = st.sampled_from([8, 16, 32])
ONE = session_bytes()["session"]


def object_contents(session):
    return {
        "attrs": contents(session.attrs),
        **{name: contents(obj) for name, obj in session.objects.items()},
    }


def equal(left, right):
    return left.keys() == right.keys() and all(
        left[k].dtype == right[k].dtype and left[k].tobytes() == right[k].tobytes() for k in left
    )


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        evict=st.booleans(),
        park=st.booleans(),
        budget=st.integers(ONE + 100, 3 * ONE),
        max_sessions=st.integers(2, 4),
        host_budget=st.sampled_from([None, ONE, 2 * ONE]),
    )
    def setup(self, evict, park, budget, max_sessions, host_budget):
        self.events = []
        self.budget = budget
        self.manager = jss.SessionStateManager(
            max_sessions=max_sessions,
            byte_budget={DEVICE: budget},
            evict_when_full=evict,
            park_memory_kind="pinned_host" if park else None,
            host_budget=host_budget,
            on_event=self.events.append,
        )
        self.manager.register_recompute("cond", recompute_cond)
        self.max_sessions = max_sessions
        self.model = {}  # sid -> {object name: contents}
        self.held_as = {}  # sid -> {object name: "parked" / "evicted"}, from events only
        self.lost = {}  # sid -> "released" (by the caller) or "preempted" (reported)
        self.pins = {}  # sid -> open pin contexts
        self.read = 0

    # -------------------------------------------------------------- helpers
    def absorb_events(self):
        for event in self.events[self.read :]:
            assert event.kind in ("evict", "park", "restore", "recompute", "preempt", "refusal")
            sid, name = event.session_id, event.object_name
            if event.kind == "preempt":
                assert not self.pins.get(sid), "a pinned session was preempted"
                self.model.pop(sid)
                self.held_as.pop(sid)
                self.lost[sid] = "preempted"
            elif event.kind in ("evict", "park"):
                assert name not in self.held_as[sid] and event.bytes_by_device
                self.held_as[sid][name] = {"evict": "evicted", "park": "parked"}[event.kind]
            elif event.kind in ("restore", "recompute"):
                assert self.held_as[sid].pop(name) == {"restore": "parked", "recompute": "evicted"}[event.kind]
        self.read = len(self.events)

    def stored(self, sid, expected):
        self.model[sid] = expected
        self.held_as[sid] = {}

    def frozen(self):
        stats = self.manager.stats()
        stats.pop("refusals")
        return stats, self.manager.nbytes_by_device(), list(self.manager.held())

    def refused(self, before, error):
        """A refusal: one refusal event, nothing else changed."""
        assert self.events[self.read :] and self.events[-1].kind == "refusal"
        assert self.events[-1].reason == str(error)
        self.absorb_events()
        assert self.frozen() == before

    def lookup(self, sid, call):
        """Runs a lookup of a model-held session; a refused restore changes nothing but the miss count."""
        before = self.frozen()
        try:
            return call()
        except jss.BudgetExceededError as error:
            before[0]["misses"] += 1
            before[0]["lookups"] += 1
            self.refused(before, error)
            return None

    # ---------------------------------------------------------------- rules
    @rule(sid=IDS, capacity=CAPACITIES, seed=st.integers(0, 10_000))
    def create(self, sid, capacity, seed):
        session = make_session(seed, capacity=capacity)
        expected = object_contents(session)
        before = self.frozen()
        try:
            self.manager.create(sid, session)
        except ValueError as error:
            assert sid in self.model and "exists already" in str(error)
            return
        except (jss.SessionAdmissionError, jss.BudgetExceededError) as error:
            assert sid not in self.manager
            self.refused(before, error)
            return
        self.absorb_events()
        self.stored(sid, expected)
        self.lost.pop(sid, None)

    @rule(sid=IDS)
    def get(self, sid):
        if sid not in self.model:
            self.assert_lost(sid)
            return
        session = self.lookup(sid, lambda: self.manager.get(sid))
        self.absorb_events()
        if session is not None:
            assert equal_sessions(object_contents(session), self.model[sid])

    @rule(sid=IDS)
    def step_and_put(self, sid):
        if sid not in self.model:
            self.assert_lost(sid)
            return
        session = self.lookup(sid, lambda: self.manager.get(sid))
        self.absorb_events()
        if session is None:
            return
        new = step(session)  # donates the stored copy's arrays
        expected = object_contents(new)
        self.manager.put(sid, new)  # same sizes: never over budget
        self.absorb_events()
        self.stored(sid, expected)

    @rule(sid=IDS, capacity=CAPACITIES, seed=st.integers(0, 10_000))
    def put_resized(self, sid, capacity, seed):
        session = make_session(seed, capacity=capacity)
        expected = object_contents(session)
        before = self.frozen()
        if sid not in self.model:
            with pytest.raises(jss.SessionStateLostError):
                self.manager.put(sid, session)
            return
        try:
            self.manager.put(sid, session)
        except jss.BudgetExceededError as error:
            self.refused(before, error)
            return
        self.absorb_events()
        self.stored(sid, expected)

    @rule(sid=IDS)
    def update(self, sid):
        if sid not in self.model:
            with pytest.raises(jss.SessionStateLostError):
                self.manager.update(sid, step)
            return
        new = self.lookup(sid, lambda: self.manager.update(sid, step))
        self.absorb_events()
        if new is not None:
            self.stored(sid, object_contents(new))

    @rule(sid=IDS)
    def drop(self, sid):
        assert self.manager.release(sid) is (sid in self.model)
        if sid in self.model:
            del self.model[sid], self.held_as[sid]
            self.lost[sid] = "released"
            for pin in self.pins.pop(sid, []):
                pin.close()

    @rule(sid=IDS)
    def pin(self, sid):
        if sid not in self.model:
            with pytest.raises(jss.SessionStateLostError):
                self.manager.pin(sid).__enter__()
            return
        stack = contextlib.ExitStack()
        session = self.lookup(sid, lambda: stack.enter_context(self.manager.pin(sid)))
        self.absorb_events()
        if session is not None:
            assert equal_sessions(object_contents(session), self.model[sid])
            self.pins.setdefault(sid, []).append(stack)

    @rule(sid=IDS)
    def unpin(self, sid):
        if self.pins.get(sid):
            self.pins[sid].pop().close()

    # ----------------------------------------------------------- invariants
    def assert_lost(self, sid):
        with pytest.raises(jss.SessionStateLostError) as error:
            self.manager.get(sid)
        self.read = len(self.events)
        reason = self.lost.get(sid)
        if reason == "released":
            assert "released with release()" in str(error.value)
        elif reason == "preempted":
            assert "preempted" in str(error.value)
        else:
            assert "unknown" in str(error.value)

    @invariant()
    def within_budget_and_totals_recount(self):
        if not hasattr(self, "manager"):
            return
        totals = self.manager.nbytes_by_device()
        assert totals.get(DEVICE, 0) <= self.budget
        recount = {}
        for row in jss.summary(self.manager).rows:
            for key in (DEVICE, PINNED):
                recount[key] = recount.get(key, 0) + row.get(key, 0)
        assert {k: v for k, v in recount.items() if v} == totals

    @invariant()
    def every_session_held_equal_or_reported_lost(self):
        if not hasattr(self, "manager"):
            return
        held = self.manager.held()
        assert set(held) == set(self.model) and len(self.manager) == len(self.model) <= self.max_sessions
        for sid, expected in self.model.items():
            h = held[sid]
            reported = self.held_as[sid]  # nothing parked or dropped without an event
            assert set(h.parked) == {n for n, how in reported.items() if how == "parked"}
            assert h.evicted == {n for n, how in reported.items() if how == "evicted"}
            assert not (self.pins.get(sid) and (h.parked or h.evicted)), "a pinned session was touched"
            assert equal(contents(h.session.attrs), expected["attrs"])
            for name, obj in h.session.objects.items():
                if name in h.parked:
                    assert equal(contents(h.parked[name].obj), expected[name])
                elif name in h.evicted:
                    assert not obj.resident and obj.recompute_source == ("prompt",)
                else:
                    assert equal(contents(obj), expected[name])
        for sid in self.lost:
            assert sid not in self.manager

    def teardown(self):
        for pins in self.pins.values():
            for pin in pins:
                pin.close()


def equal_sessions(left, right):
    return left.keys() == right.keys() and all(equal(left[name], right[name]) for name in left)


ManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
test_manager_rules = ManagerMachine.TestCase


def test_model_helpers_tell_sessions_apart():
    a, b = object_contents(make_session(0)), object_contents(make_session(1))
    assert equal_sessions(a, a) and not equal_sessions(a, b)
    assert not equal({"x": np.zeros(2, np.float32)}, {"x": np.zeros(2, np.float64)})
