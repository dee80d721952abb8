"""A naive float64 numpy reference of attention, and the checks the attention tests share.

Error metric: ``max|a - b| / max|b|`` over the whole output (``b`` the
reference), at most 1e-5 in float32; ``lse`` the same on finite entries and
``-inf`` exactly where the reference has it.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss

TOL = 1e-5


def reference(q, k, v, lengths, key_positions, *, window=None, sink=0, causal=True, scale=None, q_positions=None):
    """Naive float64 attention: (out, lse), zeros / -inf where nothing is visible."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _B, T, q_heads, D = q.shape
    groups = q_heads // k.shape[1]
    scale = 1 / np.sqrt(D) if scale is None else scale
    lengths = np.asarray(lengths)
    if q_positions is None:
        q_positions = lengths[:, None] - T + np.arange(T)
    qp = np.asarray(q_positions)[:, :, None]
    kp = np.asarray(key_positions)[:, None, :]
    visible = (kp >= 0) & (kp < lengths[:, None, None])
    if causal:
        visible = visible & (kp <= qp)
    if window is not None:
        visible = visible & ((kp < sink) | (qp - kp < window))
    kr, vr = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("bthd,bhcd->bthc", q, kr) * scale
    s = np.where(visible[:, :, None, :], s, -np.inf)
    top = s.max(-1, keepdims=True)
    seen = np.isfinite(top)
    p = np.exp(s - np.where(seen, top, 0.0))
    total = p.sum(-1, keepdims=True)
    out = np.einsum("bthc,bhcd->bthd", p / np.where(seen, total, 1.0), vr)
    lse = np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
    return out, lse


def assert_close(out, lse, ref_out, ref_lse):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any()
    assert np.max(np.abs(out - ref_out)) <= TOL * max(np.max(np.abs(ref_out)), 1e-30)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    if finite.any():
        assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= TOL * max(1.0, np.max(np.abs(ref_lse[finite])))
    assert np.all(out[np.isneginf(ref_lse)] == 0)  # a query that sees nothing gives exact zeros


def assert_close_16_bit(out, lse, ref_out, ref_lse):
    """:func:`assert_close` for 16-bit queries: exact products summed in float32 (``lse`` to float32 accuracy),
    the output rounded to the queries' dtype (within half an ulp of bfloat16 at the largest)."""
    assert_close(ref_out, lse, ref_out, ref_lse)
    error = np.max(np.abs(np.asarray(out, np.float64) - ref_out))
    assert 0 < error <= 2.0**-8 * np.max(np.abs(ref_out))


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def append_view(k, v, lengths):
    capacity = k.shape[2]
    positions = np.where(np.arange(capacity) < np.asarray(lengths)[:, None], np.arange(capacity), -1)
    return jss.KVView(k=jnp.asarray(k), v=jnp.asarray(v), lengths=jnp.asarray(lengths, jnp.int32),
                      positions=jnp.asarray(positions, jnp.int32))


def central_difference(f, point, direction, eps=1e-5):
    """The derivative of ``f`` at ``point`` (a list of float64 arrays) along ``direction``, by central differences."""
    return (f([x + eps * d for x, d in zip(point, direction)])
            - f([x - eps * d for x, d in zip(point, direction)])) / (2 * eps)


def assert_directional_derivatives(grads, point, f, rng, *, eps=1e-5, rtol=1e-4):
    """``grads`` (float32, of a scalar loss at ``point``) against float64 central differences of ``f``.

    ``f`` is the loss in float64 (through :func:`reference`), taking a list
    like ``point``.  Checked along one random direction per input, the
    others held still (an error in one input's gradient is not drowned by
    the others), then along one direction of all of them at once.

    Tolerance: in float64 the central difference errs by O(eps^2) (times
    the third derivative) plus O(1e-16 |f| / eps), about 1e-10.  The
    float32 gradient (a softmax over at most a few hundred keys) is good to
    about 1e-6 relative along a random direction (these tests measure 1e-9
    to 9e-7), so ``rtol`` = 1e-4 of ``max(1, |derivative|)`` leaves a
    margin of 100 or more, while a wrong gradient (a mask off by one, a
    dropped term, a swapped operand) moves the derivative by order one.
    Each derivative must be well above that tolerance, so a gradient of
    zeros fails too.
    """
    point = [np.asarray(x, np.float64) for x in point]
    grads = [np.asarray(g, np.float64) for g in grads]
    assert len(grads) == len(point) and all(g.shape == x.shape for g, x in zip(grads, point))
    directions = []
    for i in range(len(point)):
        directions.append([rng.standard_normal(y.shape) if j == i else np.zeros_like(y) for j, y in enumerate(point)])
    directions.append([rng.standard_normal(x.shape) for x in point])
    for direction in directions:
        numeric = central_difference(f, point, direction, eps)
        analytic = sum(np.sum(g * d) for g, d in zip(grads, direction))
        assert abs(numeric) > 100 * rtol, "a direction too flat to tell a wrong gradient from a right one"
        assert abs(analytic - numeric) <= rtol * max(1.0, abs(numeric)), (analytic, numeric)


def caches(rng, *, page_size=16, capacity=448, batch=3, kv_heads=2, dim=8, dtype=jnp.float32, quantize=None,
           lengths=None):
    """A dense and a paged cache holding the same ragged rows (``lengths`` per batch row, random if not given)."""
    lengths = rng.integers(0, capacity + 1, batch) if lengths is None else np.asarray(lengths)
    k = jnp.asarray(randn(rng, batch, capacity, kv_heads, dim), dtype)
    v = jnp.asarray(randn(rng, batch, capacity, kv_heads, dim), dtype)
    chunk = jss.KVChunk(k, v, jnp.asarray(lengths, jnp.int32))
    dense = jss.KVCache.allocate(batch=batch, kv_heads=kv_heads, head_dim=dim, capacity=capacity, dtype=dtype,
                                 quantize=quantize)
    pages = batch * -(-capacity // page_size)
    paged = jss.PagedKVCache.allocate(max_slots=batch, kv_heads=kv_heads, head_dim=dim, page_size=page_size,
                                      num_pages=pages + 2, dtype=dtype, quantize=quantize)
    return dense.append(chunk), paged.append(chunk)


VIEWS = {
    "dense float32": dict(),
    "dense bfloat16": dict(dtype=jnp.bfloat16),
    "dense int8": dict(quantize="int8"),
    "paged float32": dict(paged=True),
    "paged bfloat16": dict(paged=True, dtype=jnp.bfloat16),
    "paged int8": dict(paged=True, quantize="int8"),
    "paged fp8": dict(paged=True, quantize="fp8"),
}
"""The kinds of view the accelerator readers are checked on: :func:`caches`' options, and whether paged."""


def view_of(kind, rng, **kwargs):
    """``(view, dense, dtype)``: the ``kind`` of :data:`VIEWS` over ragged rows (``kwargs`` go to :func:`caches`),
    the dense view of the same rows, and the cache's dtype."""
    options = dict(VIEWS[kind])
    paged = options.pop("paged", False)
    dense, paged_cache = caches(rng, **options, **kwargs)
    return (paged_cache.view() if paged else dense.view()), dense.view(), options.get("dtype", jnp.float32)


def float64_reference(q, view, **kwargs):
    """The reference over a dense view's rows (dequantized where quantized)."""
    k, v = (np.asarray(x, np.float64) for x in (view.k, view.v))
    if view.quantized:
        k, v = k * np.asarray(view.k_scale, np.float64), v * np.asarray(view.v_scale, np.float64)
    return reference(q, k, v, np.asarray(view.lengths), np.asarray(view.positions), **kwargs)


def lower(f, platform, *args):
    """``jax.jit(f)`` lowered for ``platform``; skips where this jaxlib lowers a Pallas kernel for ``cuda`` only
    through its CUDA plugin (after 0.10.2 it compiles the kernel while lowering), which a CPU-only install lacks."""
    try:
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))
    except RuntimeError as error:
        if "Triton compilation handler" not in str(error):
            raise
        pytest.skip(f"this jaxlib ({jax.__version__}) compiles Pallas' Triton kernels while lowering, through a "
                    f"CUDA plugin it does not have here: {error}")


def lowered(f, platform, *args):
    """:func:`lower`'s text."""
    return lower(f, platform, *args).as_text()


def check_compiles_once(implementation, q, k, v, lengths):
    """One compiled ``attend`` serves every length in ``lengths`` of one row's cache ``k``, ``v``
    ``[1, kv_heads, C, D]``, each against the float64 reference."""
    capacity = k.shape[2]
    attend = jax.jit(chex.assert_max_traces(lambda q, view: jss.attend(q, view, implementation=implementation), n=1))
    for length in lengths:
        view = jss.KVView(k=jnp.asarray(k), v=jnp.asarray(v), lengths=jnp.asarray([length], jnp.int32),
                          positions=None)
        positions = np.where(np.arange(capacity) < length, np.arange(capacity), -1)[None]
        np.testing.assert_allclose(attend(q, view), reference(q, k, v, [length], positions)[0], atol=1e-5)


def pooled_attend(implementation):
    """``attend_with_lse`` under ``jax.vmap`` over independent caches (a pool's slots), each an append-mode view of
    ``k``, ``v``, lengths and positions."""
    def one(q, k, v, lengths, positions):
        view = jss.KVView(k=k, v=v, lengths=lengths, positions=positions)
        return jss.attend_with_lse(q, view, implementation=implementation)

    return jax.vmap(one)


def check_grad(implementation, rng, *, dim):
    """``jax.grad`` of a loss through ``attend`` over ragged rows (600 and 130 of 640 slots) against float64
    central differences."""
    lengths = np.array([600, 130], np.int32)
    k, v, q = randn(rng, 2, 2, 640, dim), randn(rng, 2, 2, 640, dim), randn(rng, 2, 3, 4, dim)
    positions = np.where(np.arange(640) < lengths[:, None], np.arange(640), -1)

    def loss(q, k, v):
        view = jss.KVView(k=k, v=v, lengths=jnp.asarray(lengths), positions=jnp.asarray(positions))
        return jnp.sum(jnp.sin(jss.attend(q, view, implementation=implementation)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    def reference_loss(x):
        return np.sum(np.sin(reference(x[0], x[1], x[2], lengths, positions)[0]))

    assert_directional_derivatives(grads, [q, k, v], reference_loss, rng)
