"""Fingerprints of checkpointed arrays: any changed word or moved row changes them; both implementations agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_session_state import _fingerprint

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_, jnp.complex64, jnp.uint32]
IMPLEMENTATIONS = {
    "numpy": _fingerprint.fingerprint,  # host and CPU arrays
    "device": lambda x: [int(v) for v in _fingerprint._on_device(jnp.asarray(x))],  # accelerators
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def fingerprint(request):
    return IMPLEMENTATIONS[request.param]


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
def test_one_changed_element_changes_the_fingerprint(fingerprint, dtype):
    x = random_array((3, 5, 4), dtype)
    changed = x.at[1, 2, 3].set(~x[1, 2, 3] if dtype == jnp.bool_ else x[1, 2, 3] + 1)
    assert fingerprint(x) == fingerprint(jnp.array(x, copy=True))
    assert fingerprint(changed) != fingerprint(x)


def test_moved_rows_change_the_weighted_sum_only(fingerprint):
    x = random_array((4, 6), jnp.float32)
    plain, weighted = fingerprint(x)
    swapped = fingerprint(x[jnp.array([1, 0, 2, 3])])
    assert swapped[0] == plain and swapped[1] != weighted


@pytest.mark.parametrize("shape", [(), (7,), (2, 3), (2, 3, 5)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_both_implementations_and_host_arrays_agree(shape, dtype):
    x = random_array(shape, dtype, seed=len(shape))
    expected = IMPLEMENTATIONS["device"](x)
    assert _fingerprint.fingerprint(x) == expected
    assert _fingerprint.fingerprint(np.asarray(x)) == expected


def test_numpy_scalars_have_the_fingerprint_of_their_array():
    assert _fingerprint.fingerprint(np.float32(2.5)) == _fingerprint.fingerprint(jnp.float32(2.5))
    assert _fingerprint.fingerprint(np.float32(2.5)) != _fingerprint.fingerprint(np.float32(1.5))
