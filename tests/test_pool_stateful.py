"""A pool joined to a manager against a plain-Python model, driven by random operations.

Sessions are created in the manager, checked out into pool slots, stepped
there (all at once) or in the manager (one at a time), checked back in;
guests that the manager never saw are inserted into and released from the
pool directly.  The model keeps, for every session, where it is and the same
session stepped alone.  After every operation: no budgeted device is over
budget and the pool's bytes are counted while it holds a checked-out
session; each session is in exactly one place (held, or checked out into the
slot the model says); a lookup of a checked-out session raises
SessionCheckedOutError and of a lost one SessionStateLostError; every pool
step's output and every session read back equal the session stepped alone.
"""

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jax_session_state as jss
from tests.support.devices import DEVICE
from tests.support.world import _step, make_session, recompute_cond, session_bytes

SLOTS, CAPACITY, MAX_STEPS = 3, 40, 30
IDS = st.sampled_from("abcde")
ONE = session_bytes(capacity=CAPACITY)["session"]
POOL_BYTES = jss.SessionPool.allocate(make_session(0, capacity=CAPACITY), slots=SLOTS).nbytes_by_device()[DEVICE]


def pool_step(session: jss.Session) -> tuple[jss.Session, jax.Array]:
    """One step of one session; its output is the new carry (the session's frame)."""
    session = _step(session)
    return session, session["carry"].view()["h"]


step_pool = jax.jit(lambda pool: pool.map(pool_step), donate_argnums=0)
step_alone = jax.jit(pool_step)
insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
release = jax.jit(jss.SessionPool.release, donate_argnums=0)
step_held = jax.jit(_step)  # not donating: a refused put leaves the stored session intact


def close(got, want) -> bool:
    """Equal structure and, leaf for leaf, values within 1e-5 of the larger (exact for integers)."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        return False
    for a, b in zip(got_leaves, want_leaves):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if np.issubdtype(a.dtype, np.floating):
            if np.max(np.abs(a - b), initial=0.0) > 1e-5 * max(np.max(np.abs(b), initial=0.0), 1e-30):
                return False
        elif not np.array_equal(a, b):
            return False
    return True


class PoolManagerMachine(RuleBasedStateMachine):
    @initialize(evict=st.booleans(), park=st.booleans(), room=st.integers(ONE // 2, 3 * ONE),
                max_sessions=st.integers(2, 5))
    def setup(self, evict, park, room, max_sessions):
        self.events = []
        self.budget = POOL_BYTES + room
        self.manager = jss.SessionStateManager(
            max_sessions=max_sessions, byte_budget={DEVICE: self.budget}, evict_when_full=evict,
            park_memory_kind="pinned_host" if park else None, on_event=self.events.append,
        )
        self.manager.register_recompute("cond", recompute_cond)
        self.pool = jss.SessionPool.allocate(make_session(0, capacity=CAPACITY), slots=SLOTS)
        self.alone = {}  # sid or ("guest", slot) -> the session stepped alone
        self.steps = {}  # the same keys -> steps taken
        self.slot_of = {}  # sid -> slot, for checked-out sessions
        self.guests = set()  # slots holding guests
        self.lost = set()
        self.read = 0
        self.seed = 1

    # -------------------------------------------------------------- helpers
    def absorb_events(self):
        for event in self.events[self.read:]:
            if event.kind == "preempt":
                assert event.session_id not in self.slot_of, "a checked-out session was preempted"
                self.alone.pop(event.session_id)
                self.steps.pop(event.session_id)
                self.lost.add(event.session_id)
        self.read = len(self.events)

    def free_slots(self):
        return [s for s in range(SLOTS) if s not in self.slot_of.values() and s not in self.guests]

    def held(self):
        return [sid for sid in self.alone if isinstance(sid, str) and sid not in self.slot_of]

    # ---------------------------------------------------------------- rules
    @rule(sid=IDS)
    def create(self, sid):
        if sid in self.alone:
            with pytest.raises(
                (jss.PayloadError, jss.SessionCheckedOutError), match=rf"'{sid}'.*(exists already|is checked out)"
            ):
                self.manager.create(sid, make_session(self.seed, capacity=CAPACITY))
            return
        session = make_session(self.seed, capacity=CAPACITY)
        self.seed += 1
        try:
            self.manager.create(sid, session.fork())
        except (jss.BudgetExceededError, jss.SessionAdmissionError):
            self.absorb_events()
            return
        self.absorb_events()
        self.alone[sid], self.steps[sid] = session, 0
        self.lost.discard(sid)

    @rule(data=st.data())
    def checkout(self, data):
        held, free = self.held(), self.free_slots()
        if not held or not free:
            return
        sid, slot = data.draw(st.sampled_from(held)), data.draw(st.sampled_from(free))
        try:
            self.pool = self.manager.checkout(sid, self.pool, slot)
        except jss.BudgetExceededError:
            self.absorb_events()
            assert sid in self.manager and slot in self.free_slots()
            return
        self.absorb_events()
        self.slot_of[sid] = slot

    @rule(data=st.data())
    def checkin(self, data):
        if not self.slot_of:
            return
        sid = data.draw(st.sampled_from(sorted(self.slot_of)))
        wrong = [s for s in range(SLOTS) if s != self.slot_of[sid]]
        with pytest.raises(jss.PayloadError, match="checked out into slot"):
            self.manager.checkin(sid, self.pool, wrong[0])
        try:
            self.pool = self.manager.checkin(sid, self.pool, self.slot_of[sid])
        except (jss.BudgetExceededError, jss.SessionAdmissionError):
            self.absorb_events()
            assert sid in self.manager.checked_out() and bool(self.pool.active[self.slot_of[sid]])
            return
        self.absorb_events()
        del self.slot_of[sid]

    @rule(data=st.data())
    def insert_guest(self, data):
        free = self.free_slots()
        if not free:
            return
        slot = data.draw(st.sampled_from(free))
        guest = make_session(1000 + self.seed, capacity=CAPACITY)
        self.seed += 1
        self.pool = insert(self.pool, slot, guest)
        self.guests.add(slot)
        self.alone[("guest", slot)], self.steps[("guest", slot)] = guest, 0

    @rule(data=st.data())
    def release_guest(self, data):
        if not self.guests:
            return
        slot = data.draw(st.sampled_from(sorted(self.guests)))
        assert close(self.pool.extract(slot), self.alone.pop(("guest", slot)))
        self.steps.pop(("guest", slot))
        self.pool = release(self.pool, slot)
        self.guests.discard(slot)

    @precondition(lambda self: all(n < MAX_STEPS for n in self.steps.values()))
    @rule()
    def step_the_pool(self):
        self.pool, out = step_pool(self.pool)
        in_pool = {slot: sid for sid, slot in self.slot_of.items()} | {s: ("guest", s) for s in self.guests}
        for slot, key in in_pool.items():
            self.alone[key], frame = step_alone(self.alone[key])
            self.steps[key] += 1
            assert close(out[slot], frame), f"slot {slot}: the pool's frame differs from the session's alone"
        for slot in set(range(SLOTS)) - set(in_pool):
            assert not np.any(np.asarray(out[slot]))

    @rule(sid=IDS)
    def step_in_the_manager(self, sid):
        if sid in self.slot_of:
            with pytest.raises(jss.SessionCheckedOutError, match=f"slot {self.slot_of[sid]}"):
                self.manager.update(sid, step_held)
            return
        if sid not in self.alone:
            with pytest.raises(jss.SessionStateLostError):
                self.manager.get(sid)
            return
        if self.steps[sid] >= MAX_STEPS:
            return
        try:
            self.manager.update(sid, step_held)
        except jss.BudgetExceededError:  # restoring it or its result did not fit: nothing changed
            self.absorb_events()
            return
        self.absorb_events()
        self.alone[sid], _ = step_alone(self.alone[sid])
        self.steps[sid] += 1

    @rule(sid=IDS)
    def look_up(self, sid):
        if sid in self.slot_of:
            with pytest.raises(jss.SessionCheckedOutError):
                self.manager.get(sid)
            with pytest.raises(jss.SessionCheckedOutError):
                self.manager.release(sid)
            assert close(self.pool.extract(self.slot_of[sid]), self.alone[sid])
        elif sid in self.alone:
            try:
                got = self.manager.get(sid)
            except jss.BudgetExceededError:
                self.absorb_events()
                return
            self.absorb_events()
            assert close(got, self.alone[sid]), f"session {sid!r} differs from the same session stepped alone"
        else:
            with pytest.raises(jss.SessionStateLostError):
                self.manager.get(sid)

    # ----------------------------------------------------------- invariants
    @invariant()
    def budget_holds_and_counts_the_pool(self):
        held = self.manager.nbytes_by_device().get(DEVICE, 0)
        assert held <= self.budget
        if self.slot_of:
            assert held >= POOL_BYTES

    @invariant()
    def each_session_is_in_one_place(self):
        out = self.manager.checked_out()
        assert {sid: slot for sid, (_, slot) in out.items()} == self.slot_of
        for sid in self.alone:
            if isinstance(sid, str):
                assert (sid in self.manager) != (sid in self.slot_of)
        assert set(self.pool.active_slots()) == set(self.slot_of.values()) | self.guests
        assert all(sid not in self.manager and sid not in out for sid in self.lost)


PoolManagerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_pool_and_manager = PoolManagerMachine.TestCase


def test_checkout_refuses_a_pool_that_does_not_fit_and_changes_nothing():
    manager = jss.SessionStateManager(byte_budget={DEVICE: POOL_BYTES // 2}, park_memory_kind=None,
                                      evict_when_full=False)
    manager.create("a", make_session(1, capacity=CAPACITY))
    pool = jss.SessionPool.allocate(make_session(0, capacity=CAPACITY), slots=SLOTS)
    before = manager.nbytes_by_device()
    with pytest.raises(jss.BudgetExceededError, match="checking out session 'a'"):
        manager.checkout("a", pool, 0)
    assert manager.nbytes_by_device() == before and "a" in manager and pool.active_slots() == []
    assert close(manager.get("a"), make_session(1, capacity=CAPACITY))


def test_checkout_restores_dropped_and_parked_objects_first(tmp_path):
    budget = 2 * ONE + ONE // 2  # two and a half sessions, or a pool of two slots and some room
    manager = jss.SessionStateManager(byte_budget={DEVICE: budget})
    manager.register_recompute("cond", recompute_cond)
    for i, sid in enumerate("abc"):
        manager.create(sid, make_session(i + 1, capacity=CAPACITY))
    held = manager.held()
    assert held["a"].parked or held["a"].evicted  # "a" gave way
    pool = jss.SessionPool.allocate(make_session(0, capacity=CAPACITY), slots=2)
    pool = manager.checkout("a", pool, 1)
    assert close(pool.extract(1), make_session(1, capacity=CAPACITY))
    assert pool.nbytes_by_device()[DEVICE] <= manager.nbytes_by_device()[DEVICE] <= budget
    with pytest.raises(jss.SessionCheckedOutError, match="checkin"):
        manager.create("a", make_session(1, capacity=CAPACITY))
    with pytest.raises(jss.PayloadError, match="holds a live session"):
        manager.checkout("b", pool, 1)
    manager.create("d", make_session(4, capacity=8))
    with pytest.raises(jss.PayloadError, match=r"object 'kv' is KVCache\(.*capacity=8"):
        manager.checkout("d", pool, 0)
    assert "d" in manager and manager.checked_out().keys() == {"a"}
    with pytest.raises(jss.CheckpointError, match="checked out"):
        jss.checkpoint.save(tmp_path / "manager", manager)


def test_threads_checking_out_and_in_never_lose_a_session():
    import threading

    manager = jss.SessionStateManager(byte_budget={DEVICE: POOL_BYTES + 4 * ONE})
    manager.register_recompute("cond", recompute_cond)
    sessions = {sid: make_session(i + 1, capacity=CAPACITY) for i, sid in enumerate("abcdef")}
    for sid, session in sessions.items():
        manager.create(sid, session.fork())
    state = {"pool": jss.SessionPool.allocate(make_session(0, capacity=CAPACITY), slots=SLOTS)}
    pool_lock = threading.Lock()  # the pool value is the caller's: one writer at a time
    errors = []

    def worker(sid, slot):
        try:
            for _ in range(5):
                with pool_lock:
                    state["pool"] = manager.checkout(sid, state["pool"], slot)
                    lent = state["pool"].extract(slot)
                assert manager.checked_out()[sid][1] == slot
                assert close(lent, sessions[sid])
                with pool_lock:
                    state["pool"] = manager.checkin(sid, state["pool"], slot)
                assert close(manager.get(sid), sessions[sid])
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(sid, i % SLOTS)) for i, sid in enumerate("abc")]
    threads += [threading.Thread(target=lambda sid=sid: [manager.get(sid) for _ in range(10)]) for sid in "def"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert manager.checked_out() == {} and len(manager) == 6
    assert manager.nbytes_by_device()[DEVICE] <= POOL_BYTES + 4 * ONE

