"""Session: fan-out of the lifecycle, the recompute graph, accounting, forks, check."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.testing import assert_logically_equal
from tests.support.devices import DEVICE


def make_session(**extra):
    return jss.Session(
        objects={
            "prompt": jss.FixedState.allocate(shapes=(1, 4, 6)),
            "cond": jss.EncodeOnceKV.allocate(batch=1, kv_heads=2, head_dim=3, capacity=4, recompute_source="prompt"),
            "kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=3, capacity=16),
            "frames": jss.LatentBuffer.allocate(capacity=4, item_shape=(2,), ring=True, max_staged=2),
            **extra,
        },
        attrs={"rng": jax.random.key(0), "step": jnp.zeros((), jnp.int32)},
    )


def rows(rng, T):
    return jss.KVChunk(*(jnp.asarray(rng.normal(size=(1, T, 2, 3)), jnp.float32) for _ in range(2)))


def test_lifecycle_fans_out_to_each_object():
    rng = np.random.default_rng(0)
    session = make_session()
    chunk, frame = rows(rng, 3), jnp.asarray(rng.normal(size=(2,)), jnp.float32)
    staged = session.stage(kv=chunk, frames=frame)
    assert int(staged.view()["kv"].lengths[0]) == 3
    assert int(staged.view(include_staged=False)["kv"].lengths[0]) == 0
    committed = staged.commit()  # promotes every object's staged data
    assert_logically_equal(committed.view()["kv"], session["kv"].append(chunk).view(), "commit()")
    assert_logically_equal(committed.view()["frames"], session["frames"].append(frame).view(), "commit()")
    discarded = staged.discard()
    assert_logically_equal(discarded.view(), session.view(), "discard()")


def test_commit_with_payloads_also_promotes_the_rest():
    rng = np.random.default_rng(1)
    session = make_session().stage(kv=rows(rng, 2))
    frame = jnp.ones((2,))
    session = session.commit(frames=frame)
    assert int(session.view(include_staged=False)["kv"].lengths[0]) == 2
    assert int(session.view(include_staged=False)["frames"].count) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_commit_of_a_name_not_in_the_session_is_a_key_error_and_commits_nothing(jit):
    rng = np.random.default_rng(2)
    session = make_session().stage(kv=rows(rng, 2))
    commit = jax.jit(lambda s, chunk: s.commit(kvv=chunk)) if jit else (lambda s, chunk: s.commit(kvv=chunk))
    message = r"no object 'kvv' in this session; it holds \['cond', 'frames', 'kv', 'prompt'\]\."
    with pytest.raises(KeyError, match=message):
        commit(session, rows(rng, 3))
    assert session["kv"].fill().staged == [2] and session["kv"].fill().committed == [0]  # still staged


def test_jitted_donated_step_compiles_once_and_keeps_buffers():
    rng = np.random.default_rng(2)

    @chex.assert_max_traces(n=1)
    def step(session, chunk):
        key, _ = jax.random.split(session.attrs["rng"])
        return session.append(kv=chunk).with_attrs(rng=key, step=session.attrs["step"] + 1)

    jitted = jax.jit(step, donate_argnums=0)
    session = make_session()
    pointer = session["kv"].k.unsafe_buffer_pointer()
    chunks, key = [], jax.random.key(0)  # host copies of what each step writes; the key make_session starts from
    for _ in range(5):
        chunk = rows(rng, 2)  # the chunks are not donated: numpy copies of them hold nothing that is
        chunks.append({name: np.array(getattr(chunk, name)) for name in ("k", "v")})
        session = jitted(session, chunk)
        key = jax.random.split(key)[0]
    assert session["kv"].k.unsafe_buffer_pointer() == pointer
    assert int(session.attrs["step"]) == 5
    assert session["kv"].committed.tolist() == [10] and session["kv"].staged.tolist() == [0]
    for name in ("k", "v"):  # numpy: the five chunks in order from row 0, the rows after them never written
        got = np.asarray(getattr(session["kv"], name))
        want = np.concatenate([c[name] for c in chunks], axis=1).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(got[:, :, :10], want, err_msg=name)
        assert not np.any(got[:, :, 10:]), name
    np.testing.assert_array_equal(jax.random.key_data(session.attrs["rng"]), jax.random.key_data(key))


def test_errors_name_the_object():
    session = make_session()
    with pytest.raises(jss.PayloadError, match=r"session object 'kv': KVCache\(.*\)\.stage: k must have shape"):
        session.stage(kv=(jnp.ones((1, 2, 2, 5)), jnp.ones((1, 2, 2, 5))))
    with pytest.raises(KeyError, match="no object 'nope'"):
        session.stage(nope=1)


def test_objects_and_attrs_must_be_mappings_from_names():
    kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=3, capacity=4)
    for objects, attrs in (([("kv", kv)], {}), ({"kv": kv}, [("step", jnp.int32(0))])):  # pairs, not mappings
        with pytest.raises(jss.PayloadTypeError, match=r"Session\(objects=\.\.\., attrs=\.\.\.\) takes two mappings"):
            jss.Session(objects=objects, attrs=attrs)


@pytest.mark.parametrize(
    ("name", "error"), [(1, jss.PayloadTypeError), (("kv",), jss.PayloadTypeError), ("", jss.PayloadError)]
)
def test_object_names_tell_a_non_string_from_an_empty_one(name, error):
    kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=3, capacity=4)
    match = rf"^Session object names must be non-empty strings; got {re.escape(repr(name))}\.$"
    with pytest.raises(error, match=match) as raised:
        jss.Session(objects={"ok": kv, name: kv})
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)


def test_missing_recompute_source():
    with pytest.raises(jss.RecomputeGraphError, match="recompute source 'prompt' of 'cond_kv' is not in this session"):
        jss.Session(objects={"cond_kv": jss.FixedState.allocate(shapes=(2,), recompute_source="prompt")})


def test_recompute_cycle_is_named():
    a = jss.FixedState.allocate(shapes=(2,), recompute_source="b")
    b = jss.FixedState.allocate(shapes=(2,), recompute_source="a")
    with pytest.raises(jss.RecomputeGraphError, match="a -> b -> a"):
        jss.Session(objects={"a": a, "b": b})
    with pytest.raises(jss.RecomputeGraphError, match="c -> c"):
        jss.Session(objects={"c": jss.FixedState.allocate(shapes=(2,), recompute_source="c")})
    session = jss.Session(objects={"a": a, "b": jss.FixedState.allocate(shapes=(2,))})
    with pytest.raises(jss.RecomputeGraphError, match="a -> b -> a"):
        session.with_objects(b=b)  # validated on replace too


def test_recomputable_follows_source_residency():
    session = make_session()
    assert session.recomputable("cond") and not session.recomputable("kv")
    prompt_gone = session.with_objects(prompt=session["prompt"].reset())
    assert not prompt_gone.recomputable("cond")


def test_nbytes_deduplicates_aliases_across_objects_and_attrs():
    session = make_session()
    alone = session.nbytes_by_device()
    shared = session.with_attrs(alias=session["kv"].k)  # the same buffer, a second reference
    assert shared.nbytes_by_device() == alone
    copied = session.with_attrs(copy=session["kv"].k.copy())
    assert copied.nbytes_by_device()[DEVICE] == alone[DEVICE] + session["kv"].k.nbytes
    expected = sum(obj.nbytes for obj in session.objects.values()) + 8 + 4  # rng key, step
    assert session.nbytes == expected


def test_fork_is_independent_and_donation_safe():
    rng = np.random.default_rng(3)
    first = rows(rng, 2)
    session = make_session().append(kv=first)
    fork = session.fork()
    assert fork["kv"].k.unsafe_buffer_pointer() != session["kv"].k.unsafe_buffer_pointer()
    step = jax.jit(lambda s, c: s.append(kv=c), donate_argnums=0)
    second = rows(rng, 3)
    advanced = step(fork, second)  # deletes the fork's buffers, not the original's
    assert session["kv"].k.is_deleted() is False
    assert int(session.view()["kv"].lengths[0]) == 2 and int(advanced.view()["kv"].lengths[0]) == 5
    for name in ("k", "v"):  # numpy: the original holds its 2 rows only, the advanced fork those and then 3 more
        rows_of = [np.asarray(getattr(c, name)).transpose(0, 2, 1, 3) for c in (first, second)]
        original, forked = (np.asarray(getattr(s["kv"], name)) for s in (session, advanced))
        np.testing.assert_array_equal(original[:, :, :2], rows_of[0], err_msg=name)
        assert not np.any(original[:, :, 2:]), name
        np.testing.assert_array_equal(forked[:, :, :5], np.concatenate(rows_of, axis=2), err_msg=name)
        assert not np.any(forked[:, :, 5:]), name
    np.testing.assert_array_equal(jax.random.key_data(session.attrs["rng"]), jax.random.key_data(advanced.attrs["rng"]))


def test_check_reports_every_flagged_object_by_path():
    session = jss.Session(
        objects={
            "a": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=1, capacity=2),
            "b": jss.LatentBuffer.allocate(capacity=1, item_shape=(1,)),
        }
    )
    x = jnp.ones((1, 3, 1, 1))
    bad = jax.jit(lambda s: s.append(a=(x, x), b=jnp.ones((2, 1))))(session)
    with pytest.raises(jss.CapacityError, match=r"'a'\].*KVCache.*'b'\].*LatentBuffer"):
        jss.check(bad)
    jss.check(session)  # nothing flagged: no error


def test_non_resident_objects_refuse_use():
    session = make_session()
    gone = session.with_objects(kv=session["kv"].evict()[0])
    with pytest.raises(jss.NotResidentError, match=r"session object 'kv': view\(\) on KVCache"):
        gone.view()
    with pytest.raises(jss.NotResidentError):
        gone.commit()
    assert gone.nbytes == session.nbytes - session["kv"].nbytes


def test_a_tree_map_over_objects_builds_a_session_shaped_tree_of_any_values():
    kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=3, capacity=4)
    session = jss.Session(objects={"kv": kv, "h": jss.FixedState.allocate(shapes=(2,))})
    kinds = jax.tree.map(lambda o: type(o).__name__, session, is_leaf=jss.is_state_object)
    assert kinds.objects == {"kv": "KVCache", "h": "FixedState"}  # e.g. vmap in_axes, one per object
