"""The manager under a byte budget demotes tierable K/V caches to int8: order, events, counters, accuracy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_session_state as jss
from examples.world_model import (
    WorldModel,
    WorldModelConfig,
    kv_names,
    moving_patterns,
    rollout,
    start_session,
)
from tests.support.world import PROMPT, B, D, H, encode, recompute_cond

TOKENS, CAPACITY = 12, 32


def tier_session(seed, *, cond=False):
    """Random rows (never zeros) in a float K/V cache that may be demoted to int8; optionally a recomputable cond."""
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(B, TOKENS, H, D)), jnp.float32) for _ in range(2))
    objects = {
        "kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=CAPACITY, tiers=("int8",)).append((k, v)),
        "carry": jss.FixedState.allocate(shapes={"h": (B, 8)}).commit(
            {"h": jnp.asarray(rng.normal(size=(B, 8)), jnp.float32)}
        ),
    }
    if cond:
        prompt = jnp.asarray(rng.normal(size=(B, PROMPT, H * D)), jnp.float32)
        objects["prompt"] = jss.FixedState.allocate(shapes=(B, PROMPT, H * D)).commit(prompt)
        objects["cond"] = jss.EncodeOnceKV.allocate(
            batch=B, kv_heads=H, head_dim=D, capacity=PROMPT, recompute_source="prompt", recompute_cost=1.0
        ).commit(encode(prompt))
    return jss.Session(objects=objects)


def nbytes(tree):
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def sizes(cond=False):
    s = tier_session(0, cond=cond)
    out = {"session": nbytes(s), "kv": nbytes(s["kv"]), "demoted_kv": nbytes(s["kv"].demote())}
    if cond:
        out["cond"] = nbytes(s["cond"])
    return out


DEVICE = f"{jax.devices()[0].platform}:{jax.devices()[0].id}"


def manager(budget, recompute=True, **kw):
    events = []
    m = jss.SessionStateManager(byte_budget={DEVICE: budget}, on_event=events.append, **kw)
    if recompute:
        m.register_recompute("cond", recompute_cond)
    return m, events


def kinds(events):
    return [(e.kind, e.session_id, e.object_name) for e in events]


def test_budget_pressure_demotes_the_least_recently_used_session_and_loses_nothing():
    z = sizes()
    saved = z["kv"] - z["demoted_kv"]
    m, events = manager(4 * z["session"] - saved // 2)
    originals = {sid: tier_session(seed) for seed, sid in enumerate("abcd")}
    # A host copy of what a holds: the manager donates a's storage when it demotes it.
    original = jax.tree_util.tree_map(lambda x: np.asarray(jnp.copy(x)), originals["a"]["kv"].view())
    for sid in "abcd":
        m.create(sid, originals[sid])
    assert kinds(events) == [("demote", "a", "kv")]
    assert events[0].bytes_by_device == {DEVICE: saved}
    stats = m.stats()
    assert (stats["demotions"], stats["parks"], stats["preemptions"], stats["evictions"]) == (1, 0, 0, 0)
    assert stats["bytes"][DEVICE] == 4 * z["session"] - saved <= m.byte_budget[DEVICE]
    assert sorted(m.held()) == list("abcd")

    demoted = m.get("a")  # not restored: demotion is not undone
    assert demoted["kv"].quantize == "int8" and not demoted["kv"].demotable
    assert m.stats()["bytes"][DEVICE] == 4 * z["session"] - saved and len(events) == 1
    for sid in "bcd":
        assert m.get(sid)["kv"].quantize is None
    # Within the documented bound: every value within max|row| / 254 of what was written.
    cache = demoted["kv"]
    for name in ("k", "v"):
        written = np.asarray(getattr(original, name))[:, :, :TOKENS]  # [B, H, T, D]
        scale = np.asarray(getattr(cache, f"{name}_scale"), np.float32)
        read = (np.asarray(getattr(cache, name), np.float32) * scale)[:, :, :TOKENS]
        bound = np.abs(written).max(axis=-1, keepdims=True) / 254
        assert np.all(np.abs(read - written) <= bound * (1 + 1e-6))
    view = cache.view()
    # Attention on the demoted cache works unchanged and stays close to the float reference.
    q = jnp.asarray(np.random.default_rng(9).normal(size=(B, 1, H, D)), jnp.float32)
    ours = np.asarray(jss.attend(q, view))
    k = np.asarray(original.k, np.float64)[:, :, :TOKENS]
    v = np.asarray(original.v, np.float64)[:, :, :TOKENS]
    logits = np.einsum("bqhd,bhkd->bhqk", np.asarray(q, np.float64), k) / np.sqrt(D)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    reference = np.einsum("bhqk,bhkd->bqhd", weights, v)
    np.testing.assert_allclose(ours, reference, atol=3e-2)


def test_recomputable_objects_are_evicted_first_then_tiers_demoted_then_objects_parked():
    z = sizes(cond=True)
    saved = z["kv"] - z["demoted_kv"]
    held = 4 * z["session"]
    # Evicting the three older conds is not enough; demoting a's kv then is.
    m, events = manager(held - 3 * z["cond"] - saved // 2)
    for seed, sid in enumerate("abcd"):
        m.create(sid, tier_session(seed, cond=True))
    assert kinds(events) == [("evict", s, "cond") for s in "abc"] + [("demote", "a", "kv")]
    assert m.stats()["bytes"][DEVICE] <= m.byte_budget[DEVICE]

    # Tighter: each create's plan evicts, then demotes (LRU first), and parks only once every
    # older session's kv is demoted; never a preemption.
    m, events = manager(held - 3 * z["cond"] - 3 * saved - 8)
    rank = {"evict": 0, "demote": 1, "park": 2}
    demoted = set()
    for seed, sid in enumerate("abcd"):
        before = len(events)
        m.create(sid, tier_session(seed, cond=True))
        segment = events[before:]
        assert [rank[e.kind] for e in segment] == sorted(rank[e.kind] for e in segment)
        demoted |= {e.session_id for e in segment if e.kind == "demote"}
        if any(e.kind == "park" for e in segment):
            assert demoted == set("abcd") - {sid}
    assert [e.session_id for e in events if e.kind == "demote"] == list("abc")
    assert "park" in [e.kind for e in events]
    stats = m.stats()
    assert (stats["demotions"], stats["preemptions"]) == (3, 0) and stats["parks"] >= 1
    assert stats["bytes"][DEVICE] <= m.byte_budget[DEVICE]
    assert sorted(m.held()) == list("abcd")


def test_pinned_sessions_are_never_demoted():
    z = sizes()
    saved = z["kv"] - z["demoted_kv"]
    m, events = manager(4 * z["session"] - saved // 2)
    for seed, sid in enumerate("abc"):
        m.create(sid, tier_session(seed))
    with m.pin("a"):
        m.create("d", tier_session(3))
    assert kinds(events) == [("demote", "b", "kv")]
    assert m.get("a")["kv"].quantize is None


def test_a_demoted_session_round_trips_a_checkpoint(tmp_path):
    session = tier_session(5)
    session = session.with_objects(kv=session["kv"].demote())
    jss.checkpoint.save(tmp_path / "ckpt", session)
    restored = jss.checkpoint.restore(tmp_path / "ckpt", target=session)
    kv = restored["kv"]
    assert (kv.quantize, kv.tiers) == ("int8", ()) and kv.k.dtype == jnp.int8
    for name in ("k", "v", "k_scale", "v_scale", "committed"):
        np.testing.assert_array_equal(np.asarray(getattr(kv, name)), np.asarray(getattr(session["kv"], name)))


def test_world_model_frames_after_demotion_stay_within_two_percent_of_the_float_run():
    config = WorldModelConfig(layers=2, capacity=128, tiers=("int8",))
    model = WorldModel(config, rngs=nnx.Rngs(0))
    key = jax.random.key(0)
    watched, ahead = 6, 6
    frames, actions = moving_patterns(key, config, watched + ahead, config.batch)
    prompt = jax.random.normal(key, (config.batch, config.prompt_tokens, config.d_model))
    session = start_session(model, prompt, frames[: config.context_frames])
    seen = frames[config.context_frames: config.context_frames + watched]
    run = jax.jit(functools.partial(rollout, model))
    session = run(session, actions[:watched], seen)[0]

    float_frames = np.asarray(run(session.fork(), actions[watched:])[1], np.float64)
    floats = sum(nbytes(session[name]) for name in kv_names(config))
    demoted_bytes = sum(nbytes(session[name].demote()) for name in kv_names(config))
    m, events = manager(nbytes(session) * 2 - (floats - demoted_bytes) // 2, recompute=False, park_memory_kind=None)
    m.create("old", session.fork())
    m.create("new", session.fork())
    assert {e.kind for e in events} == {"demote"} and {e.session_id for e in events} == {"old"}
    old = m.get("old")
    assert any(old[name].quantize == "int8" for name in kv_names(config))
    demoted_frames = np.asarray(run(old, actions[watched:])[1], np.float64)
    error = np.linalg.norm(demoted_frames - float_frames) / np.linalg.norm(float_frames)
    assert 0 < error <= 2e-2, error


def paged_session(seed):
    """A float paged cache that may be demoted to int8: ragged random rows, slot 2 a fork of slot 0."""
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(3, TOKENS, H, D)), jnp.float32) for _ in range(2))
    cache = jss.PagedKVCache.allocate(max_slots=3, kv_heads=H, head_dim=D, page_size=4, num_pages=12, tiers=("int8",))
    cache = cache.append(jss.KVChunk(k, v, jnp.asarray([TOKENS, 5, 0], jnp.int32))).fork(0, 2)
    return jss.Session(objects={"kv": cache})


def host_rows(cache):
    """Each row's visible K/V on the host, from copies (a numpy view of a buffer would keep it from being donated)."""
    return [{name: np.asarray(x) for name, x in row.items()}
            for row in jax.tree_util.tree_map(jnp.copy, cache.view()).materialize()]


def assert_within_half_a_step(demoted, written):
    for got, want in zip(demoted.view().materialize(), written):
        for name in ("k", "v"):
            bound = np.abs(want[name]).max(axis=-1, keepdims=True) / 254
            assert got[name].shape == want[name].shape and np.all(np.abs(got[name] - want[name]) <= bound * (1 + 1e-6))


@pytest.mark.parametrize("make", [tier_session, paged_session])
def test_demotion_frees_what_the_manager_alone_holds_and_keeps_a_shared_buffer(make):
    size = nbytes(make(0))
    saved = size - nbytes(make(0).with_objects(kv=make(0)["kv"].demote()))
    sessions = {sid: make(seed) for seed, sid in enumerate("abc")}
    written = {sid: host_rows(session["kv"]) for sid, session in sessions.items()}
    old = sessions["a"]["kv"]
    bookkeeping = [
        name for name in old.storage_fields() if name not in old.data_fields and getattr(old, name) is not None
    ]
    kept = {name: np.asarray(jnp.copy(getattr(old, name))) for name in bookkeeping}  # copies: `old` stays deletable
    m, events = manager(3 * size - saved // 2, recompute=False)
    for sid in "abc":
        m.create(sid, sessions[sid])
    assert kinds(events) == [("demote", "a", "kv")] and m.stats()["demotions"] == 1
    # Freed, though this handle still refers to it: only the manager held it.
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(old))
    demoted = m.get("a")["kv"]
    assert demoted.quantize == "int8" and m.stats()["bytes"][DEVICE] == 3 * size - saved
    assert_within_half_a_step(demoted, written["a"])  # nothing lost
    for name in bookkeeping:  # holding what it held: demotion requantizes only the K/V
        np.testing.assert_array_equal(np.asarray(getattr(demoted, name)), kept[name], err_msg=name)
    for got, want in zip(demoted.view().materialize(), written["a"]):
        np.testing.assert_array_equal(got["positions"], want["positions"])
    for sid in "bc":
        for got, want in zip(m.get(sid)["kv"].view().materialize(), written[sid]):
            for name in ("positions", "k", "v"):  # not demoted: exactly the rows written
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{sid} {name}")

    # Two sessions sharing buffers: demoting either would free nothing (the other still reads them), so the
    # planner demotes a session that holds its own, and the shared buffers stay as they were.
    shared = make(3)
    written = host_rows(shared["kv"])
    pointers = {name: getattr(shared["kv"], name).unsafe_buffer_pointer() for name in bookkeeping}
    m, events = manager(3 * size - saved // 2, recompute=False)
    m.create("a", shared)
    m.create("twin", shared)
    for sid in "bc":
        m.create(sid, make(4 + ord(sid)))
    assert kinds(events) == [("demote", "b", "kv")] and m.stats()["bytes"][DEVICE] == 3 * size - saved
    for sid in ("a", "twin"):
        kv = m.get(sid)["kv"]
        assert kv.quantize is None
        assert {name: getattr(kv, name).unsafe_buffer_pointer() for name in bookkeeping} == pointers
        for got, want in zip(kv.view().materialize(), written):
            for name in ("positions", "k", "v"):
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{sid} {name}")
