"""The manager under 8 threads of random operations on 100 sessions, with a byte budget."""

import collections
import random
import threading

import jax_session_state as jss
from tests.support.devices import DEVICE, PINNED
from tests.support.world import make_session, recompute_cond, session_bytes, step

THREADS, OPERATIONS, SESSIONS = 8, 2000, 100
ONE = session_bytes(capacity=8)["session"]
DOCUMENTED = (jss.SessionStateLostError, jss.SessionAdmissionError, jss.BudgetExceededError)


def test_eight_threads_of_random_operations():
    budget = {DEVICE: 40 * ONE}
    events = []
    manager = jss.SessionStateManager(
        max_sessions=80, byte_budget=budget, host_budget=30 * ONE, on_event=events.append
    )
    manager.register_recompute("cond", recompute_cond)
    templates = [make_session(i, capacity=8) for i in range(4)]  # forked per use: no shared buffers
    for sid in range(60):
        manager.create(sid, templates[sid % 4].fork())
    lookups = collections.Counter()
    outcomes = collections.Counter()
    unexpected = []

    def work(seed):
        rng = random.Random(seed)
        for _ in range(OPERATIONS):
            sid = rng.randrange(SESSIONS)
            op = rng.choice(["get", "get", "update", "update", "put", "create", "release", "pin"])
            try:
                if op in ("get", "update", "pin"):
                    lookups[seed] += 1
                if op == "get":
                    manager.get(sid)
                elif op == "update":
                    manager.update(sid, step)
                elif op == "put":
                    manager.put(sid, templates[sid % 4].fork())
                elif op == "create":
                    if sid not in manager:
                        manager.create(sid, templates[sid % 4].fork())
                elif op == "release":
                    manager.release(sid)
                else:
                    with manager.pin(sid):
                        pass
                outcomes[op, "ok"] += 1
            except DOCUMENTED as error:
                outcomes[op, type(error).__name__] += 1
            except ValueError as error:  # another thread created it in between
                assert op == "create" and "exists already" in str(error)
                outcomes[op, "exists"] += 1
            except BaseException as error:  # recorded and failed on below
                unexpected.append((op, sid, repr(error)))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert unexpected == []
    stats = manager.stats()
    assert stats["hits"] + stats["misses"] == stats["lookups"] == sum(lookups.values())
    assert sum(outcomes.values()) == THREADS * OPERATIONS
    assert outcomes["update", "ok"] > 1000 and outcomes["get", "ok"] > 1000
    kinds = collections.Counter(event.kind for event in events)
    assert kinds["park"] and kinds["restore"] and kinds["evict"] and kinds["recompute"]
    assert stats["parks"] == kinds["park"] and stats["restores"] == kinds["restore"]
    assert stats["evictions"] == kinds["evict"] and stats["preemptions"] == kinds["preempt"]
    # Final bytes: the running totals equal a recount over every session held, within budget.
    recount = collections.Counter()
    for row in jss.summary(manager).rows:
        recount.update({key: row.get(key, 0) for key in (DEVICE, PINNED)})
    assert {k: v for k, v in recount.items() if v} == manager.nbytes_by_device() == stats["bytes"]
    assert stats["bytes"][DEVICE] <= budget[DEVICE] and stats["sessions"] == len(manager) <= 80
    for sid in range(SESSIONS):  # every session held is whole again after a lookup
        if sid in manager:
            session = manager.get(sid)
            assert all(obj.resident for obj in session.objects.values())
