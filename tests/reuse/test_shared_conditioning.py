"""EncodeOnceKV shared through a SharedStore: one copy, one encode, frames equal to the unshared run."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.reuse import SharedKey, SharedStore, content_key, donate_unshared

TOKENS, KV_HEADS, HEADS, D, SESSIONS, STEPS = 4096, 2, 4, 16, 64, 2


def encoder(tokens: np.ndarray, counter: list[int] | None = None):
    """The conditioning encoder: K/V of ``tokens`` as fixed random projections (deterministic)."""

    def encode() -> jss.EncodeOnceKV:
        if counter is not None:
            counter.append(1)
        table = jax.random.normal(jax.random.key(7), (2, 64, KV_HEADS, D), jnp.float32)
        k, v = table[0][tokens % 64][None], table[1][tokens % 64][None]
        cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=KV_HEADS, head_dim=D, capacity=TOKENS)
        return cond.commit((k, v))

    return encode


def make_session(cond: jss.EncodeOnceKV, seed: int) -> jss.Session:
    carry = jss.FixedState.allocate(shapes=(1, 1, HEADS, D))
    carry = carry.commit(jax.random.normal(jax.random.key(seed), (1, 1, HEADS, D)))
    return jss.Session(objects={"cond": cond, "carry": carry})


def frame_step(session: jss.Session) -> tuple[jss.Session, jax.Array]:
    """One frame: the carry attends to the conditioning (committed unconditionally: a no-op once written)."""
    view = session.view()
    frame = jss.attend(view["carry"], view["cond"], causal=False)
    again = (view["cond"].k[:, :, :1].transpose(0, 2, 1, 3),) * 2
    session = session.commit(carry=jnp.tanh(frame + view["carry"]), cond=again)
    return session, frame


def test_64_sessions_share_one_conditioning_and_frames_are_bit_identical():
    tokens = np.random.default_rng(0).integers(0, 1000, TOKENS)
    key = content_key(tokens, identity="encoder@test")
    one_copy = encoder(tokens)().nbytes_by_device()["cpu:0"]

    # Unshared reference: every session encodes its own conditioning, the whole session donated.
    plain = jax.jit(frame_step, donate_argnums=0)
    want = []
    for i in range(SESSIONS):
        session, frames = make_session(encoder(tokens)(), i), []
        for _ in range(STEPS):
            session, frame = plain(session)
            frames.append(np.asarray(frame))
        want.append(frames)

    manager = jss.SessionStateManager(max_sessions=2 * SESSIONS)
    store, encodes = SharedStore(manager), []
    step = donate_unshared(frame_step, shared=["cond"])
    sessions = {}
    for i in range(SESSIONS):
        cond = store.acquire(key, i, encoder(tokens, encodes))
        sessions[i] = make_session(cond, i)
    for _ in range(STEPS):
        for i in range(SESSIONS):
            sessions[i], frame = step(sessions[i])
            np.testing.assert_array_equal(np.asarray(frame), want[i][_], err_msg=f"session {i}")
    assert len(encodes) == 1
    stats = store.stats()
    assert (stats["encodes"], stats["misses"], stats["hits"], stats["users"]) == (1, 1, SESSIONS - 1, SESSIONS)
    assert stats["bytes_shared"]["cpu:0"] == one_copy
    assert stats["bytes_saved"]["cpu:0"] == one_copy * (SESSIONS - 1)
    # Conditioning bytes held, every session's buffers together, each buffer once: one copy.
    seen = jss.SeenStorages()
    held = sum(s["cond"].nbytes_by_device(seen).get("cpu:0", 0) for s in sessions.values())
    held += manager.get(SharedKey(key))["value"].nbytes_by_device(seen).get("cpu:0", 0)
    assert held <= 1.05 * one_copy
    assert manager.stats()["bytes"]["cpu:0"] == one_copy  # the manager holds it once
    assert manager.stats()["shared"] == stats
    assert all(not s["cond"].k.is_deleted() for s in sessions.values())


def test_a_donated_step_of_one_session_leaves_the_other_readable_and_bit_identical():
    tokens = np.arange(64)
    cond = encoder(tokens)()
    a, b = make_session(cond, 0), make_session(cond, 1)
    before = {name: np.asarray(getattr(b["cond"], name)) for name in ("k", "v", "lengths", "phase")}
    step = donate_unshared(frame_step, shared=("cond",))
    for _ in range(3):
        a, _frame = step(a)
    assert a["cond"] is cond and b["cond"] is cond
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(getattr(b["cond"], name)), value)
    b, _ = step(b)  # still usable by the other session
    # Without the helper, donating one session deletes the shared buffers for the other.
    plain = jax.jit(frame_step, donate_argnums=0)
    plain(a)
    assert jss._core._placement.is_donated(b["cond"])
    with pytest.raises(jss.NotResidentError):
        b["cond"].view()


def test_donate_unshared_refuses_a_missing_object_and_donate_argnums():
    with pytest.raises(jss.PayloadError, match="donate_argnums"):
        donate_unshared(frame_step, shared=["cond"], donate_argnums=0)
    step = donate_unshared(frame_step, shared=["prompt"])
    with pytest.raises(jss.PayloadError, match="'prompt'"):
        step(make_session(encoder(np.arange(4))(), 0))


def test_a_miss_encodes_once_when_many_threads_ask_at_once():
    manager = jss.SessionStateManager()
    store, encodes, gate = SharedStore(manager), [], threading.Barrier(8)
    tokens = np.arange(32)
    slow = encoder(tokens, encodes)

    def encode():
        threading.Event().wait(0.2)  # the others arrive while this one encodes
        return slow()

    got = [None] * 8

    def user(i):
        gate.wait()
        got[i] = store.acquire("k", i, encode)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(encodes) == 1
    assert all(g.k is got[0].k for g in got)
    stats = store.stats()
    assert (stats["misses"], stats["hits"], stats["users"]) == (1, 7, 8)


def test_an_encoder_error_reaches_every_waiter_and_nothing_is_held():
    manager, gate = jss.SessionStateManager(), threading.Barrier(4)
    store, errors = SharedStore(manager), []

    def encode():
        threading.Event().wait(0.1)
        raise RuntimeError("encoder down")

    def user(i):
        gate.wait()
        try:
            store.acquire("k", i, encode)
        except RuntimeError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["encoder down"] * 4 or len(errors) == 4
    assert store.users("k") == 0 and SharedKey("k") not in manager
    with pytest.raises(jss.PayloadTypeError, match="resident"):
        store.acquire("k", 0, lambda: jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=2).reset())


def test_a_key_whose_encode_failed_is_not_counted_as_in_use():
    manager = jss.SessionStateManager()
    store = SharedStore(manager)
    store.acquire("held", "alice", encoder(np.arange(8)))

    def encode():
        raise RuntimeError("encoder down")

    before = store.stats()
    with pytest.raises(RuntimeError, match="encoder down"):
        store.acquire("failed", "bob", encode)
    assert store.stats() == before and before["keys"] == 1 and before["users"] == 1
    assert store.users("failed") == 0 and SharedKey("failed") not in manager
    assert store.release_user("bob") == 0


def test_release_unpins_and_an_unused_key_may_be_released_then_encoded_again():
    events = []
    manager = jss.SessionStateManager(max_sessions=2, on_event=events.append)
    store, encodes = SharedStore(manager), []
    first = store.acquire("a", "u", encoder(np.arange(8), encodes))
    store.acquire("b", "u", encoder(np.arange(9), encodes))
    with pytest.raises(jss.SessionAdmissionError):  # both pinned: the count cap refuses a third
        store.acquire("c", "u", encoder(np.arange(10), encodes))
    assert store.release_user("u") == 2 and store.users("a") == 0
    store.acquire("c", "u", encoder(np.arange(10), encodes))  # "a", unused, is preempted
    assert [e.kind for e in events if e.kind == "preempt"] == ["preempt"]
    again = store.acquire("a", "v", encoder(np.arange(8), encodes))
    assert len(encodes) == 5  # a, b, c (encoded, then refused), c, a again
    np.testing.assert_array_equal(np.asarray(again.k), np.asarray(first.k))
    with pytest.raises(jss.PayloadError, match="users still hold"):
        store.forget("a")
