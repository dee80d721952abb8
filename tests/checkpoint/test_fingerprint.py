"""Digests of checkpointed arrays and manifests: any changed, swapped or moved byte changes them."""

import binascii
import hashlib

import jax.numpy as jnp
import numpy as np
import pytest

from jax_session_state.checkpoint import _digest

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_, jnp.complex64, jnp.uint32]


def random_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == jnp.bool_:
        return jnp.asarray(rng.integers(0, 2, size=shape).astype(bool))
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(0, 100, size=shape), dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), dtype)
    return jnp.asarray(rng.normal(size=shape), dtype)


def digest(x):
    return _digest.array_digests({"x": x})["x"]


def reference_digest(x):
    """The documented construction, written out with hashlib and binascii: header, then each chunk's CRC-32."""
    data = np.ascontiguousarray(np.asarray(x))
    raw = data.tobytes()
    root = hashlib.blake2b(f"{data.dtype.name}{data.shape}".encode(), digest_size=32, person=b"jss-array")
    for i in range(0, max(len(raw), 1), _digest.CHUNK):
        root.update(binascii.crc32(raw[i : i + _digest.CHUNK]).to_bytes(4, "little"))
    return root.hexdigest()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_one_changed_element_changes_the_digest(dtype):
    x = random_array((3, 5, 4), dtype)
    changed = x.at[1, 2, 3].set(~x[1, 2, 3] if dtype == jnp.bool_ else x[1, 2, 3] + 1)
    assert digest(x) == digest(jnp.array(x, copy=True)) == reference_digest(x)
    assert digest(changed) != digest(x)


def test_swapped_values_inside_a_row_and_moved_rows_change_the_digest():
    x = random_array((4, 6), jnp.float32)
    assert digest(x[:, jnp.array([1, 0, 2, 3, 4, 5])]) != digest(x)  # two values of every row trade places
    assert digest(x[jnp.array([1, 0, 2, 3])]) != digest(x)
    assert digest(x.reshape(6, 4)) != digest(x)  # the same bytes in another shape


def test_arrays_larger_than_a_chunk_are_hashed_as_the_documented_tree():
    x = np.random.default_rng(1).normal(size=(_digest.CHUNK // 8 * 3 + 5,)).astype(np.float32)  # 1.5 chunks
    assert digest(x) == reference_digest(x)
    y = x.copy()
    y[-1] += 1  # a change in the last, partial chunk
    assert digest(y) != digest(x)


def test_random_flips_swaps_and_shifts_anywhere_in_a_large_array_change_the_digest():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(_digest.CHUNK // 4 * 5 // 2,)).astype(np.float32)  # 2.5 chunks
    saved = digest(x)
    for _ in range(100):
        flipped = x.copy()
        flipped.view(np.uint8)[rng.integers(flipped.nbytes)] ^= np.uint8(1 << int(rng.integers(8)))
        assert digest(flipped) != saved
        i, j = rng.choice(x.size, size=2, replace=False)
        swapped = x.copy()
        swapped[[i, j]] = swapped[[j, i]]
        assert digest(swapped) != saved
    assert digest(np.roll(x, 1)) != saved


@pytest.mark.parametrize("shape", [(), (7,), (2, 3), (0, 3)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_jax_numpy_and_host_arrays_agree(shape, dtype):
    x = random_array(shape, dtype, seed=len(shape))
    assert digest(np.asarray(x)) == digest(x) == reference_digest(x)


def test_numpy_scalars_have_the_digest_of_their_array():
    assert digest(np.float32(2.5)) == digest(jnp.float32(2.5))
    assert digest(np.float32(2.5)) != digest(np.float32(1.5))


def test_a_manifest_digest_sees_every_change_of_its_parsed_content():
    record = {"a": [1, 2.5, "x"], "b": {"c": None, "d": True}}
    same = {"a": [1, 2.5, "x"], "b": {"c": None, "d": True}}
    assert _digest.manifest_digest(record) == _digest.manifest_digest(same)
    for other in (
        {"a": [1, 2.5, "y"], "b": same["b"]}, {"b": same["b"], "a": same["a"]}, {"a": [1.0, 2.5, "x"], "b": same["b"]}
    ):
        assert _digest.manifest_digest(other) != _digest.manifest_digest(record)  # a value, key order, int vs float
