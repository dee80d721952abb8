"""Byte accounting: device keys, memory kinds, numpy, de-duplication, sharded arrays."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.accounting import SeenStorages, device_bytes, device_key, tree_bytes_by_device
from tests.support.devices import DEVICE


def test_default_memory_device_key():
    cpu = jax.devices("cpu")[0]  # present on every backend
    assert device_key(cpu) == "cpu:0"
    assert device_bytes(jax.device_put(jnp.zeros((3, 5), jnp.float32), cpu)) == {"cpu:0": 60}
    assert device_bytes(jnp.zeros((3, 5), jnp.float32)) == {DEVICE: 60}  # the default device


def test_memory_kind_is_part_of_the_key():
    device = jax.devices()[0]
    pinned = jax.device_put(
        jnp.zeros((8,), jnp.float32), jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    )
    assert device_bytes(pinned) == {f"{device_key(device)}/pinned_host": 32}


def test_numpy_counts_as_host_and_deduplicates():
    a = np.zeros((10,), np.float64)
    seen = SeenStorages()
    assert device_bytes(a, seen) == {"host": 80}
    assert device_bytes(a, seen) == {}
    assert device_bytes(a.copy(), seen) == {"host": 80}


def test_scalars_and_deleted_arrays_hold_nothing():
    x = jnp.ones((4,))
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    assert x.is_deleted() and device_bytes(x) == {}
    assert device_bytes(3.0) == {} and device_bytes(None) == {}


def test_tracers_are_refused():
    with pytest.raises(jss.PayloadTypeError, match="traced value"):
        jax.jit(lambda a: device_bytes(a))(jnp.ones(2))


def test_one_seen_set_across_objects():
    kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=8)
    seen = SeenStorages()
    first = kv.nbytes_by_device(seen)
    assert first == {DEVICE: kv.nbytes} and kv.nbytes_by_device(seen) == {}


SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_session_state.accounting import device_bytes
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    x = jax.device_put(jnp.zeros((8, 16), jnp.float32), NamedSharding(mesh, P("a", None)))
    split = device_bytes(x)
    assert split == {f"cpu:{i}": 8 * 16 * 4 // 4 for i in range(8)}, split
    r = jax.device_put(jnp.zeros((8,), jnp.float32), NamedSharding(mesh, P()))
    assert device_bytes(r) == {f"cpu:{i}": 32 for i in range(8)}, device_bytes(r)
    print("ok")
    """
)


def test_sharded_arrays_count_each_shard_on_its_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_numpy_views_count_the_array_they_read_once():
    rng = np.random.default_rng(0)
    a = rng.normal(size=1000)  # 8000 bytes
    assert tree_bytes_by_device({"a_head": a[:1], "b_all": a}) == {"host": a.nbytes}
    assert jss.Session(objects={}, attrs={"a_head": a[:1], "b_all": a}).nbytes_by_device() == {"host": a.nbytes}
    assert tree_bytes_by_device({"x": a[500:], "y": a[:600]}) == {"host": a.nbytes}  # overlapping views
    assert device_bytes(a[::2][:3]) == {"host": a.nbytes}  # a view of a view
    b = rng.normal(size=1000)
    assert tree_bytes_by_device({"a": a[:10], "b": b[:10]}) == {"host": a.nbytes + b.nbytes}
