"""KVCache against a plain-Python model: append and ring modes, ragged rows, overflow."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jax_session_state as jss
from tests.support.models import KVModel, Op, drive

B, H, D = 2, 2, 3
CHUNKS = (1, 3, 4)  # few distinct T: few compiles


@st.composite
def kv_ops(draw, *, batch=B, allow_bad_counts=True):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ops = []
    for _ in range(draw(st.integers(1, 14))):
        name = draw(st.sampled_from(["stage", "stage", "append", "commit", "discard", "commit_payload"]))
        if name in ("commit", "discard"):
            ops.append(Op(name))
            continue
        T = draw(st.sampled_from(CHUNKS))
        k = jnp.asarray(rng.normal(size=(batch, T, H, D)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(batch, T, H, D)), jnp.float32)
        kind = draw(st.sampled_from(["full", "ragged", "ragged", "bad"] if allow_bad_counts else ["full", "ragged"]))
        if kind == "full":
            counts = None
        elif kind == "ragged":
            counts = jnp.asarray([draw(st.integers(0, T)) for _ in range(batch)], jnp.int32)
        else:
            counts = jnp.asarray([draw(st.sampled_from([-1, T + 1]))] + [T] * (batch - 1), jnp.int32)
        ops.append(Op(name, jss.KVChunk(k, v, counts)))
    return ops


class TestKVCacheMatchesModel(chex.TestCase):
    """Against the plain-Python model, eagerly and jitted (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=kv_ops())
    def test_append_mode_matches_model(self, ops):
        cache = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=12)
        drive(cache, KVModel(B, capacity=12, heads=H, head_dim=D), ops, self.variant)

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=kv_ops(batch=1))
    def test_append_mode_with_one_row_matches_model(self, ops):
        # One batch row writes through one in-place slice update instead of a scatter.
        cache = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=12)
        drive(cache, KVModel(1, capacity=12, heads=H, head_dim=D), ops, self.variant)

    @chex.variants(with_jit=True, without_jit=True)
    @given(ops=kv_ops(), sink=st.sampled_from([0, 2]))
    def test_ring_mode_matches_model(self, ops, sink):
        # Long sequences wrap the ring many times; staged rows must never clobber the window.
        cache = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=5, sink=sink, max_staged=4)
        model = KVModel(B, window=5, sink=sink, max_staged=4, heads=H, head_dim=D)
        drive(cache, model, ops * 3, self.variant)


@pytest.mark.parametrize("start, count", [(0, 4), (3, 2), (6, 2), (7, 1), (5, 0)])
def test_one_row_write_near_capacity_changes_only_its_rows(start, count):
    # The slice write's window is clamped to fit the capacity (8 rows, chunks of 4):
    # rows before ``start`` and after ``start + count`` must keep what they held.
    rng = np.random.default_rng(start)
    held = rng.normal(size=(1, 8, H, D)).astype(np.float32)
    cache = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=8)
    cache = cache.append(jss.KVChunk(jnp.asarray(held), jnp.asarray(-held)))
    rows = rng.normal(size=(1, 4, H, D)).astype(np.float32)
    write = jax.jit(lambda c, n: c.append(jss.KVChunk(jnp.asarray(rows), jnp.asarray(-rows), n)),
                    donate_argnums=0)
    cache = cache.replace(bookkeeping=cache.bookkeeping.at[0].set(start))  # rewind to ``start`` committed rows
    cache = write(cache, jnp.asarray([count], jnp.int32))
    expected = held.copy()
    expected[:, start:start + count] = rows[:, :count]
    np.testing.assert_array_equal(np.asarray(cache.k).transpose(0, 2, 1, 3), expected)
    np.testing.assert_array_equal(np.asarray(cache.v).transpose(0, 2, 1, 3), -expected)
    assert cache.committed.tolist() == [start + count] and not bool(cache.overflowed)


@pytest.mark.parametrize("start", [0, 4, 5, 8])
def test_one_row_whole_chunk_near_capacity_writes_all_or_nothing(start):
    # A chunk without counts takes all its rows or, past the capacity, none (flagged).
    rng = np.random.default_rng(10 + start)
    held = rng.normal(size=(1, 8, H, D)).astype(np.float32)
    cache = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=8)
    cache = cache.append(jss.KVChunk(jnp.asarray(held), jnp.asarray(-held)))
    rows = rng.normal(size=(1, 4, H, D)).astype(np.float32)
    write = jax.jit(lambda c: c.append(jss.KVChunk(jnp.asarray(rows), jnp.asarray(-rows))), donate_argnums=0)
    cache = write(cache.replace(bookkeeping=cache.bookkeeping.at[0].set(start)))
    fits = start + 4 <= 8
    expected = held.copy()
    if fits:
        expected[:, start:start + 4] = rows
    np.testing.assert_array_equal(np.asarray(cache.k).transpose(0, 2, 1, 3), expected)
    np.testing.assert_array_equal(np.asarray(cache.v).transpose(0, 2, 1, 3), -expected)
    assert cache.committed.tolist() == [start + 4 if fits else start] and bool(cache.overflowed) == (not fits)


def test_one_row_append_is_one_in_place_slice_update_per_array():
    cache = jss.KVCache.allocate(batch=1, kv_heads=H, head_dim=D, capacity=64)
    rows = jnp.ones((1, 4, H, D))
    step = jax.jit(lambda c, r: c.append((r, r)), donate_argnums=0)
    hlo = step.lower(cache, rows).compile().as_text()
    assert "scatter" not in hlo and hlo.count("dynamic-update-slice") >= 2
    pointers = (cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer())
    cache = step(cache, rows)
    assert (cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()) == pointers


def test_view_layout_and_positions():
    rng = np.random.default_rng(0)
    cache = jss.KVCache.allocate(batch=2, kv_heads=H, head_dim=D, capacity=8)
    k, v = (jnp.asarray(rng.normal(size=(2, 4, H, D)), jnp.float32) for _ in "kv")
    cache = cache.append(jss.KVChunk(k, v, jnp.array([4, 2], jnp.int32)))
    view = cache.view()
    assert view.k.shape == view.v.shape == (2, H, 8, D)  # head-major
    for name, rows in (("k", k), ("v", v)):
        got, want = np.asarray(getattr(view, name)), np.asarray(rows)
        for b, n in enumerate([4, 2]):  # [slot, head, :] holds row ``slot``'s head ``head``
            for t in range(n):
                for h in range(H):
                    np.testing.assert_array_equal(got[b, h, t], want[b, t, h], err_msg=f"{name}[{b}] row {t} head {h}")
    np.testing.assert_array_equal(view.positions, [[0, 1, 2, 3, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(view.lengths, [4, 2])


def test_ring_keeps_sinks_and_window_after_wraparound():
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=1, window=3, sink=2, max_staged=2)
    for t in range(10):
        x = jnp.full((1, 1, 1, 1), float(t))
        cache = cache.append((x, -x - 100))
    (row,) = cache.view(include_staged=False).materialize()  # the committed window
    np.testing.assert_array_equal(row["positions"], [0, 1, 7, 8, 9])
    np.testing.assert_array_equal(row["k"].ravel(), [0, 1, 7, 8, 9])
    np.testing.assert_array_equal(row["v"].ravel(), -np.array([0, 1, 7, 8, 9]) - 100)
    (row,) = cache.view().materialize()  # all the ring holds: a whole chunk's windows
    np.testing.assert_array_equal(row["positions"], [0, 1, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(row["k"].ravel(), [0, 1, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(row["v"].ravel(), -np.array([0, 1, 5, 6, 7, 8, 9]) - 100)


def test_ring_view_lengths_are_the_end_position_not_the_tokens_shown():
    rng = np.random.default_rng(3)
    window, sink, written = 3, 2, [int(n) for n in rng.integers(1, 3, size=8)]
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=1, window=window, sink=sink, max_staged=2)
    end = 0
    for n in written:
        x = jnp.asarray(rng.normal(size=(1, n, 1, 1)), jnp.float32)
        cache = cache.append((x, x))
        end += n
        view = cache.view(include_staged=False)
        shown = sorted(set(range(min(sink, end))) | set(range(max(end - window, 0), end)))  # the model
        (row,) = view.materialize()
        assert view.lengths.tolist() == [end]
        assert row["positions"].tolist() == shown and len(shown) <= end
    assert len(shown) < end  # wrapped: fewer shown than the length says


def test_overflow_eager_raises_and_writes_nothing():
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    x = jnp.ones((1, 3, 1, 2))
    cache = cache.append((x, x))
    with pytest.raises(jss.CapacityError, match=r"KVCache\(.*capacity 4"):
        cache.append((x, x))
    assert int(cache.view().lengths[0]) == 3 and not bool(cache.overflowed)


def test_overflow_under_jit_writes_nothing_and_check_raises():
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    step = jax.jit(lambda c, x: c.append((x, x)), donate_argnums=0)
    cache = step(cache, jnp.ones((1, 3, 1, 2)))
    before = np.asarray(cache.k).copy()
    cache = step(cache, 2 * jnp.ones((1, 3, 1, 2)))  # would run past capacity 4
    assert bool(cache.overflowed)
    np.testing.assert_array_equal(cache.k, before)  # the tail was not overwritten (no clamping)
    assert int(cache.view().lengths[0]) == 3
    with pytest.raises(jss.CapacityError, match=r"\['kv'\]: KVCache"):
        jss.check({"kv": cache})


def test_bad_counts_eager_and_jit():
    cache = jss.KVCache.allocate(batch=2, kv_heads=1, head_dim=2, capacity=8)
    x = jnp.ones((2, 3, 1, 2))
    for counts in ([-1, 2], [4, 0]):
        with pytest.raises(ValueError, match=r"counts must lie in \[0, 3\]"):
            cache.stage(jss.KVChunk(x, x, jnp.asarray(counts, jnp.int32)))
    jitted = jax.jit(lambda c, n: c.stage(jss.KVChunk(x, x, n)))(cache, jnp.asarray([4, 0], jnp.int32))
    assert bool(jitted.overflowed) and jitted.view().lengths.tolist() == [0, 0]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"capcity": 8}, TypeError, "capcity"),
        ({"capacity": 0}, ValueError, "capacity must be >= 1"),
        ({"capacity": "8"}, TypeError, "capacity must be an int"),
        ({}, TypeError, "needs capacity"),
        ({"window": 4}, TypeError, "needs max_staged"),
        ({"window": 4, "max_staged": 2, "capacity": 10}, TypeError, "capacity is sink"),
        ({"capacity": 8, "sink": 2}, TypeError, "only to ring mode"),
    ],
)
def test_allocate_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, **kwargs)


@pytest.mark.parametrize(
    "k_shape, dtype, error, match",
    [
        ((1, 3, 1, 5), jnp.float32, ValueError, r"k must have shape \[1, T, 1, 2\]"),
        ((1, 3, 1), jnp.float32, ValueError, r"got shape \[1, 3, 1\]"),
        ((2, 3, 1, 2), jnp.float32, ValueError, r"\[1, T, 1, 2\]"),
        ((1, 3, 1, 2), jnp.bfloat16, TypeError, "dtype float32; got .* bfloat16"),
    ],
)
def test_bad_payload_names_the_object(k_shape, dtype, error, match):
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
    with pytest.raises(error, match=match) as raised:
        cache.stage((jnp.ones(k_shape, dtype), jnp.ones(k_shape, dtype)))
    assert "KVCache(batch=1" in str(raised.value)


def test_k_and_v_must_agree():
    cache = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
    with pytest.raises(ValueError, match=r"v must have .*T=3"):
        cache.stage((jnp.ones((1, 3, 1, 2)), jnp.ones((1, 4, 1, 2))))
