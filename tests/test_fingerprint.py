"""Fingerprints of checkpointed arrays: any changed word or moved row changes them, on either path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_session_state import _fingerprint

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_, jnp.complex64, jnp.uint32]


def fingerprint(x):
    return _fingerprint.value(_fingerprint.start(x))


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    """Runs a test with small arrays summed on the host (the default) or on the device."""
    if request.param == "device":
        monkeypatch.setattr(_fingerprint, "_DEVICE_BYTES", 0)
    return request.param


def random_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == jnp.bool_:
        return jnp.asarray(rng.integers(0, 2, size=shape).astype(bool))
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(0, 100, size=shape), dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), dtype)
    return jnp.asarray(rng.normal(size=shape), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_one_changed_element_changes_the_fingerprint(path, dtype):
    x = random_array((3, 5, 4), dtype)
    changed = x.at[1, 2, 3].set(~x[1, 2, 3] if dtype == jnp.bool_ else x[1, 2, 3] + 1)
    assert fingerprint(x) == fingerprint(jnp.array(x, copy=True))
    assert fingerprint(changed) != fingerprint(x)


def test_swapped_rows_change_the_weighted_sum_only(path):
    x = random_array((4, 6), jnp.float32)
    swapped = x[jnp.array([1, 0, 2, 3])]
    plain, weighted = fingerprint(x)
    assert fingerprint(swapped)[0] == plain and fingerprint(swapped)[1] != weighted


def test_scalars_have_fingerprints(path):
    assert fingerprint(jnp.float32(1.5)) != fingerprint(jnp.float32(2.5))


def test_host_arrays_agree_with_small_device_arrays():
    x = random_array((3, 4), jnp.float32)
    assert fingerprint(np.asarray(x)) == fingerprint(x)


def test_an_owned_copy_is_a_new_buffer_with_the_same_fingerprint(path):
    x = random_array((64, 32), jnp.float32)
    copy, started = _fingerprint.start_on_owned_copy(x)
    assert copy.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(copy), np.asarray(x))
    assert _fingerprint.value(started) == fingerprint(x)
