"""Buffers several objects read, in one session or in several: counted once, never parked twice, freed honestly."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.accounting import tree_storages
from tests.manager.frozen import assert_frozen, frozen_state
from tests.support.devices import DEVICE, PINNED


def fixed(seed: int, width: int = 256) -> jss.FixedState:
    value = jnp.asarray(np.random.default_rng(seed).normal(size=(1, width)), jnp.float32)
    return jss.FixedState.allocate(shapes=(1, width)).commit(value)


def manager(**kw):
    events = []
    return jss.SessionStateManager(on_event=events.append, **kw), events


def kinds(events):
    return [(e.kind, e.session_id, e.object_name) for e in events]


def test_a_buffer_two_objects_of_one_session_hold_counts_once():
    c = fixed(1)  # 2049 bytes
    m, events = manager(byte_budget={DEVICE: 3000})
    m.create("s1", jss.Session(objects={"h": fixed(0)}))
    m.create("s2", jss.Session(objects={"a": c, "b": c}))  # one buffer under two names: parking s1 makes room
    assert kinds(events) == [("park", "s1", "h")]
    assert m.nbytes_by_device() == {DEVICE: c.nbytes, PINNED: c.nbytes}
    np.testing.assert_array_equal(np.asarray(m.get("s2")["b"].view()), np.asarray(c.view()))


def test_a_session_whose_objects_share_a_buffer_is_never_parked_twice():
    c = fixed(1)
    m, events = manager(byte_budget={DEVICE: 9000})
    m.create("s1", jss.Session(objects={"a": c, "b": c}))
    big = jss.Session(objects={"h": fixed(2, 900)})  # 7201 bytes
    m.create("s2", big)
    # Parking "a" or "b" alone would copy the buffer to host and free nothing: s1 goes whole, its buffer once.
    assert kinds(events) == [("preempt", "s1", None)]
    assert events[0].bytes_by_device == {DEVICE: c.nbytes}
    assert m.nbytes_by_device() == {DEVICE: big.nbytes}


def shared_pair():
    """Two objects of the same spec, the second holding the first's other buffers: only the values differ."""
    first = fixed(0)
    second = first.replace(value=jnp.asarray(np.random.default_rng(1).normal(size=(1, 256)), jnp.float32))
    shared = set(tree_storages(first)) & set(tree_storages(second))
    assert shared and all(nbytes < first.nbytes for _, _, nbytes in shared)
    return first, second


def test_an_object_sharing_a_buffer_with_another_session_is_not_parked_past_the_host_budget():
    first, second = shared_pair()
    both = sum(nbytes for _, _, nbytes in set(tree_storages([first, second])))
    m, events = manager(byte_budget={DEVICE: both + 400}, host_budget=1100, evict_when_full=False)
    m.create("a", jss.Session(objects={"h": first}))
    m.create("b", jss.Session(objects={"h": second}))
    before = frozen_state(m)
    with pytest.raises(jss.BudgetExceededError):  # parking a's or b's "h" would copy all 2049 bytes to host
        m.create("c", jss.Session(objects={"h": fixed(2, 128)}))
    assert kinds(events) == [("refusal", "c", None)]
    assert_frozen(before, m)

    # An object of its own is parked instead, within the host budget.
    own = fixed(3, 128)  # 1025 bytes
    m, events = manager(byte_budget={DEVICE: both + own.nbytes + 400}, host_budget=1100)
    m.create("a", jss.Session(objects={"h": first}))
    m.create("b", jss.Session(objects={"h": second}))
    m.create("d", jss.Session(objects={"h": own}))
    m.create("c", jss.Session(objects={"h": fixed(2, 128)}))
    assert kinds(events) == [("park", "d", "h")]
    assert m.nbytes_by_device()[PINNED] == own.nbytes <= 1100
    for sid, obj in (("a", first), ("b", second)):
        np.testing.assert_array_equal(np.asarray(m.get(sid)["h"].view()), np.asarray(obj.view()))


def test_a_preemption_reports_the_bytes_it_freed():
    c = fixed(0)
    m, events = manager(max_sessions=2)
    m.create("a", jss.Session(objects={"h": c, "own": fixed(1, 4)}))
    m.create("b", jss.Session(objects={"h": c}))  # reads a's "h"
    before = m.nbytes_by_device()
    m.create("c", jss.Session(objects={"h": fixed(2, 4)}))  # preempts "a" at the count cap
    assert kinds(events) == [("preempt", "a", None)]
    freed = before[DEVICE] - (m.nbytes_by_device()[DEVICE] - fixed(2, 4).nbytes)
    assert events[0].bytes_by_device == {DEVICE: freed} == {DEVICE: fixed(1, 4).nbytes}  # not "h": b reads it
    np.testing.assert_array_equal(np.asarray(m.get("b")["h"].view()), np.asarray(c.view()))
