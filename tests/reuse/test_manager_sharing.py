"""A manager holding sessions that read one shared buffer: no plan acts on it, and budgets hold for real."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss


def _cond(rng: np.random.Generator, tokens: int) -> jss.EncodeOnceKV:
    rows = jnp.asarray(rng.standard_normal((1, tokens, 2, 8)), jnp.float32)
    return jss.EncodeOnceKV.allocate(batch=1, kv_heads=2, head_dim=8, capacity=tokens).commit((rows, rows))


def _user(cond: jss.EncodeOnceKV, rng: np.random.Generator) -> jss.Session:
    carry = jss.FixedState.allocate(shapes=(64,)).commit(jnp.asarray(rng.standard_normal(64), jnp.float32))
    return jss.Session(objects={"cond": cond, "carry": carry})


def test_a_shared_buffer_is_never_parked_and_the_budget_holds():
    rng = np.random.default_rng(0)
    cond = _cond(rng, 256)  # 32 KiB of K/V, larger than a carry: parks would pick it first if it freed bytes
    users = {u: _user(cond, rng) for u in "abc"}
    carry = sum(users["a"]["carry"].nbytes_by_device().values())
    shared = sum(cond.nbytes_by_device().values())
    budget = shared + 2 * carry + carry // 2  # the shared conditioning once and two carries
    manager = jss.SessionStateManager(byte_budget={"cpu:0": budget})
    for user, session in users.items():
        manager.create(user, session)  # the third does not fit: something of "a" or "b" must go
        assert manager.nbytes_by_device().get("cpu:0", 0) <= budget, user
    held = manager.held()
    assert all("cond" not in h.parked and "cond" not in h.evicted for h in held.values())
    assert sum(len(h.parked) for h in held.values()) == 1  # one carry parked: exactly what fits
    for user, session in users.items():
        got = manager.get(user)
        assert got["cond"].k is cond.k  # still the one shared buffer, never copied back from the host
        np.testing.assert_array_equal(np.asarray(got["carry"].value), np.asarray(session["carry"].value))


def test_preempting_a_session_frees_only_what_it_alone_holds():
    rng = np.random.default_rng(1)
    cond = _cond(rng, 256)
    carry_bytes = sum(_user(cond, rng)["carry"].nbytes_by_device().values())
    shared = sum(cond.nbytes_by_device().values())
    budget = shared + 2 * carry_bytes + carry_bytes // 2
    manager = jss.SessionStateManager(byte_budget={"cpu:0": budget}, park_memory_kind=None)
    for user in "abc":
        manager.create(user, _user(cond, rng))
        assert manager.nbytes_by_device().get("cpu:0", 0) <= budget
    assert "a" not in manager and {"b", "c"} <= set(manager.held())  # one preemption freed one carry: enough
    assert not manager.get("b")["cond"].k.is_deleted()
    jax.block_until_ready(manager.get("c")["cond"].k)


def test_the_summary_says_how_many_held_sessions_read_a_shared_buffer():
    rng = np.random.default_rng(2)
    cond = _cond(rng, 16)
    manager = jss.SessionStateManager()
    for user in "ab":
        manager.create(user, _user(cond, rng))
    manager.create("alone", _user(_cond(rng, 16), rng))
    table = jss.summary(manager)
    assert table.columns[:3] == ["session", "held", "shared"]
    marks = {(row["session"], row["name"]): row.get("shared", "") for row in table.rows}
    assert marks[("a", "cond")] == marks[("b", "cond")] == "2 sessions"
    assert marks[("alone", "cond")] == marks[("a", "carry")] == ""
    assert "2 sessions" in str(table)
    lone = jss.SessionStateManager()
    lone.create("x", _user(cond, rng))
    assert "shared" not in jss.summary(lone).columns  # nothing shared: the table as before
