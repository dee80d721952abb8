"""8 threads over 40 keys under a byte budget: no buffer in use is freed, counts add up, content is right."""

from __future__ import annotations

import random
import threading

import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from jax_session_state.reuse import SharedStore, content_key

THREADS, KEYS, ROUNDS = 8, 40, 30


def expected(i: int) -> np.ndarray:
    return np.random.default_rng(i).normal(size=(1, 1, 32, 8)).astype(np.float32)


def encoder(i: int, log: list[int], lock: threading.Lock):
    def encode() -> jss.EncodeOnceKV:
        with lock:
            log.append(i)
        rows = jnp.asarray(expected(i)).transpose(0, 2, 1, 3)
        cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=8, capacity=32)
        return cond.commit((rows, -rows))

    return encode


def test_threads_asking_for_keys_under_a_budget():
    one = encoder(0, [], threading.Lock())().nbytes_by_device()["cpu:0"]
    budget = 12 * one  # room for the 8 keys in use and a few more: the rest are parked or preempted
    events = []
    manager = jss.SessionStateManager(
        max_sessions=KEYS, byte_budget={"cpu:0": budget}, host_budget=6 * one, on_event=events.append
    )
    store = SharedStore(manager)
    keys = [content_key(np.int32(i), identity="enc@stress") for i in range(KEYS)]
    encodes, log_lock, failures, acquires = [], threading.Lock(), [], [0] * THREADS

    def user(t: int) -> None:
        rng = random.Random(t)
        try:
            for r in range(ROUNDS):
                i = rng.randrange(KEYS)
                obj = store.acquire(keys[i], (t, r), encoder(i, encodes, log_lock))
                acquires[t] += 1
                for _ in range(2):  # while held, other threads acquire and release around it
                    assert not obj.k.is_deleted() and not obj.v.is_deleted()
                    np.testing.assert_array_equal(np.asarray(obj.k), expected(i))
                    np.testing.assert_array_equal(np.asarray(obj.v), -expected(i))
                    threading.Event().wait(0.001)
                store.release(keys[i], (t, r))
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=user, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    stats = store.stats()
    assert stats["hits"] + stats["misses"] == sum(acquires) == THREADS * ROUNDS
    assert stats["encodes"] == len(encodes) and stats["users"] == 0 and stats["keys"] == 0
    assert len(encodes) >= len(set(encodes))  # keys lost under the budget are encoded again
    assert manager.stats()["bytes"]["cpu:0"] <= budget
    assert any(e.kind in ("park", "preempt") for e in events)  # the budget did bite
    # Every key still held by the manager holds the right content.
    for i, key in enumerate(keys):
        if jss.reuse.SharedKey(key) in manager:
            obj = store.acquire(key, "check", encoder(i, encodes, log_lock))
            np.testing.assert_array_equal(np.asarray(obj.k), expected(i))
            store.release(key, "check")
