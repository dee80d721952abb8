"""A manager's snapshot loads into a manager holding the same sessions the same way: parked objects stay parked."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from tests.support.devices import DEVICE, PINNED


def carry(seed: int) -> jss.Session:
    value = jnp.asarray(np.random.default_rng(seed).normal(size=(4,)), jnp.float32)
    return jss.Session(objects={"h": jss.FixedState.allocate(shapes=(4,)).commit(value)})


def memory_kinds(session: jss.Session) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(session)}


def test_loading_a_snapshot_keeps_parked_objects_parked_and_a_lookup_copies_them_back():
    sessions = {sid: carry(seed) for seed, sid in enumerate("ab")}
    values = {sid: np.asarray(session["h"].view()) for sid, session in sessions.items()}
    original = jss.SessionStateManager(byte_budget={DEVICE: 40})  # room for one carry of 33 bytes
    for sid, session in sessions.items():
        original.create(sid, session)
    assert sorted(original.held()["a"].parked) == ["h"]
    snapshot = original.snapshot()
    assert sorted(snapshot.sessions[0].parked) == ["h"] and dict(snapshot.sessions[1].parked) == {}

    events = []
    copy = jss.SessionStateManager.from_snapshot(snapshot, on_event=events.append)
    held = copy.held()
    assert list(held) == ["a", "b"] and sorted(held["a"].parked) == ["h"] and held["b"].parked == {}
    assert held["a"].parked["h"].placement == original.held()["a"].parked["h"].placement
    assert copy.nbytes_by_device() == original.nbytes_by_device() == {DEVICE: 33, PINNED: 33}
    assert events == [] and copy.stats()["parks"] == 0

    for manager in (copy, original):  # the same lookups, the same results
        restored = manager.get("a")
        assert memory_kinds(restored) == {jax.devices()[0].default_memory().kind}
        np.testing.assert_array_equal(np.asarray(restored["h"].view()), values["a"])
        assert sorted(manager.held()["b"].parked) == ["h"]
        assert manager.nbytes_by_device() == {DEVICE: 33, PINNED: 33}
    assert [(e.kind, e.session_id) for e in events] == [("park", "b"), ("restore", "a")]
    np.testing.assert_array_equal(np.asarray(copy.get("b")["h"].view()), values["b"])
