"""A demotion or a recompute that fails while the manager makes room changes nothing: every action or none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from tests.manager.frozen import assert_frozen, frozen_state
from tests.support.devices import DEVICE

FAILING = {"demote": False}


def _quarter(items: np.ndarray) -> np.ndarray:
    if FAILING["demote"]:
        raise MemoryError("out of memory while demoting")
    return items[..., ::4]


def demote_frames(item: jax.Array) -> jax.Array:
    """Every fourth value of a frame, on the host: fails, when FAILING says so, only once it runs."""
    return jax.pure_callback(_quarter, jax.ShapeDtypeStruct((4,), item.dtype), item, vmap_method="sequential")


def tiered_session(seed: int) -> jss.Session:
    """Random data in a recomputable cond, its prompt, and frames that demote through ``demote_frames``."""
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.normal(size=(1, 4)), jnp.float32)
    cond = jss.FixedState.allocate(shapes=(1, 64), recompute_source=("prompt",)).commit(jnp.tile(prompt, 16))
    frames = jss.LatentBuffer.allocate(capacity=8, item_shape=(16,), demote_fn=demote_frames)
    frames = frames.append(jnp.asarray(rng.normal(size=(5, 16)), jnp.float32))
    prompt_state = jss.FixedState.allocate(shapes=(1, 4)).commit(prompt)
    return jss.Session(objects={"prompt": prompt_state, "cond": cond, "frames": frames})


def recompute_cond(session: jss.Session) -> jss.FixedState:
    return session["cond"].empty().commit(jnp.tile(session["prompt"].view(), 16))


def carry(seed: int, width: int) -> jss.Session:
    value = jnp.asarray(np.random.default_rng(seed).normal(size=(1, width)), jnp.float32)
    return jss.Session(objects={"h": jss.FixedState.allocate(shapes=(1, width)).commit(value)})


def test_a_demotion_that_fails_leaves_every_session_as_it_was(monkeypatch):
    a, b = tiered_session(0), carry(1, 100)
    budget = a.nbytes - a["cond"].nbytes + b.nbytes - 8  # evicting cond is 8 bytes short: frames are demoted too
    events = []
    m = jss.SessionStateManager(
        byte_budget={DEVICE: budget}, park_memory_kind=None, evict_when_full=False, on_event=events.append
    )
    m.register_recompute("cond", recompute_cond)
    frames = np.asarray(a["frames"].view().materialize())
    m.create("a", a)
    before = frozen_state(m)
    monkeypatch.setitem(FAILING, "demote", True)
    with pytest.raises(jax.errors.JaxRuntimeError, match="out of memory while demoting") as failure:
        m.create("b", b)
    assert any("demoting 'frames' of session 'a'" in note for note in failure.value.__notes__)
    assert events == [] and "b" not in m
    assert_frozen(before, m)  # "cond" still resident: the plan's eviction was not applied either

    monkeypatch.setitem(FAILING, "demote", False)  # the same plan goes through once the demotion works
    m.create("b", b)
    assert [(e.kind, e.object_name) for e in events] == [("evict", "cond"), ("demote", "frames")]
    demoted = m.held()["a"].session["frames"]  # held as it is: a lookup would need cond back, which does not fit
    np.testing.assert_array_equal(np.asarray(demoted.view().materialize()), frames[..., ::4])


def test_a_recompute_that_fails_on_a_lookup_makes_no_room_first():
    events, calls = [], []

    def recompute(session):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("encoder offline")
        return recompute_cond(session)

    a = tiered_session(0)
    m = jss.SessionStateManager(
        byte_budget={DEVICE: a.nbytes + 8}, park_memory_kind=None, on_event=events.append
    )
    m.register_recompute("cond", recompute)
    m.create("a", a)
    m.create("b", carry(1, 64))  # as large as a's cond, which is evicted
    assert [(e.kind, e.session_id) for e in events] == [("evict", "a")]
    before = frozen_state(m, uncounted=("refusals", "lookups", "misses"))
    with pytest.raises(RuntimeError, match="encoder offline"):
        m.get("a")  # its restore needs b preempted: not before the recompute succeeds
    assert len(events) == 1 and "b" in m
    assert_frozen(before, m, uncounted=("refusals", "lookups", "misses"))

    restored = m.get("a")  # the recompute works now: b goes, cond comes back
    assert [(e.kind, e.session_id) for e in events[1:]] == [("preempt", "b"), ("recompute", "a")]
    np.testing.assert_array_equal(np.asarray(restored["cond"].view()), np.asarray(a["cond"].view()))
    assert m.nbytes_by_device() == {DEVICE: a.nbytes}


def test_a_recompute_function_that_changes_the_table_gets_a_fresh_plan():
    events = []
    a = tiered_session(0)
    m = jss.SessionStateManager(byte_budget={DEVICE: a.nbytes + 8}, park_memory_kind=None, on_event=events.append)

    def recompute(session):  # runs under the manager's (reentrant) lock
        m.release("b")
        return recompute_cond(session)

    m.register_recompute("cond", recompute)
    m.create("a", a)
    m.create("b", carry(1, 64))
    m.get("a")  # planned to preempt b; b was released meanwhile, so nothing need go
    assert [(e.kind, e.session_id) for e in events] == [("evict", "a"), ("recompute", "a")]
    assert list(m.held()) == ["a"] and m.nbytes_by_device() == {DEVICE: a.nbytes}
    assert m.stats()["preemptions"] == 0
