"""Quantized K/V (int8, fp8) and demotion, against a float64 numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss

B, H, D = 2, 3, 64


def reference_int8(x: np.ndarray) -> np.ndarray:
    """Symmetric per-row int8 round trip in float64."""
    x = x.astype(np.float64)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    scale[scale == 0] = 1
    return np.clip(np.round(x / scale), -127, 127) * scale


def rows(rng, T):
    return jnp.asarray(rng.normal(size=(B, T, H, D)) * rng.uniform(0.1, 10, size=(B, T, H, 1)), jnp.float32)


@pytest.mark.parametrize("jit", [False, True])
def test_int8_append_stores_each_row_within_half_a_step(jit):
    rng = np.random.default_rng(0)
    cache = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=32, quantize="int8")
    append = jax.jit(lambda c, k, v: c.append((k, v)), donate_argnums=0) if jit else (lambda c, k, v: c.append((k, v)))
    written = []
    for T in (5, 3, 8):
        k, v = rows(rng, T), rows(rng, T)
        cache = append(cache, k, v)
        written.append((np.asarray(k), np.asarray(v)))
    k_all = np.concatenate([k for k, _ in written], axis=1)
    v_all = np.concatenate([v for _, v in written], axis=1)
    for b, row in enumerate(cache.view().materialize()):
        for got, want in ((row["k"], k_all[b]), (row["v"], v_all[b])):
            step = np.abs(want).max(axis=-1, keepdims=True) / 127
            assert np.all(np.abs(got - want) <= step / 2 + 1e-6 * np.abs(want).max())
            np.testing.assert_allclose(got, reference_int8(want), rtol=1e-5, atol=1e-6)
    assert cache.k.dtype == jnp.int8 and cache.k_scale.shape == (B, H, 32, 1)


def test_int8_bytes_are_under_a_third_of_float32():
    f32 = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=256)
    int8 = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=256, quantize="int8")
    assert int8.nbytes <= 0.3 * f32.nbytes  # values a quarter, plus one float32 scale per row and head


def test_fp8_ring_keeps_its_window_and_stays_within_fp8_precision():
    rng = np.random.default_rng(1)
    cache = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=6, sink=2, max_staged=4, quantize="fp8")
    chunks = [(rows(rng, 4), rows(rng, 4)) for _ in range(5)]
    for k, v in chunks:
        cache = cache.append((k, v))
    written = {name: np.concatenate([np.asarray(c[i]) for c in chunks], axis=1) for i, name in enumerate("kv")}
    for b, row in enumerate(cache.view(include_staged=False).materialize()):
        assert row["positions"].tolist() == [0, 1, *range(14, 20)]
        for name in ("k", "v"):
            want = written[name][b][row["positions"]]
            assert np.all(np.abs(row[name] - want) <= np.abs(want).max(axis=-1, keepdims=True) * 2.0**-4 + 1e-6), (
                f"batch row {b} {name}"
            )


def test_fp8_error_is_relative_down_to_subnormals_then_absolute():
    """Each entry within ``2**-4`` relative or ``max|row| / (448 * 2**10)`` absolute, whichever is larger."""
    rng = np.random.default_rng(7)
    T = 512
    magnitudes = 10.0 ** rng.uniform(-9, 3, size=(1, T, H, D)) * 10.0 ** rng.uniform(-6, 6, size=(1, T, H, 1))
    x = (rng.choice([-1.0, 1.0], size=magnitudes.shape) * magnitudes).astype(np.float32)
    cache = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=T, quantize="fp8")
    (row,) = cache.append((jnp.asarray(x), jnp.asarray(x))).view().materialize()
    want = x[0].astype(np.float64)
    error = np.abs(row["k"].astype(np.float64) - want)
    largest = np.abs(want).max(axis=-1, keepdims=True)
    absolute = np.broadcast_to(largest / (448 * 2**10), want.shape)
    assert np.all(error <= np.maximum(2.0**-4 * np.abs(want), absolute))
    subnormal = np.abs(want) < largest * 2.0**-6 / 448
    assert subnormal.sum() > 1000  # the rows span enough magnitudes to reach float8's subnormals
    assert np.any(error[subnormal] > 2.0**-4 * np.abs(want[subnormal]))  # there, relative alone does not hold ...
    assert (error[subnormal] / absolute[subnormal]).max() > 0.99  # ... and the absolute figure is tight


@pytest.mark.parametrize("jit", [False, True])
def test_demote_quantizes_every_row_and_keeps_the_counts(jit):
    rng = np.random.default_rng(2)
    k, v = rows(rng, 7), rows(rng, 7)
    cache = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=16, tiers=("int8",))
    cache = cache.append(jss.KVChunk(k, v, jnp.array([7, 4], jnp.int32))).stage((k[:, :2], v[:, :2]))
    direct = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=16, quantize="int8")
    direct = direct.append(jss.KVChunk(k, v, jnp.array([7, 4], jnp.int32))).stage((k[:, :2], v[:, :2]))
    demote = jax.jit(lambda c: c.demote(), donate_argnums=0) if jit else (lambda c: c.demote())
    demoted = demote(jax.tree_util.tree_map(jnp.copy, cache))
    assert (demoted.quantize, demoted.tiers) == ("int8", ())
    assert demoted.committed.tolist() == [7, 4] and demoted.staged.tolist() == [2, 2]
    for got, want in zip(demoted.view().materialize(), direct.view().materialize()):
        for name in ("positions", "k", "v"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert demoted.nbytes < 0.3 * cache.nbytes
    with pytest.raises(jss.NotDemotableError, match=r"KVCache\(.*has no lower tier"):
        demoted.demote()


def test_demote_without_tiers_is_an_error_and_changes_nothing():
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=4).append((jnp.ones((1, 2, 1, 4)),) * 2)
    with pytest.raises(jss.NotDemotableError, match=r"KVCache\(.*tiers=\(\"int8\",\)"):
        cache.demote()
    assert cache.committed.tolist() == [2] and cache.k.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"dtype": jnp.int32, "quantize": "int8"}, TypeError, "only a floating-point cache can be quantized"),
        ({"dtype": jnp.int32, "tiers": ("int8",)}, TypeError, "only a floating-point cache can be quantized"),
        ({"quantize": "int4"}, ValueError, "name a format in"),
        ({"quantize": "int8", "tiers": ("fp8",)}, ValueError, "has no lower tier"),
    ],
)
def test_bad_quantize_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=4, **kwargs)


def test_payloads_of_a_quantized_cache_stay_in_its_dtype():
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=4, dtype=jnp.bfloat16, quantize="int8")
    with pytest.raises(jss.PayloadTypeError, match="dtype bfloat16"):
        cache.append((jnp.ones((1, 2, 1, 4), jnp.int8),) * 2)


def pooled(item):
    """A frame [8, 8, 4] pooled 2x2 to [4, 4, 4]."""
    return item.reshape(4, 2, 4, 2, 4).mean(axis=(1, 3))


@pytest.mark.parametrize("jit", [False, True])
def test_latent_buffer_demotes_every_item_through_its_function(jit):
    rng = np.random.default_rng(3)
    frames = jss.LatentBuffer.allocate(capacity=3, item_shape=(8, 8, 4), ring=True, max_staged=1, demote_fn=pooled)
    items = jnp.asarray(rng.normal(size=(5, 8, 8, 4)), jnp.float32)
    frames = frames.append(items[:4]).stage(items[4])
    assert frames.demotable
    demote = jax.jit(lambda f: f.demote()) if jit else (lambda f: f.demote())  # smaller items: nothing to donate
    demoted = demote(frames)
    assert demoted.item_shape == (4, 4, 4) and not demoted.demotable
    assert int(demoted.committed) == 4 and int(demoted.staged) == 1
    want = np.asarray(items, np.float64).reshape(5, 4, 2, 4, 2, 4).mean(axis=(2, 4))
    np.testing.assert_allclose(demoted.view(include_staged=False).materialize(), want[1:4], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(demoted.view().materialize(), want[2:5], rtol=1e-6, atol=1e-6)


def test_a_demote_fn_of_the_wrong_structure_is_refused_and_changes_nothing():
    frames = jss.LatentBuffer.allocate(capacity=2, item_shape=(4,), demote_fn=lambda x: (x, x)).append(jnp.ones(4))
    with pytest.raises(TypeError, match=r"LatentBuffer\(.*demote_fn must return one array per item"):
        frames.demote()
    assert frames.item_shape == (4,) and int(frames.committed) == 1
    with pytest.raises(jss.NotDemotableError, match=r"LatentBuffer\(.*no lower tier"):
        jss.LatentBuffer.allocate(capacity=2, item_shape=(4,)).demote()
    with pytest.raises(TypeError, match="demote_fn must be a function"):
        jss.LatentBuffer.allocate(capacity=2, item_shape=(4,), demote_fn="pool")
