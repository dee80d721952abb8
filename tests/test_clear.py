"""``clear()``: every kind emptied in place, its storage kept, donated, compiled once."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

import jax_session_state as jss
from tests.support.kinds import KINDS


def host(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree_util.tree_leaves(tree)]


def written(kind, seed=0):
    """An object of ``kind`` with random data committed and staged after it."""
    allocate, payload = KINDS[kind]
    rng = np.random.default_rng(seed)
    obj = allocate().append(payload(rng))
    return obj.stage(payload(rng)) if not isinstance(obj, (jss.EncodeOnceKV,)) else obj


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_clear_equals_a_fresh_object_of_the_spec(kind):
    obj = written(kind)
    assert any(np.any(x != y) for x, y in zip(host(obj), host(obj.empty()), strict=True))  # data was written
    cleared = obj.clear()
    assert jax.tree_util.tree_structure(cleared) == jax.tree_util.tree_structure(obj)
    for x, y in zip(host(cleared), host(obj.empty()), strict=True):
        np.testing.assert_array_equal(x, y)
    assert cleared.fill() == obj.empty().fill()


@pytest.mark.parametrize("kind", ["kv_ring", "paged", "latent_ring", "fixed", "retrieval"])
def test_clear_under_jit_is_in_place_and_compiles_once(kind):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def clear(obj):
        return obj.clear()

    clear = jax.jit(clear, donate_argnums=0)
    for seed in range(3):
        obj = written(kind, seed)
        pointers = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(obj)]
        cleared = clear(obj)
        assert [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(cleared)] == pointers
        for x, y in zip(host(cleared), host(cleared.empty()), strict=True):
            np.testing.assert_array_equal(x, y)
        _, payload = KINDS[kind]
        again = cleared.append(payload(np.random.default_rng(seed + 10)))  # usable at once
        assert any(np.any(a != b) for a, b in zip(host(again), host(cleared), strict=True))


def test_clear_of_an_evicted_object_says_so():
    obj, _ = written("fixed_evictable").evict()
    with pytest.raises(jss.NotResidentError, match=r"clear\(\) on FixedState"):
        obj.clear()
