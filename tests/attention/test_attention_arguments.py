"""attend() called with what its signature allows at the edges: a traced scale, no query rows, and eager calls
on either side of switching the native kernels off; against the float64 reference where there is a result."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _library
from jax_session_state.attention import _append
from tests.support.attention_reference import assert_close, randn, reference

needs_native = pytest.mark.skipif(not _library.AVAILABLE, reason=f"the native kernel is not here: {_library.STATUS}")

BATCH, KV_HEADS, DIM, CAPACITY, PAGE_SIZE = 2, 2, 16, 64, 16
LENGTHS = np.array([45, 17], np.int32)


def views(rng, dtype=jnp.float32):
    """A dense and a paged view holding the same random rows (``LENGTHS`` of them), and those rows ``[B, Hk, C, D]``."""
    k, v = (jnp.asarray(randn(rng, BATCH, CAPACITY, KV_HEADS, DIM), dtype) for _ in range(2))
    chunk = jss.KVChunk(k, v, jnp.asarray(LENGTHS))
    dense = jss.KVCache.allocate(batch=BATCH, kv_heads=KV_HEADS, head_dim=DIM, capacity=CAPACITY, dtype=dtype)
    paged = jss.PagedKVCache.allocate(max_slots=BATCH, kv_heads=KV_HEADS, head_dim=DIM, page_size=PAGE_SIZE,
                                      num_pages=2 * CAPACITY // PAGE_SIZE + 1, dtype=dtype)
    rows = [np.asarray(x.astype(jnp.float32), np.float64).transpose(0, 2, 1, 3) for x in (k, v)]
    return {"dense": dense.append(chunk).view(), "paged": paged.append(chunk).view()}, rows


def key_positions():
    return np.where(np.arange(CAPACITY) < LENGTHS[:, None], np.arange(CAPACITY), -1)


@pytest.mark.parametrize("implementation", jss.attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_a_traced_scale_is_folded_into_the_queries_on_every_reader(kind, implementation):
    if implementation == "native" and not _library.enabled():
        pytest.skip(f"the native kernel is not in use here: {_library.status()}")
    rng = np.random.default_rng(3)
    all_views, (k, v) = views(rng)
    q = randn(rng, BATCH, 3, KV_HEADS, DIM)  # 3 query rows per kv head: every native path takes them
    f = jax.jit(lambda q, view, scale: jss.attend_with_lse(q, view, scale=scale, implementation=implementation))
    out, lse = f(q, all_views[kind], 0.3)
    assert out.dtype == jnp.float32
    assert_close(out, lse, *reference(q, k, v, LENGTHS, key_positions(), scale=0.3))
    if implementation == "native":  # the kernel runs, its scale a constant 1.0
        target = _library.TARGET if kind == "dense" else _library.PAGED_TARGET
        assert f'custom_call_target="{target}"' in f.lower(q, all_views[kind], 0.3).compile().as_text()


@pytest.mark.parametrize("implementation", ["auto", "loop", "bucketed"])
def test_a_traced_scale_over_a_16_bit_cache_keeps_the_queries_dtype(implementation):
    rng = np.random.default_rng(4)
    all_views, (k, v) = views(rng, jnp.bfloat16)
    q = randn(rng, BATCH, 1, KV_HEADS, DIM)
    out, lse = jax.jit(lambda q, view, scale: jss.attend_with_lse(q, view, scale=scale, implementation=implementation)
                       )(jnp.asarray(q, jnp.bfloat16), all_views["dense"], jnp.float32(0.3))
    q_values = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    ref_out, ref_lse = reference(q_values, k, v, LENGTHS, key_positions(), scale=0.3)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref_out, atol=2.0**-8 * np.max(np.abs(ref_out)))


def test_a_scale_that_is_not_a_scalar_is_named():
    all_views, _ = views(np.random.default_rng(5))
    with pytest.raises(jss.PayloadError, match=r"scale must be a scalar; got shape \[2\]"):
        jss.attend(jnp.ones((BATCH, 1, KV_HEADS, DIM)), all_views["dense"], scale=jnp.ones(2))


@needs_native
def test_an_eager_call_after_the_kernels_are_switched_off_runs_the_pure_loop(monkeypatch):
    """Eager calls share one compiled program per signature: the switch is part of the signature."""
    read, traced = _append.read_blocks, []  # what the loop traces to read the keys
    monkeypatch.setattr(_append, "read_blocks", lambda *args, **kwargs: traced.append(1) or read(*args, **kwargs))
    rng = np.random.default_rng(6)
    q, k, v = randn(rng, 1, 2, 3, 24), randn(rng, 1, 3, 37, 24), randn(rng, 1, 3, 37, 24)  # shapes of its own
    view = jss.KVView(k=jnp.asarray(k), v=jnp.asarray(v), lengths=jnp.asarray([29], jnp.int32), positions=None)
    positions = np.where(np.arange(37) < 29, np.arange(37), -1)[None]
    with _library.use(True):
        native_out, native_lse = jss.attend_with_lse(q, view)
    assert not traced
    with _library.use(False):
        out, lse = jss.attend_with_lse(q, view)
    assert len(traced) == 1
    for result in ((native_out, native_lse), (out, lse)):
        assert_close(*result, *reference(q, k, v, [29], positions))


NO_QUERY_ROWS = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_session_state as jss
    rows = jnp.ones((2, 5, 2, 16))
    dense = jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=16, capacity=600).append((rows, rows)).view()
    paged = jss.PagedKVCache.allocate(max_slots=2, kv_heads=2, head_dim=16, page_size=16, num_pages=80
                                      ).append((rows, rows)).view()
    ring = jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=16, window=8, max_staged=5).append((rows, rows)).view()
    empty = dense.replace(k=dense.k[:0], v=dense.v[:0], lengths=dense.lengths[:0], positions=dense.positions[:0])
    views = {"dense": dense, "paged": paged, "ring": ring, "batch 0": empty}
    for name, view in views.items():
        for shape in [(2, 0, 4, 16), (2, 3, 0, 16)] if name != "batch 0" else [(0, 1, 4, 16)]:
            q = jnp.ones(shape, jnp.bfloat16)
            for implementation in jss.attention.IMPLEMENTATIONS:
                for f in (jss.attend_with_lse, jax.jit(jss.attend_with_lse, static_argnames="implementation")):
                    out, lse = f(q, view, implementation=implementation)
                    print(name, implementation, out.shape == q.shape and out.dtype == q.dtype,
                          lse.shape == q.shape[:3] and lse.dtype == jnp.float32, flush=True)
""")


def test_no_query_rows_give_empty_results_on_every_reader():
    done = subprocess.run([sys.executable, "-c", NO_QUERY_ROWS], capture_output=True, text=True, check=False,
                          timeout=240)  # a reader that loops forever over no rows fails, not hangs
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == (3 * 2 + 1) * len(jss.attention.IMPLEMENTATIONS) * 2
    assert all(line.endswith("True True") for line in lines), lines
