"""jax.grad through attend() over a float append-mode cache, by every reader, jitted or not, alone or under
jax.vmap over independent caches (a pool's slots), against float64 central differences.

The pure loop's trip count is traced under ``jit`` and buckets switch on a
batched index under ``vmap``: neither transposes, so every reader takes the
flash-attention VJP of ``_append._float_append``.  ``"auto"`` runs the pure
loop where the native kernel is switched off (or declines the step).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from tests.support.attention_reference import assert_directional_derivatives, randn, reference

CAPACITY, KV_HEADS, GROUPS, T, DIM = 640, 2, 1, 3, 8  # 3 query rows per kv head: every path takes them
LENGTHS = np.array([[600, 130], [1, 640], [257, 0]], np.int32)  # [slots, batch]; past one bucket of 256
READERS = [("loop", False), ("bucketed", False), ("auto", False), ("auto", True), ("native", True)]
"""(implementation, whether the native kernels are in use as the loss is traced)."""


def positions_of(lengths):
    return np.where(np.arange(CAPACITY) < lengths[..., None], np.arange(CAPACITY), -1).astype(np.int32)


def inputs(seed, slots=None):
    rng = np.random.default_rng(seed)
    lead = () if slots is None else (slots,)
    q = randn(rng, *lead, 2, T, KV_HEADS * GROUPS, DIM)
    k, v = (randn(rng, *lead, 2, KV_HEADS, CAPACITY, DIM) for _ in range(2))
    return rng, q, k, v


def attend(q, k, v, lengths, implementation):
    slots = jnp.arange(CAPACITY)
    view = jss.KVView(k=k, v=v, lengths=lengths, positions=jnp.where(slots < lengths[:, None], slots, -1))
    return jss.attend(q, view, implementation=implementation)


def reference_loss(lengths):
    """The float64 loss ``sum(sin(out))`` of one cache (``lengths [batch]``) or of stacked ones (``[slots, batch]``)."""
    if lengths.ndim == 1:
        return lambda x: np.sum(np.sin(reference(x[0], x[1], x[2], lengths, positions_of(lengths))[0]))
    return lambda x: sum(reference_loss(n)([x[0][s], x[1][s], x[2][s]]) for s, n in enumerate(lengths))


def switched(native):
    if native and not _library.AVAILABLE:
        pytest.skip(f"the native kernel is not available here ({_library.STATUS})")
    return _library.use(native)


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("implementation, native", READERS)
def test_grad_matches_float64_finite_differences(implementation, native, jitted):
    rng, q, k, v = inputs(1)
    lengths = LENGTHS[0]

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attend(q, k, v, jnp.asarray(lengths), implementation)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    with switched(native):  # traced here, with the kernels as asked
        grads = (jax.jit(grad) if jitted else grad)(q, k, v)
    assert_directional_derivatives(grads, [q, k, v], reference_loss(lengths), rng)


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("implementation, native", READERS)
def test_grad_of_vmap_over_independent_caches_matches_float64_finite_differences(implementation, native, jitted):
    rng, q, k, v = inputs(2, slots=len(LENGTHS))

    def loss(q, k, v):
        out = jax.vmap(lambda *args: attend(*args, implementation))(q, k, v, jnp.asarray(LENGTHS))
        return jnp.sum(jnp.sin(out))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    with switched(native):
        grads = (jax.jit(grad) if jitted else grad)(q, k, v)
    assert_directional_derivatives(grads, [q, k, v], reference_loss(LENGTHS), rng)
    past = np.arange(CAPACITY)[None, None, None, :, None] >= LENGTHS[:, :, None, None, None]
    assert np.all(np.asarray(grads[1])[np.broadcast_to(past, k.shape)] == 0)  # keys past a row's length: none
