"""Checkpoints of what a session may hold beyond float arrays on the default device, restored bit for bit.

Byte orders, arrays of zero size, typed PRNG keys inside objects, host memory
kinds, weakly typed scalars and demotion functions; and the numpy dtypes a
checkpoint refuses, before anything is written.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state import checkpoint
from jax_session_state.checkpoint import _digest
from jax_session_state.manager import parking


def bits(x):
    """An array as its dtype, shape and raw bytes; a typed key as its implementation and key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x)), bits(jax.random.key_data(x))
    data = np.asarray(x)
    return data.dtype.str, data.shape, data.tobytes()


def assert_same_bits(restored, original):
    """The same pytree structure (kinds, specs, residency) and, leaf by leaf, the same bits."""
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(original)
    for x, y in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(original), strict=True):
        assert bits(x) == bits(y)


def placement(tree):
    """Where each jax array of ``tree`` is, and whether it is committed there."""
    return [(x.sharding, x.committed) for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def edit_manifest(checkpoint_dir, edit):
    """Edits the manifest and signs it again, as a writer with a bug (or an older writer) would."""
    path = checkpoint_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest.pop("digest")
    manifest["digest"] = _digest.manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("dtype", [">f4", ">i2", ">c8"])
def test_a_big_endian_numpy_attr_restores_its_values_in_native_byte_order(tmp_path, dtype):
    rng = np.random.default_rng(0)
    values = (rng.normal(size=(3, 5)) * 1000).astype(dtype)
    checkpoint.save(tmp_path, jss.Session(objects={}, attrs={"x": values}))
    restored = checkpoint.restore(tmp_path).attrs["x"]
    assert isinstance(restored, np.ndarray) and restored.dtype.isnative
    assert bits(restored) == bits(values.astype(values.dtype.newbyteorder("=")))
    np.testing.assert_array_equal(restored, values)


def session_with_empty_arrays(seed):
    """Arrays of zero size beside others: an object field, a jax attr and a numpy attr."""
    rng = np.random.default_rng(seed)
    carry = jss.FixedState.allocate(shapes={"none": (0, 4), "h": (3,)}).commit(
        {"none": jnp.zeros((0, 4)), "h": normal(rng, 3)}
    )
    attrs = {"ids": jnp.zeros((0,), jnp.int32), "table": np.zeros((2, 0), np.float16), "x": normal(rng, 2)}
    return jss.Session(objects={"carry": carry}, attrs=attrs)


def test_arrays_of_zero_size_round_trip_with_their_dtype_and_placement(tmp_path):
    original = session_with_empty_arrays(1)
    checkpoint.save(tmp_path, original)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001"]
    for restored in (checkpoint.restore(tmp_path), checkpoint.restore(tmp_path, target=original)):
        assert_same_bits(restored, original)
        assert placement(restored) == placement(original)  # on the default device, uncommitted as jnp made them
        assert restored.attrs["ids"].dtype == jnp.int32 and restored.attrs["table"].dtype == np.float16
    device = jax.devices()[0]
    committed = jax.tree_util.tree_map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, original)
    assert placement(checkpoint.restore(tmp_path, target=committed)) == placement(committed)


def test_a_session_of_only_empty_arrays_round_trips(tmp_path):
    original = jss.Session(objects={}, attrs={"ids": jnp.zeros((0, 2), jnp.uint8)})
    checkpoint.save(tmp_path, original)
    assert_same_bits(checkpoint.restore(tmp_path), original)


@pytest.mark.parametrize(
    "values",
    [
        np.array(["a", "bc"]),
        np.array([b"a", b"bc"]),
        np.array([1, None], dtype=object),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.array([3], dtype="timedelta64[s]"),
        np.zeros(2, dtype="V4"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]),
    ],
    ids=["str", "bytes", "object", "datetime", "timedelta", "void", "record"],
)
def test_numpy_attrs_of_strings_objects_dates_and_records_are_refused_before_anything_is_written(tmp_path, values):
    session = jss.Session(objects={"h": jss.FixedState.allocate(shapes=(2,))}, attrs={"meta": {"names": values}})
    with pytest.raises(jss.CheckpointError, match=r"attrs\['meta'\]\['names'\]: cannot save a numpy array of dtype"):
        checkpoint.save(tmp_path, session)
    assert not any(tmp_path.iterdir())


def session_with_keys(seed):
    """A FixedState whose value holds typed PRNG keys of two implementations, a random one in each slot."""
    rng = np.random.default_rng(seed)
    carry = jss.FixedState.allocate(
        shapes={"rng": jax.random.key(0), "lanes": jax.random.split(jax.random.key(0, impl="rbg"), 3), "h": (2,)}
    )

    def value(i):
        return {"rng": jax.random.key(seed + i), "lanes": jax.random.split(jax.random.key(seed + i, impl="rbg"), 3),
                "h": normal(rng, 2)}

    carry = carry.commit(value(1)).stage(value(0))  # a committed value and a staged one
    return jss.Session(objects={"carry": carry}, attrs={"rng": jax.random.key(seed + 2)})


def test_typed_keys_inside_an_object_round_trip(tmp_path):
    original = session_with_keys(2)
    checkpoint.save(tmp_path, original)
    for restored in (checkpoint.restore(tmp_path), checkpoint.restore(tmp_path, target=original)):
        assert_same_bits(restored, original)  # the specs equal too: the keys' implementations among them


def test_a_key_entry_of_another_implementation_than_its_spec_is_refused(tmp_path):
    directory = checkpoint.save(tmp_path, session_with_keys(3))
    (key,) = [k for k, e in json.loads((directory / "manifest.json").read_text())["arrays"].items()
              if e["where"] == "carry.['value']['rng']"]
    edit_manifest(directory, lambda m: m["arrays"][key].update(impl="unsafe_rbg"))
    with pytest.raises(jss.CheckpointError, match=r"session object 'carry': the checkpoint's arrays .* do not fit"):
        checkpoint.restore(tmp_path)


def test_a_target_in_pinned_host_memory_restores_there(tmp_path):
    rng = np.random.default_rng(4)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    parked = parking.park(jss.FixedState.allocate(shapes=(3, 4)).commit(normal(rng, 3, 4))).obj
    original = jss.Session(objects={"carry": parked}, attrs={"x": jax.device_put(normal(rng, 5), host)})
    checkpoint.save(tmp_path, original)
    restored = checkpoint.restore(tmp_path, target=original)
    assert_same_bits(restored, original)
    assert placement(restored) == placement(original)
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(restored)} == {"pinned_host"}
    back = parking.restore(parking.park(restored["carry"]))  # and it steps on once brought back
    assert bits(back.view()) == bits(parked.view())


def test_weakly_typed_attrs_stay_weak_so_a_jitted_step_traces_once(tmp_path):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(session):
        return session.with_attrs(step=session.attrs["step"] + 1, scale=session.attrs["scale"] * 2)

    rng = np.random.default_rng(5)
    original = jss.Session(
        objects={"h": jss.FixedState.allocate(shapes=(2,)).commit(normal(rng, 2))},
        attrs={"step": jnp.asarray(int(rng.integers(100))), "scale": jnp.asarray(float(rng.normal()))},
    )
    assert original.attrs["step"].weak_type and original.attrs["scale"].weak_type
    original = step(original)
    checkpoint.save(tmp_path, original)
    for restored in (checkpoint.restore(tmp_path), checkpoint.restore(tmp_path, target=original)):
        assert_same_bits(restored, original)
        assert restored.attrs["step"].weak_type and restored.attrs["scale"].weak_type
        assert placement(restored) == placement(original)
        assert_same_bits(step(restored), step(original))  # one trace for all: a second one raises


def test_an_entry_without_weak_type_restores_strongly_typed(tmp_path):
    directory = checkpoint.save(tmp_path, jss.Session(objects={}, attrs={"step": jnp.asarray(7)}))
    edit_manifest(directory, lambda m: m["arrays"]["0"].pop("weak_type"))  # as checkpoints written before the mark
    restored = checkpoint.restore(tmp_path).attrs["step"]
    assert not restored.weak_type and restored.dtype == jnp.int32 and int(restored) == 7


def halved(item):
    """A demotion function (module level, as a target's may be anything)."""
    return (item * 0.5).astype(item.dtype)


def test_a_target_gives_the_restored_objects_its_demotion_functions(tmp_path):
    rng = np.random.default_rng(6)
    frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(2,), demote_fn=halved).append(normal(rng, 3, 2))
    original = jss.Session(objects={"frames": frames})
    checkpoint.save(tmp_path, original)
    restored = checkpoint.restore(tmp_path, target=original)
    assert restored["frames"].demote_fn is halved
    assert_same_bits(restored, original)  # the tree structures equal: demote_fn is static
    assert bits(restored["frames"].demote().view().items) == bits(frames.demote().view().items)
    assert checkpoint.restore(tmp_path)["frames"].demote_fn is None  # not recorded: only a target can give it
