"""Checkpoints on one device: round trips, rollouts continued bit for bit, crash safety, clear errors.

Saving on 8 devices and restoring on 4 or 1 is in tests/multidevice/test_sharded_checkpoint.py.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_session_state as jss
from jax_session_state import checkpoint
from jax_session_state.checkpoint import _digest
from tests.support.devices import DEVICE

B, H, D = 2, 2, 4


class Carry(NamedTuple):
    """A carry whose structure is a namedtuple: restored by importing it."""

    h: jax.ShapeDtypeStruct
    c: jax.ShapeDtypeStruct


def random_session(seed=0):
    """A session with every kind, written with random data, and attrs of every supported type."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    session = jss.Session(
        objects={
            "kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=16),
            "ring": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=4, sink=1, max_staged=3),
            "cond": jss.EncodeOnceKV.allocate(batch=B, kv_heads=H, head_dim=D, capacity=5, recompute_source="prompt"),
            "prompt": jss.FixedState.allocate(shapes=(B, 6)),
            "carry": jss.FixedState.allocate(
                shapes=Carry(h=jax.ShapeDtypeStruct((B, 3), jnp.float32), c=jax.ShapeDtypeStruct((B,), jnp.int32))
            ),
            "frames": jss.LatentBuffer.allocate(
                capacity=3, item_shape=(2,), ring=True, max_staged=2, dtype=jnp.bfloat16
            ),
            "bank": jss.RetrievalStore.allocate(capacity=4, key_dim=3, value_shapes={"a": (2,), "b": [(1,)]}),
            "pages": jss.PagedKVCache.allocate(max_slots=B, kv_heads=H, head_dim=D, page_size=2, num_pages=8),
        },
        attrs={
            "rng": jax.random.key(seed),
            "rbg": jax.random.key(seed, impl="rbg"),
            "step": jnp.int32(3),
            "table": rng.normal(size=(3,)),
            "scale": np.float32(0.5),
            "meta": {"name": "run", "n": 7, "ratio": 0.25, "flag": True, "nested": [1, (2.5, None)]},
        },
    )
    session = session.append(
        kv=jss.KVChunk(normal(B, 5, H, D), normal(B, 5, H, D), jnp.array([5, 2], jnp.int32)),
        ring=(normal(B, 3, H, D), normal(B, 3, H, D)),
        cond=(normal(B, 4, H, D), normal(B, 4, H, D)),
        prompt=normal(B, 6),
        carry=Carry(h=normal(B, 3), c=jnp.asarray(rng.integers(0, 9, size=B), jnp.int32)),
        frames=normal(2, 2).astype(jnp.bfloat16),
        bank=(normal(2, 3), {"a": normal(2, 2), "b": [normal(2, 1)]}),
        pages=jss.KVChunk(normal(B, 3, H, D), normal(B, 3, H, D), jnp.array([3, 1], jnp.int32)),
    )
    session = session.stage(kv=(normal(B, 2, H, D), normal(B, 2, H, D)), frames=normal(2).astype(jnp.bfloat16))
    return session.with_objects(cond=session["cond"].evict()[0])


def host_leaves(tree):
    """Every leaf as (type, dtype, numpy bits), typed keys as their key data and implementation."""
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            out.append(("key", str(jax.random.key_impl(leaf)), np.asarray(jax.random.key_data(leaf))))
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            out.append((type(leaf).__name__, np.dtype(leaf.dtype).name, np.asarray(leaf)))
        else:
            out.append((type(leaf).__name__, None, leaf))
    return out


def assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)  # kinds, specs, residency
    for x, y in zip(host_leaves(a), host_leaves(b), strict=True):
        assert x[:2] == y[:2]
        np.testing.assert_array_equal(x[2], y[2])


def test_round_trip_restores_every_object_attr_spec_and_residency_exactly(tmp_path):
    session = random_session()
    checkpoint.save(tmp_path, session)
    restored = checkpoint.restore(tmp_path)
    assert_same(restored, session)
    assert not restored["cond"].resident and restored["cond"].describe() == session["cond"].describe()
    assert int(restored["kv"].staged.sum()) == 4  # staged rows stay staged
    assert_same(checkpoint.restore(tmp_path, target=session), session)


def test_restored_session_continues_a_jitted_rollout_bit_for_bit(tmp_path):
    traces = []

    @jax.jit
    def step(session):
        traces.append(None)
        key, k_key, v_key, h_key = jax.random.split(session.attrs["rng"], 4)
        k, v = (jax.random.normal(x, (B, 1, H, D)) for x in (k_key, v_key))
        weights = jax.nn.softmax(jnp.einsum("bhcd,bthd->bhc", session["kv"].k, k), axis=-1)
        h = jnp.tanh(session["prompt"].value + jnp.einsum("bhc,bhcd->b", weights, session["kv"].v)[:, None])
        session = session.commit().append(kv=(k, v), ring=(k, v), prompt=h + jax.random.normal(h_key, h.shape))
        return session.with_attrs(rng=key, step=session.attrs["step"] + 1)

    donated = jax.jit(step.__wrapped__, donate_argnums=0)
    original = random_session(seed=1)
    original = original.with_objects(cond=original["cond"].empty())  # every object takes part in commit()
    original = original.replace(attrs={k: v for k, v in original.attrs.items() if k != "meta"})  # str: not jittable
    for _ in range(2):
        original = step(original)
    checkpoint.save(tmp_path, original)
    restored = checkpoint.restore(tmp_path, target=original)
    key = jnp.copy(restored.attrs["rng"])  # copies: a reference to the restored session would stop donation
    want = {name: np.array(jnp.copy(getattr(restored["kv"], name))) for name in ("k", "v")}
    start = [int(n) + int(s) for n, s in zip(restored["kv"].committed, restored["kv"].staged)]  # commit() promotes
    for _ in range(5):
        buffers = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(restored.objects)]
        original, restored = step(original), donated(restored)
        assert [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(restored.objects)] == buffers
    assert_same(restored, original)
    assert len(traces) == 1  # the restored session reuses the original's trace: same structure, shapes, dtypes
    for i in range(5):  # numpy: the row each step draws from its key, at its offset; the rows before kept
        key, k_key, v_key, _ = jax.random.split(key, 4)
        for name, name_key in (("k", k_key), ("v", v_key)):
            drawn = np.asarray(jax.random.normal(name_key, (B, 1, H, D)))
            for b in range(B):
                want[name][b, :, start[b] + i] = drawn[b, 0]
    assert restored["kv"].committed.tolist() == [s + 5 for s in start] and restored["kv"].staged.tolist() == [0] * B
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(getattr(restored["kv"], name)), want[name], rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    np.testing.assert_array_equal(jax.random.key_data(restored.attrs["rng"]), jax.random.key_data(key))


BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **kw: (
        BACKEND_COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


def committed(tree):
    return [x.committed for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def test_a_restored_session_is_committed_as_the_original_so_its_step_does_not_compile_again(tmp_path):
    step = jax.jit(lambda s: s.commit().append(kv=(jnp.ones((B, 1, H, D)), jnp.ones((B, 1, H, D)))))
    original = jss.Session(
        objects={"kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=8)},
        attrs={"rng": jax.random.key(0)},
    )
    original = step(original)  # made by jnp: nothing committed
    assert not any(committed(original))
    checkpoint.save(tmp_path, original)
    checkpoint.restore(tmp_path)  # compiles the copies a restore makes, once
    before = len(BACKEND_COMPILES)
    for restored in (checkpoint.restore(tmp_path), checkpoint.restore(tmp_path, target=original)):
        assert committed(restored) == committed(original)
        assert_same(step(restored), step(original))
    assert len(BACKEND_COMPILES) == before  # the step runs the executable it compiled for the original
    pinned = jax.device_put(original, jax.devices()[0])  # committed: a target that is keeps it so
    assert all(committed(checkpoint.restore(tmp_path, target=pinned)))


def test_a_save_replaces_the_previous_checkpoint_only_once_complete(tmp_path):
    first, second = random_session(seed=2), random_session(seed=3)
    assert checkpoint.save(tmp_path, first) == tmp_path / "ckpt-000001"
    (tmp_path / ".partial-000002").mkdir()  # what a crashed save leaves
    (tmp_path / ".partial-000002" / "manifest.json").write_text("{")
    assert_same(checkpoint.restore(tmp_path), first)
    assert checkpoint.save(tmp_path, second) == tmp_path / "ckpt-000002"
    assert_same(checkpoint.restore(tmp_path), second)
    assert_only_checkpoint(tmp_path, "ckpt-000002")


def assert_only_checkpoint(root, name):
    """Only ``name`` is left: superseded checkpoints are renamed away at once, deleted in the background."""
    deadline = time.monotonic() + 30
    while sorted(p.name for p in root.iterdir()) != [name]:
        assert all(p.name == name or p.name.startswith(".superseded-") for p in root.iterdir())
        assert time.monotonic() < deadline, "a superseded checkpoint was never deleted"
        time.sleep(0.05)


CHILD_SAVE = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import jax_session_state as jss
    kv = jss.KVCache.allocate(batch=4, kv_heads=8, head_dim=64, capacity=8192)  # 128 MiB of K/V
    keys = jax.random.split(jax.random.key(0), 2)
    kv = kv.replace(k=jax.random.normal(keys[0], kv.k.shape), v=jax.random.normal(keys[1], kv.v.shape))
    session = jss.Session(objects={"kv": kv}, attrs={"rng": jax.random.key(1)})
    jax.block_until_ready(session)
    print("saving", flush=True)
    jss.checkpoint.save(sys.argv[1], session)
    print("saved", flush=True)
    """
)


def partial_bytes(root):
    """Bytes written so far by saves in progress (files may vanish as Orbax renames them)."""
    total = 0
    for directory, _, files in os.walk(root):
        if ".partial-" in directory:
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(directory, name))
                except FileNotFoundError:
                    pass
    return total


def test_a_save_killed_midway_leaves_the_previous_checkpoint_restorable_bit_for_bit(tmp_path):
    previous = random_session(seed=4)
    for attempt in range(5):
        root = tmp_path / f"attempt{attempt}"
        checkpoint.save(root, previous)
        with subprocess.Popen(  # closes the pipe when done
            [sys.executable, "-c", CHILD_SAVE, str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        ) as child:
            assert child.stdout.readline().strip() == "saving"
            deadline = time.monotonic() + 60
            while partial_bytes(root) < 1 << 20 and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            child.send_signal(signal.SIGKILL)
            child.wait()
        if not (root / "ckpt-000002").exists():  # the kill landed mid-save
            break
    else:
        pytest.fail("every save finished before it could be killed")
    assert partial_bytes(root) >= 1 << 20, "the save was killed before it wrote any array data"
    assert_same(checkpoint.restore(root), previous)
    checkpoint.save(root, random_session(seed=5))  # the next save clears what the crash left
    assert_only_checkpoint(root, "ckpt-000002")


def newest_manifest(root):
    return root / "ckpt-000001" / "manifest.json"


def largest_data_file(root):
    return max((f for f in (root / "ckpt-000001" / "arrays").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def edit_manifest(root, edit, *, resign=True):
    """Edits the manifest; ``resign``: with a matching digest, as a writer with a bug would."""
    manifest = json.loads(newest_manifest(root).read_text())
    edit(manifest)
    if resign:
        manifest.pop("digest")
        manifest["digest"] = _digest.manifest_digest(manifest)
    newest_manifest(root).write_text(json.dumps(manifest))


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, match",
    [
        (
            lambda root: edit_manifest(root, lambda m: m.update(version=checkpoint.VERSION + 1)),
            f"format version {checkpoint.VERSION + 1}; this library reads version {checkpoint.VERSION}",
        ),
        (lambda root: edit_manifest(root, lambda m: m.update(format="other")), "is not a jax_session_state.checkpoint"),
        (lambda root: edit_manifest(root, lambda m: m.update(content="queue")), "holds 'queue'"),
        (
            lambda root: edit_manifest(
                root, lambda m: m["record"]["objects"]["kv"].update(recompute_cost=2.0), resign=False
            ),
            r"manifest.json does not match its digest: the file is damaged",
        ),
        (
            lambda root: edit_manifest(root, lambda m: m["arrays"]["0"].update(dtype="uint33")),
            "array '0' .*names dtype 'uint33', which is not one a checkpoint holds",
        ),
        (
            lambda root: edit_manifest(root, lambda m: m["arrays"]["0"].update(dtype="int16")),
            "'int16'.*do not fit its spec",
        ),
        (lambda root: edit_manifest(root, lambda m: m["arrays"]["0"].pop("digest")), "manifest.json is malformed"),
        (
            lambda root: edit_manifest(
                root, lambda m: m["record"]["objects"]["cond"].update(recompute_source=["nowhere"])
            ),
            "does not make a valid session",
        ),
        (lambda root: edit_manifest(root, lambda m: m.pop("record")), "manifest.json is malformed"),
        (
            lambda root: edit_manifest(root, lambda m: m["record"]["objects"]["kv"].update(kind="nowhere:KVCache")),
            "names the state-object kind 'nowhere:KVCache', which is not defined in this process",
        ),
        (
            lambda root: edit_manifest(root, lambda m: m["record"]["objects"]["kv"]["spec"].update(capacity=17)),
            "do not fit its spec",
        ),
        (lambda root: os.truncate(newest_manifest(root), 100), "manifest.json cannot be read"),
        (
            lambda root: os.truncate(largest_data_file(root), largest_data_file(root).stat().st_size // 2),
            "arrays claim .* bytes, but the files under .* hold .*truncated or missing",
        ),
        (lambda root: largest_data_file(root).with_name(".zarray").write_text("{"), "the arrays cannot be read"),
        (lambda root: flip_bytes(largest_data_file(root)), "does not match its digest"),
    ],
)
# When one array cannot be read, Orbax leaves the reads of the others to the garbage collector
# (their warnings are ignored in setup.cfg); most are collected here.
def test_a_damaged_or_foreign_checkpoint_is_refused_clearly(tmp_path, damage, match):
    big = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=4096)  # its data is the largest file
    rows = jax.random.normal(jax.random.key(0), (2, B, 4096, H, D))
    checkpoint.save(tmp_path, random_session(seed=6).with_objects(big=big.append((rows[0], rows[1]))))
    damage(tmp_path)
    with pytest.raises(jss.CheckpointError, match=match):
        checkpoint.restore(tmp_path)
    gc.collect()


def test_two_values_swapped_inside_a_row_are_caught(tmp_path):
    big = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=4096)
    rows = jax.random.normal(jax.random.key(1), (2, B, 4096, H, D))
    checkpoint.save(tmp_path, random_session(seed=6).with_objects(big=big.append((rows[0], rows[1]))))
    path = largest_data_file(tmp_path)
    data = bytearray(path.read_bytes())
    assert data[0:4] != data[4:8]
    data[0:4], data[4:8] = data[4:8], data[0:4]  # two float32 values of one row trade places
    path.write_bytes(bytes(data))
    with pytest.raises(jss.CheckpointError, match=r"array big\.\['[kv]'\] does not match its digest"):
        checkpoint.restore(tmp_path)


def test_an_edited_attr_value_is_refused_not_restored(tmp_path):
    session = jss.Session(objects={"c": jss.FixedState.allocate(shapes=(2,)).commit(jnp.ones(2))}, attrs={"step": 3})
    manifest = checkpoint.save(tmp_path, session) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"value": 3', '"value": 4'))
    with pytest.raises(jss.CheckpointError, match=r"ckpt-000001/manifest.json does not match its digest"):
        checkpoint.restore(tmp_path)


def fuzz_session():
    """What the review's edits changed silently: names, FixedState keys, attrs, a typed key, a sink, costs."""
    session = jss.Session(
        objects={
            "kv": jss.KVCache.allocate(
                batch=1, kv_heads=1, head_dim=2, capacity=4, recompute_source="cond", recompute_cost=2.5
            ),
            "ring": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, window=2, sink=0, max_staged=1),
            "cond": jss.FixedState.allocate(shapes={"h": (1, 2), "c": (3,)}),
        },
        attrs={"rng": jax.random.key(3), "step": 3, "ratio": 0.5, "name": "run", "table": np.arange(3.0)},
    )
    ones = jnp.ones((1, 1, 1, 2))
    return session.append(
        kv=(ones, 2 * ones), ring=(3 * ones, ones), cond={"h": jnp.full((1, 2), 0.25), "c": jnp.arange(3.0)}
    )


def test_every_single_character_edit_of_a_manifest_restores_the_same_session_or_raises(tmp_path):
    session = fuzz_session()
    path = checkpoint.save(tmp_path, session) / "manifest.json"
    text = path.read_text()
    rng = np.random.default_rng(0)
    alphabet = '0123456789abcdefghijklmnopqrstuvwxyz"{}[],:. -_eE'
    outcomes = {"same": 0, "refused": 0}
    for trial in range(600):
        i = int(rng.integers(len(text)))
        how = ("replace", "delete", "insert")[trial % 3]
        char = alphabet[int(rng.integers(len(alphabet)))]
        edited = {
            "replace": text[:i] + char + text[i + 1 :],
            "delete": text[:i] + text[i + 1 :],
            "insert": text[:i] + char + text[i:],
        }[how]
        if edited == text:
            continue
        path.write_text(edited)
        try:
            restored = checkpoint.restore(tmp_path)
        except jss.CheckpointError:
            outcomes["refused"] += 1
            continue
        assert_same(restored, session)  # anything else would be wrong data restored silently
        outcomes["same"] += 1
    assert outcomes["refused"] > 300 and outcomes["same"] > 0, outcomes  # both happen: whitespace edits change nothing


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(jss.CheckpointError, match="not a directory"):
        checkpoint.restore(tmp_path / "missing")
    with pytest.raises(jss.CheckpointError, match="no complete checkpoint"):
        checkpoint.restore(tmp_path)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda s: s.with_objects(kv=jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=32)),
            "object 'kv' is KVCache",
        ),
        (
            lambda s: s.replace(objects={n: o for n, o in s.objects.items() if n != "bank"}),
            "objects \\[.*'bank'.*\\] in the checkpoint",
        ),
        (lambda s: s.with_attrs(step=jnp.float32(3)), "attrs .* in the checkpoint"),
        (lambda s: s.with_attrs(rng=jax.random.key(0, impl="unsafe_rbg")), "attrs .* in the checkpoint"),
    ],
)
def test_a_target_that_does_not_match_is_refused_naming_the_difference(tmp_path, change, match):
    session = random_session(seed=7)
    checkpoint.save(tmp_path, session)
    with pytest.raises(jss.CheckpointError, match=match):
        checkpoint.restore(tmp_path, target=change(session))


class Opaque:
    """Not something a checkpoint can record."""


@pytest.mark.parametrize(
    "session, error, match",
    [
        (
            jss.Session(objects={}, attrs={"what": Opaque()}),
            jss.CheckpointError,
            "attrs\\['what'\\]: cannot save an attr",
        ),
        (
            jss.Session(objects={}, attrs={"view": jss.LatentView(items=jnp.ones(2), count=jnp.int32(1))}),
            jss.CheckpointError,
            "cannot record a pytree node of type LatentView",
        ),
        ({"not": "a session"}, jss.PayloadTypeError, "saves a Session"),
    ],
)
def test_what_cannot_be_saved_is_refused_before_anything_is_written(tmp_path, session, error, match):
    with pytest.raises(error, match=match):
        checkpoint.save(tmp_path, session)
    assert not any(tmp_path.iterdir())


def test_a_kind_defined_inside_a_function_cannot_be_saved(tmp_path):
    class LocalKV(jss.KVCache, kw_only=True):
        pass

    local = LocalKV.allocate(batch=1, kv_heads=1, head_dim=1, capacity=1)
    with pytest.raises(jss.CheckpointError, match="LocalKV is defined inside a function"):
        checkpoint.save(tmp_path, jss.Session(objects={"kv": local}))


def test_restore_arguments_are_checked(tmp_path):
    checkpoint.save(tmp_path, random_session(seed=8))
    with pytest.raises(jss.PayloadTypeError, match=r"target=\.\.\.\) takes a Session"):
        checkpoint.restore(tmp_path, target={"kv": 1})
    with pytest.raises(jss.PayloadTypeError, match=r"shardings=\.\.\.\) takes ShardingRules"):
        checkpoint.restore(tmp_path, shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def test_restore_places_objects_by_the_given_rules(tmp_path):
    session = random_session(seed=9)
    checkpoint.save(tmp_path, session)
    mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
    rules = jss.ShardingRules(mesh, {"kv_heads": "model"})
    restored = checkpoint.restore(tmp_path, shardings=rules)
    assert all(obj.sharding == rules for obj in restored.objects.values())
    assert restored["kv"].k.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert restored.attrs["rng"].sharding == rules.replicated()
    assert_same(restored, session.replace(objects={n: o.replace(sharding=rules) for n, o in session.objects.items()}))
    placed_like_target = checkpoint.restore(tmp_path, target=restored)
    assert placed_like_target["kv"].sharding == rules


# ----------------------------------------------------------------- managers
def _served_session(i):
    session = jss.Session(
        objects={
            "prompt": jss.FixedState.allocate(shapes=(1, 64)),
            "cond": jss.FixedState.allocate(shapes=(1, 64), recompute_source="prompt"),
            "kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, capacity=64),
        },
        attrs={"rng": jax.random.key(i)},
    )
    rows = jnp.asarray(np.random.default_rng(i).normal(size=(1, 5, 2, 8)), jnp.float32)
    prompt = jnp.asarray(np.random.default_rng(100 + i).normal(size=(1, 64)), jnp.float32)
    return session.append(prompt=prompt, cond=2 * prompt, kv=(rows, rows))


def _manager(budget_sessions=3, **kwargs):
    manager = jss.SessionStateManager(byte_budget={DEVICE: budget_sessions * _served_session(0).nbytes}, **kwargs)
    manager.register_recompute("cond", lambda s: s["cond"].empty().commit(2 * s["prompt"].view()))
    return manager


def _holdings(manager):
    return {sid: (sorted(h.parked), sorted(h.evicted)) for sid, h in manager.held().items()}


def test_a_manager_round_trips_its_sessions_lru_order_parks_and_drops(tmp_path):
    manager = _manager()
    originals = {sid: _served_session(i) for i, sid in enumerate(["a", "b", "c", "d", "e"])}
    for sid, session in originals.items():
        manager.create(sid, session.fork())
    manager.get("b")  # b becomes the most recently used
    with manager.pin("c"):
        checkpoint.save(tmp_path, manager)
    saved_holdings = _holdings(manager)
    assert any(parked for parked, _ in saved_holdings.values()) and any(d for _, d in saved_holdings.values())

    restored = checkpoint.restore(tmp_path, target=_manager())
    assert list(restored.held()) == list(manager.held())  # least recently used first
    assert _holdings(restored) == saved_holdings  # the same rules, the same holdings
    stats = restored.stats()
    assert stats["sessions"] == 5 and stats["lookups"] == stats["parks"] == stats["evictions"] == 0
    assert not any(h.pinned for h in restored.held().values())  # pins are not persisted
    for sid, session in originals.items():
        back = restored.get(sid)  # parked objects copied back, dropped ones recomputed
        for name in session.objects:
            for x, y in zip(jax.tree_util.tree_leaves(back[name]), jax.tree_util.tree_leaves(session[name])):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{sid}.{name}")
        np.testing.assert_array_equal(jax.random.key_data(back.attrs["rng"]), jax.random.key_data(session.attrs["rng"]))


def test_a_manager_restores_without_a_target_with_its_saved_settings(tmp_path):
    manager = _manager(max_sessions=7, evict_when_full=False, host_budget=1 << 20)
    manager.create("only", _served_session(1))
    checkpoint.save(tmp_path, manager)
    restored = checkpoint.restore(tmp_path)
    assert isinstance(restored, jss.SessionStateManager) and restored.settings() == manager.settings()
    assert list(restored.held()) == ["only"]


def test_a_manager_restore_that_does_not_fit_leaves_the_target_empty(tmp_path):
    manager = _manager()
    for i in range(3):
        manager.create(i, _served_session(i))
    checkpoint.save(tmp_path, manager)
    small = jss.SessionStateManager(
        byte_budget={DEVICE: _served_session(0).nbytes}, evict_when_full=False, park_memory_kind=None
    )
    with pytest.raises(jss.BudgetExceededError):
        checkpoint.restore(tmp_path, target=small)
    assert len(small) == 0 and small.nbytes_by_device() == {}


def test_manager_checkpoints_refuse_what_they_cannot_do(tmp_path):
    manager = _manager()
    manager.create("busy", _served_session(0))
    step = jax.jit(lambda s: s, donate_argnums=0)
    step(manager.get("busy"))  # donated, not put back
    with pytest.raises(jss.CheckpointError, match="'busy' is in use"):
        checkpoint.save(tmp_path / "m", manager)
    manager.put("busy", _served_session(0))
    checkpoint.save(tmp_path / "m", manager)
    with pytest.raises(jss.CheckpointError, match="must be empty; it holds 1"):
        checkpoint.restore(tmp_path / "m", target=manager)
    with pytest.raises(jss.CheckpointError, match=r"holds a SessionStateManager; restore.*got a Session"):
        checkpoint.restore(tmp_path / "m", target=_served_session(0))
    checkpoint.save(tmp_path / "s", _served_session(0))
    with pytest.raises(jss.CheckpointError, match=r"holds a Session; restore.*got a SessionStateManager"):
        checkpoint.restore(tmp_path / "s", target=_manager())
