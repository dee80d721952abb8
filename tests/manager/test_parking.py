"""Parking state in host memory and bringing it back: bytes move, contents and shardings come back exactly."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library, _placement
from jax_session_state.manager import parking
from tests.support.devices import DEVICE, PINNED
from tests.support.kinds import KINDS
from tests.support.world import assert_same


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_park_and_restore_every_kind_bit_for_bit(kind):
    factory, payload = KINDS[kind]
    rng = np.random.default_rng(0)
    obj = factory().append(payload(rng)).stage(payload(rng))
    nbytes = obj.nbytes
    parked = parking.park(obj)
    assert obj.nbytes_by_device() == {DEVICE: nbytes}  # the original is untouched
    assert parked.nbytes_by_device() == {PINNED: nbytes}
    assert {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(parked.obj)} == {"pinned_host"}
    restored = parking.restore(parked)
    assert restored.nbytes_by_device() == {DEVICE: nbytes}
    assert_same(restored, obj)
    assert type(restored) is type(obj) and restored.describe() == obj.describe()


def test_a_parked_object_cannot_enter_a_jitted_step_and_a_restored_one_does_not_retrace():
    traces = []

    @jax.jit
    def read(cache):
        traces.append(1)
        return cache.view().k.sum()

    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32)
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8).append((rows, rows))
    expected = read(cache)
    parked = parking.park(cache)
    # JAX's own TypeError: Parked is deliberately not a pytree, so jit refuses it.
    with pytest.raises(TypeError, match=r"as an abstract array.*parking\.Parked"):
        read(parked)
    assert read(parking.restore(parked)) == expected and len(traces) == 1


def test_park_refuses_what_it_cannot_park():
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
    with pytest.raises(jss.NotResidentError, match=r"park\(\) of KVCache.*not resident"):
        parking.park(cache.evict()[0])
    with pytest.raises(jss.PayloadError, match=r"has no 'tape' memory; it has \[.*'pinned_host'"):
        parking.park(cache, "tape")
    donated = cache.empty()
    jax.jit(lambda c: c.discard(), donate_argnums=0)(donated)
    assert _placement.is_donated(donated) and not _placement.is_donated(cache)
    with pytest.raises(jss.DonatedError, match="arrays were deleted"):
        parking.park(donated)


@pytest.mark.parametrize(
    "what, name",
    [(lambda: jnp.ones(3), "ArrayImpl"), (lambda: jss.Session(objects={}), "Session"), (lambda: {"k": 1}, "dict")],
    ids=["array", "session", "dict"],
)
def test_park_of_what_is_not_a_state_object_is_refused_naming_its_type(what, name):
    with pytest.raises(jss.PayloadTypeError, match=rf"park\(\) takes a state object .*; got {name}\."):
        parking.park(what())


def test_runtime_owned_leaves_arrays_in_host_memory_where_they_are():
    values = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    x = jax.device_put(values, host)
    owned = _placement.runtime_owned(x)  # no donated identity over host memory (XLA:CPU may abort on one)
    assert owned is x and not x.is_deleted()
    assert owned.sharding == host and owned.committed
    assert np.asarray(owned).tobytes() == values.tobytes()


BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **kw: (
        BACKEND_COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


@pytest.mark.parametrize("committed", [False, True], ids=["uncommitted", "committed"])
def test_restored_arrays_are_committed_as_they_were_so_a_step_does_not_compile_again(committed):
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
    if committed:
        cache = jax.device_put(cache, jax.devices()[0])
    step = jax.jit(lambda c: c.append((jnp.ones((1, 1, 2, 4)), jnp.ones((1, 1, 2, 4)))).discard())
    cache = step(cache)
    compiles = []
    for _ in range(4):  # the first cycle compiles the copies that parking and restoring make
        compiles.append(len(BACKEND_COMPILES))
        restored = parking.restore(parking.park(cache))
        assert [x.committed for x in jax.tree_util.tree_leaves(restored)] == [
            x.committed for x in jax.tree_util.tree_leaves(cache)
        ]
        assert {x.committed for x in jax.tree_util.tree_leaves(cache)} == {committed}
        assert_same(restored, cache)
        cache = step(restored)
        recomputed = _placement.Placement.of(cache).apply(cache.empty())  # what the manager does to a recomputed object
        n_leaves = len(jax.tree_util.tree_leaves(cache))
        assert [x.committed for x in jax.tree_util.tree_leaves(recomputed)] == [committed] * n_leaves
        step(recomputed)
    assert compiles[1] == len(BACKEND_COMPILES)  # then nothing compiles: the step runs its one executable


def test_placement_refuses_another_structure():
    cache = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
    other = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=16)
    placement = _placement.Placement.of(cache)
    for wrong in (jss.FixedState.allocate(shapes=(2,)), other):  # another kind; another spec of the kind
        with pytest.raises(jss.PayloadError, match=r"cannot place .* where an object of another structure was"):
            placement.apply(wrong)
    assert_same(placement.apply(cache.empty()), cache)


def _host_bytes_at(offset, nbytes, dtype, seed):
    """Random bytes of ``dtype`` (0 and 1 for bool) in host memory ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    host = raw[start : start + nbytes]
    host[...] = np.random.default_rng(seed).integers(0, 2 if dtype == "bool" else 256, nbytes, dtype=np.uint8)
    return host.view(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8", "bool", "uint32"])
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_a_large_host_array_is_placed_uncommitted_in_a_buffer_the_runtime_owns(dtype, offset, monkeypatch):
    # From 2 MiB on the CPU placement copies by the native library, which asks for huge pages first.
    copies = []
    if _library.AVAILABLE:
        monkeypatch.setattr(_library, "owned_copy", lambda x, copy=_library.owned_copy: copies.append(x) or copy(x))
    host = _host_bytes_at(offset, 3 << 20, dtype, seed=offset)
    placed = _placement.place(host, jax.sharding.SingleDeviceSharding(jax.devices()[0]), committed=False)
    assert not placed.committed and placed.dtype == host.dtype and placed.shape == host.shape
    assert np.asarray(placed).tobytes() == host.tobytes()
    assert placed.unsafe_buffer_pointer() != host.ctypes.data
    assert len(copies) == int(_library.AVAILABLE)
    at = placed.unsafe_buffer_pointer()
    assert jax.jit(lambda x: x, donate_argnums=0)(placed).unsafe_buffer_pointer() == at  # owned: donation reuses it


@pytest.mark.skipif(not _library.AVAILABLE, reason="the native library is not built here")
def test_the_native_copy_moves_every_byte_into_a_new_buffer_and_keeps_committed():
    x = jax.device_put(_host_bytes_at(0, 5 << 20, "float32", seed=3).copy(), jax.devices()[0])
    copied = _library.owned_copy(x)
    assert copied.unsafe_buffer_pointer() != x.unsafe_buffer_pointer() and copied.committed
    assert np.asarray(copied).tobytes() == np.asarray(x).tobytes()
    assert not _library.owned_copy(jnp.zeros((7, 3), jnp.bfloat16) + 1).committed


SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_session_state as jss
    from jax_session_state.manager import parking

    mesh = Mesh(np.array(jax.devices()[:2]), ("heads",))
    def make(seed):
        rng = np.random.default_rng(seed)
        rows = jnp.asarray(rng.normal(size=(1, 5, 4, 8)), jnp.float32)
        kv = jss.KVCache.allocate(batch=1, kv_heads=4, head_dim=8, capacity=16).append((rows, rows))
        kv = kv.replace(k=jax.device_put(kv.k, NamedSharding(mesh, P(None, "heads"))),
                        v=jax.device_put(kv.v, NamedSharding(mesh, P(None, "heads"))))
        return jss.Session(objects={"kv": kv})

    a = make(0)
    shardings = [leaf.sharding for leaf in jax.tree_util.tree_leaves(a)]
    per_device = a.nbytes_by_device()
    assert set(per_device) == {"cpu:0", "cpu:1"}, per_device
    parked = parking.park(a["kv"])
    assert parked.nbytes_by_device() == {k + "/pinned_host": n for k, n in per_device.items()}
    back = parking.restore(parked)
    assert [leaf.sharding for leaf in jax.tree_util.tree_leaves(back)] == shardings
    for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(a)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()

    events = []
    budget = {"cpu:1": per_device["cpu:1"] + 100}
    manager = jss.SessionStateManager(byte_budget=budget, on_event=events.append)
    manager.create("a", a)
    manager.create("b", make(1))
    assert [(e.kind, e.session_id) for e in events] == [("park", "a")], events
    assert manager.nbytes_by_device()["cpu:1/pinned_host"] == per_device["cpu:1"]
    got = manager.get("a")
    assert [leaf.sharding for leaf in jax.tree_util.tree_leaves(got)] == shardings
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(make(0))):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    print("ok")
    """
)


def test_sharded_state_is_parked_per_device_and_restored_to_its_sharding():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
