"""Checkpoints of sharded sessions: saved on 8 devices, restored re-sharded onto 4 and onto 1."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_session_state as jss
from jax_session_state import checkpoint
from jax_session_state.checkpoint import _digest
from tests.support.meshes import auto_mesh, shard_pointers, shardings

B, H, D, CAPACITY = 2, 8, 4, 32
AXES = {"batch": "data", "kv_heads": "model", "hidden": "model"}
RULES = jss.ShardingRules(auto_mesh((2, 4), ("data", "model")), AXES)


def sharded_session(rules=RULES):
    return jss.Session(
        objects={
            "kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=CAPACITY, sharding=rules),
            "carry": jss.FixedState.allocate(shapes={"h": (B, 8)}, axes={"h": ("batch", "hidden")}, sharding=rules),
            "bank": jss.RetrievalStore.allocate(capacity=4, key_dim=8, value_shapes=(8,), sharding=rules),
        },
        attrs=jax.device_put({"rng": jax.random.key(11), "step": jnp.int32(0)}, rules.replicated()),
    )


def step(session):
    key, k_key, v_key = jax.random.split(session.attrs["rng"], 3)
    k, v = (jax.random.normal(x, (B, 2, H, D)) for x in (k_key, v_key))
    h = jnp.tanh(session["carry"].value["h"] + k.sum(axis=(1, 3)))
    session = session.append(kv=(k, v), carry={"h": h}, bank=(h, h))
    return session.with_attrs(rng=key, step=session.attrs["step"] + 1)


run = jax.jit(step, donate_argnums=0)


def rolled_out(steps=3):
    session = sharded_session()
    for _ in range(steps):
        session = run(session)
    return session


def host(session):
    """Every leaf on the host, typed keys as their key data."""
    return [
        np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree_util.tree_leaves(session)
    ]


def unplaced(session):
    return session.replace(objects={name: obj.replace(sharding=None) for name, obj in session.objects.items()})


def assert_equal_bits(a, b):
    """Same kinds, specs and residency (placement aside), and the same bits in every leaf."""
    assert jax.tree_util.tree_structure(unplaced(a)) == jax.tree_util.tree_structure(unplaced(b))
    for x, y in zip(host(a), host(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("devices", [4, 1])
def test_restore_onto_a_smaller_mesh_reshards(tmp_path, devices):
    saved = rolled_out()
    checkpoint.save(tmp_path, saved)
    mesh = auto_mesh((1, devices), ("data", "model"), devices=jax.devices()[8 - devices:])
    rules = jss.ShardingRules(mesh, AXES)
    restored = checkpoint.restore(tmp_path, shardings=rules)
    assert_equal_bits(restored, saved)
    for x in shardings(restored):
        assert x.mesh == mesh
    assert restored["kv"].k.sharding.spec == P("data", "model")
    assert {s.data.shape for s in restored["kv"].k.addressable_shards} == {(B, H // devices, CAPACITY, D)}


def test_restore_without_placement_lands_on_the_default_device(tmp_path):
    saved = rolled_out()
    checkpoint.save(tmp_path, saved)
    restored = checkpoint.restore(tmp_path)
    assert {d for x in shardings(restored) for d in x.device_set} == {jax.local_devices()[0]}
    assert all(obj.sharding is None for obj in restored.objects.values())
    assert_equal_bits(restored, saved)


def test_restore_without_placement_honours_jax_default_device(tmp_path):
    saved = rolled_out()
    checkpoint.save(tmp_path, saved)
    chosen = jax.devices()[5]
    with jax.default_device(chosen):
        restored = checkpoint.restore(tmp_path)
        made_by_jnp = jnp.ones(2)
    assert {d for x in shardings(restored) for d in x.device_set} == made_by_jnp.devices() == {chosen}
    assert not any(x.committed for x in jax.tree_util.tree_leaves(restored) if isinstance(x, jax.Array))
    assert_equal_bits(restored, saved)


def test_rules_that_cannot_place_a_restored_object_are_refused_naming_the_argument(tmp_path):
    odd = jss.KVCache.allocate(batch=3, kv_heads=H, head_dim=D, capacity=CAPACITY)  # 3 rows over 2 "data" devices
    checkpoint.save(tmp_path, jss.Session(objects={"kv": odd}))
    with pytest.raises(jss.PayloadError, match=r"^restore\(shardings=\.\.\.\): KVCache\(batch=3.*does not divide"):
        checkpoint.restore(tmp_path, shardings=RULES)
    whole = jss.ShardingRules(RULES.mesh, {"kv_heads": "model"})
    target = jss.Session(objects={"kv": odd.with_sharding(whole)})
    target = target.with_objects(kv=target["kv"].replace(sharding=RULES))  # the target's own rules do not fit
    with pytest.raises(jss.PayloadError, match=r"^restore\(target=\.\.\.\): KVCache\(batch=3.*does not divide"):
        checkpoint.restore(tmp_path, target=target)


def test_a_restored_sharded_session_continues_bit_for_bit_and_in_place(tmp_path):
    original = rolled_out()
    checkpoint.save(tmp_path, original)
    restored = checkpoint.restore(tmp_path, target=sharded_session())  # placement from the target's rules
    assert shardings(restored) == shardings(original)
    for _ in range(4):
        pointers = shard_pointers(original), shard_pointers(restored)
        original, restored = run(original), run(restored)
        assert (shard_pointers(original), shard_pointers(restored)) == pointers  # saving kept no views either
    assert_equal_bits(restored, original)


CHILD_RESTORE = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    import jax_session_state as jss
    devices = jax.device_count()
    mesh = jax.make_mesh((1, devices), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = jss.ShardingRules(mesh, {"batch": "data", "kv_heads": "model", "hidden": "model"})
    session = jss.checkpoint.restore(sys.argv[1], shardings=rules)
    expected = np.load(sys.argv[2])
    leaves = jax.tree_util.tree_leaves(session)
    for i, x in enumerate(leaves):
        x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        np.testing.assert_array_equal(np.asarray(x), expected[str(i)])
    assert len(leaves) == len(expected.files)
    k = session["kv"].k
    assert len(k.sharding.device_set) == devices and k.addressable_shards[0].data.shape[1] == 8 // devices
    print("restored on", devices, "devices")
    """
)


@pytest.mark.parametrize("devices", [4, 1])
def test_restore_in_a_process_with_fewer_devices(tmp_path, devices):
    saved = rolled_out()
    checkpoint.save(tmp_path / "ckpt", saved)
    np.savez(tmp_path / "expected.npz", **{str(i): x for i, x in enumerate(host(saved))})
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD_RESTORE, str(tmp_path / "ckpt"), str(tmp_path / "expected.npz")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert f"restored on {devices} devices" in result.stdout


@pytest.mark.parametrize("spec", [P("data", "model"), P(None, ("data", "model")), P(None, None, None, "data"), P()])
def test_digests_do_not_depend_on_sharding(spec):
    x = jax.random.normal(jax.random.key(3), (B, H, 16, D))
    whole = _digest.array_digests({"x": np.asarray(x)})["x"]
    sharded = jax.device_put(x, jax.sharding.NamedSharding(RULES.mesh, spec))
    assert _digest.array_digests({"x": sharded})["x"] == whole  # the whole array's bytes, in row-major order
    assert _digest.array_digests({"x": sharded.at[1, 7, 9, 3].add(1.0)})["x"] != whole
