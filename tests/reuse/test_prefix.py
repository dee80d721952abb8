"""Paged prefix reuse: shared pages held once, attention as unshared, frees never free a mapped page."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jax_session_state as jss
from jax_session_state.reuse import PrefixIndex

H, D, VOCAB = 1, 8, 50
_TABLE = np.random.default_rng(3).normal(size=(2, VOCAB, 4096 + 64, H, D)).astype(np.float32)


def kv_of(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K/V of a prompt: a function of each token and its position (so equal prefixes give equal rows)."""
    pos = np.arange(len(tokens))
    return _TABLE[0, tokens % VOCAB, pos], _TABLE[1, tokens % VOCAB, pos]


def write(cache: jss.PagedKVCache, prompts: dict[int, np.ndarray], starts: dict[int, int]) -> jss.PagedKVCache:
    """Appends ``prompts[s][starts[s]:]`` to each slot ``s`` in one append."""
    T = max(len(p) - starts[s] for s, p in prompts.items())
    k = np.zeros((cache.max_slots, T, H, D), np.float32)
    v, counts = np.zeros_like(k), np.zeros(cache.max_slots, np.int32)
    for s, p in prompts.items():
        pk, pv = kv_of(p)
        n = len(p) - starts[s]
        k[s, :n], v[s, :n], counts[s] = pk[starts[s]:], pv[starts[s]:], n
    return cache.append(jss.KVChunk(jnp.asarray(k), jnp.asarray(v), jnp.asarray(counts)))


def test_32_slots_sharing_a_3k_prefix_hold_it_once_and_attend_as_unshared():
    slots, page, prefix = 32, 64, 3000
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, prefix)
    prompts = {s: np.r_[shared, rng.integers(0, VOCAB, 40 + s)] for s in range(slots)}
    own_pages = sum(-(-len(p) // page) - prefix // page for p in prompts.values())
    num_pages = prefix // page + own_pages + 4
    cache = jss.PagedKVCache.allocate(max_slots=slots, kv_heads=H, head_dim=D, page_size=page,
                                      num_pages=num_pages, max_pages_per_slot=64)
    index = PrefixIndex(page_size=page, identity="lm@test")
    cache, start = index.attach(cache, 0, prompts[0])
    cache = index.publish(write(cache, {0: prompts[0]}, {0: start}), 0, prompts[0])
    starts = {}
    for s in range(1, slots):
        cache, starts[s] = index.attach(cache, s, prompts[s])
        assert starts[s] == prefix // page * page
    cache = write(cache, {s: prompts[s] for s in starts}, starts)
    for s in starts:
        cache = index.publish(cache, s, prompts[s])
    # The shared pages once: pages in use = shared full pages + each slot's own.
    assert num_pages - int(cache.free_count) == prefix // page + own_pages
    table = np.asarray(cache.page_table)
    assert (table[:, : prefix // page] == table[0, : prefix // page]).all()
    # Attention equals the unshared float64 reference.
    q = rng.normal(size=(slots, 1, 2 * H, D)).astype(np.float32)
    got = np.asarray(jss.attend(jnp.asarray(q), cache.view(), causal=False))
    for s, p in prompts.items():
        k, v = (x.astype(np.float64) for x in kv_of(p))
        scores = np.einsum("hd,thd->ht", q[s, 0].astype(np.float64), np.repeat(k, 2, axis=1)) / np.sqrt(D)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("ht,thd->hd", weights / weights.sum(-1, keepdims=True), np.repeat(v, 2, axis=1))
        np.testing.assert_allclose(got[s, 0], want, atol=1e-6, rtol=0, err_msg=f"slot {s}")
    assert index.stats()["hits"] == (slots - 1) * (prefix // page)


def test_mapping_refuses_an_occupied_slot_and_unheld_pages():
    cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=H, head_dim=D, page_size=2, num_pages=4)
    from jax_session_state.objects import _page_sharing

    with pytest.raises(jss.PayloadError, match="held"):
        _page_sharing.map_pages(cache, 0, jnp.asarray([0, -1, -1, -1]), 1)
    cache = write(cache, {0: np.arange(4)}, {0: 0})
    with pytest.raises(jss.PayloadError, match="free slot"):
        _page_sharing.map_pages(cache, 0, jnp.asarray([0, -1, -1, -1]), 1)
    jitted = jax.jit(_page_sharing.map_pages, donate_argnums=0)(cache, 0, jnp.asarray([0, -1, -1, -1]), 1)
    assert bool(jitted.overflowed)


def small_cache_with_published(prompts: dict[int, np.ndarray]) -> tuple[jss.PagedKVCache, PrefixIndex]:
    """A 2-slot cache (pages of 2) holding and indexing ``prompts`` (slot -> tokens), attached and published in turn."""
    cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=H, head_dim=D, page_size=2, num_pages=12)
    index = PrefixIndex(page_size=2, identity="lm@1")
    for slot, tokens in prompts.items():
        cache, start = index.attach(cache, slot, tokens)
        cache = index.publish(write(cache, {slot: tokens}, {slot: start}), slot, tokens)
    return cache, index


def bookkeeping(cache: jss.PagedKVCache) -> dict[str, np.ndarray]:
    return {name: np.asarray(getattr(cache, name)) for name in ("page_table", "committed", "staged", "refcounts")}


@pytest.mark.parametrize("method", ["attach", "publish"])
@pytest.mark.parametrize("slot", [2, 5, -1])
def test_a_slot_out_of_range_is_an_index_error_and_changes_nothing(method, slot):
    rng = np.random.default_rng(4)
    cache, index = small_cache_with_published({1: rng.integers(0, VOCAB, 6)})
    before, stats = bookkeeping(cache), index.stats()
    message = (
        rf"^PrefixIndex\(page_size=2, identity='lm@1'\)\.{method}: slot {slot} is out of range: "
        r"PagedKVCache\(max_slots=2, .*\) has slots \[0, 2\)\.$"
    )
    with pytest.raises(IndexError, match=message):
        getattr(index, method)(cache, slot, rng.integers(0, VOCAB, 6))
    assert index.stats() == stats
    for name, array in bookkeeping(cache).items():  # not donated, not changed
        np.testing.assert_array_equal(array, before[name], err_msg=name)


@pytest.mark.parametrize("method", ["attach", "publish"])
@pytest.mark.parametrize(("slot", "shown"), [(True, "True"), (1.0, "1.0"), (np.arange(2), r"array\(\[0, 1\]\)")])
def test_a_slot_that_is_not_an_integer_is_a_type_error(method, slot, shown):
    cache, index = small_cache_with_published({})
    message = (
        rf"^PrefixIndex\(page_size=2, identity='lm@1'\)\.{method}: slot must be an integer \(not traced\); "
        rf"got {shown}\.$"
    )
    with pytest.raises(jss.PayloadTypeError, match=message):
        getattr(index, method)(cache, slot, np.arange(4))
    for slot in (np.int64(1), jnp.int32(1)):  # numpy and jax integers are slots
        assert getattr(index, method)(cache, slot, np.arange(0)) is not None


def test_a_refused_attach_counts_nothing_and_leaves_recency_as_it_was():
    rng = np.random.default_rng(6)
    a, b = rng.integers(0, VOCAB, 4), rng.integers(0, VOCAB, 4) + VOCAB  # 2 full pages each, no page in common
    cache, index = small_cache_with_published({0: a, 1: b})  # indexed a's pages, then b's: a's least recent
    cache = cache.free(0)
    stats = index.stats()
    with pytest.raises(jss.PayloadError, match=r"slot 1 of PagedKVCache\(.*\) holds pages; attach to a free slot"):
        index.attach(cache, 1, a)  # slot 1 still holds b
    assert index.stats() == stats
    cache = cache.free(1)
    cache, released = index.release_unused(cache, keep=2)  # the least recently matched: still a's
    assert released == 2
    assert index.match(a) == [] and len(index.match(b)) == 2
    cache, rows = index.attach(cache, 0, b)  # b's K/V mapped, read back as written
    (row, _) = cache.view().materialize()
    want_k, want_v = kv_of(b)
    assert rows == 4
    np.testing.assert_array_equal(row["k"], want_k)
    np.testing.assert_array_equal(row["v"], want_v)


# ---------------------------------------------------------------- the stateful model
SLOTS, PAGE, PAGES, PER_SLOT = 4, 2, 20, 7
BASE = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
_JIT = {
    "append": jax.jit(lambda c, p: c.append(p), donate_argnums=0),
    "fork": jax.jit(lambda c, src, dst: c.fork(src, dst), donate_argnums=0),
    "free": jax.jit(lambda c, slot: c.free(slot), donate_argnums=0),
}


class PrefixMachine(RuleBasedStateMachine):
    """Attach / write / publish, fork, free and index releases, against a plain Python refcount model."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = jss.PagedKVCache.allocate(max_slots=SLOTS, kv_heads=H, head_dim=D, page_size=PAGE,
                                               num_pages=PAGES, max_pages_per_slot=PER_SLOT)
        self.index = PrefixIndex(page_size=PAGE, identity="lm")
        self.tokens: list[np.ndarray | None] = [None] * SLOTS  # each slot's committed tokens
        self.pages: list[list[int]] = [[] for _ in range(SLOTS)]  # each slot's pages, in row order
        self.indexed: dict[str, int] = {}  # the model's index: key -> page, least recently matched first

    def refcounts(self) -> np.ndarray:
        counts = np.zeros(PAGES, np.int64)
        for pages in self.pages:
            for p in pages:
                counts[p] += 1
        for p in self.indexed.values():
            counts[p] += 1
        return counts

    @precondition(lambda self: any(t is None for t in self.tokens))
    @rule(data=st.data())
    def start(self, data) -> None:
        slot = data.draw(st.sampled_from([s for s in range(SLOTS) if self.tokens[s] is None]))
        cut = data.draw(st.integers(0, len(BASE)))
        tail = data.draw(st.lists(st.integers(10, 12), max_size=3))
        prompt = np.r_[BASE[:cut], tail].astype(np.int64)
        if len(prompt) == 0:
            return
        keys = jss.page_keys(prompt, page_size=PAGE, identity="lm")
        matched = []
        for key in keys:
            if key not in self.indexed:
                break
            matched.append(self.indexed[key])
            self.indexed[key] = self.indexed.pop(key)  # a match makes it the most recently used
        new_pages = -(-len(prompt) // PAGE) - len(matched)
        if new_pages > PAGES - (self.refcounts() > 0).sum():
            return  # the model refuses what would not fit: do not try
        self.cache, start = self.index.attach(self.cache, slot, prompt)
        assert start == len(matched) * PAGE
        if start < len(prompt):  # one fixed chunk shape: compiled once
            k, v = kv_of(prompt)
            rows = np.zeros((2, SLOTS, PER_SLOT * PAGE, H, D), np.float32)
            rows[0, slot, : len(prompt) - start], rows[1, slot, : len(prompt) - start] = k[start:], v[start:]
            counts = np.zeros(SLOTS, np.int32)
            counts[slot] = len(prompt) - start
            chunk = jss.KVChunk(jnp.asarray(rows[0]), jnp.asarray(rows[1]), jnp.asarray(counts))
            self.cache = _JIT["append"](self.cache, chunk)
            assert not bool(self.cache.overflowed)
        free_before = self.refcounts() == 0
        row = np.asarray(self.cache.page_table[slot])
        self.pages[slot] = [int(p) for p in row[row >= 0]]
        assert self.pages[slot][: len(matched)] == matched  # the mapped pages are the indexed ones
        assert all(free_before[p] for p in self.pages[slot][len(matched):])  # the rest came off the free list
        self.tokens[slot] = prompt
        self.cache = self.index.publish(self.cache, slot, prompt)
        for entry, key in enumerate(keys):
            self.indexed.setdefault(key, self.pages[slot][entry])

    @precondition(lambda self: any(t is not None for t in self.tokens) and any(t is None for t in self.tokens))
    @rule(data=st.data())
    def fork(self, data) -> None:
        src = data.draw(st.sampled_from([s for s in range(SLOTS) if self.tokens[s] is not None]))
        dst = data.draw(st.sampled_from([s for s in range(SLOTS) if self.tokens[s] is None]))
        n = len(self.tokens[src])
        full, partial = divmod(n, PAGE)
        if partial and not (self.refcounts() == 0).any():
            return
        free_before = self.refcounts() == 0
        self.cache = _JIT["fork"](self.cache, src, dst)
        assert not bool(self.cache.overflowed)
        row = np.asarray(self.cache.page_table[dst])
        self.pages[dst] = [int(p) for p in row[row >= 0]]
        assert self.pages[dst][:full] == self.pages[src][:full]
        assert all(free_before[p] for p in self.pages[dst][full:])
        self.tokens[dst] = self.tokens[src]

    @precondition(lambda self: any(t is not None for t in self.tokens))
    @rule(data=st.data())
    def free(self, data) -> None:
        slot = data.draw(st.sampled_from([s for s in range(SLOTS) if self.tokens[s] is not None]))
        self.cache = _JIT["free"](self.cache, slot)
        self.pages[slot], self.tokens[slot] = [], None

    @rule(keep=st.integers(0, 3))
    def release_unused(self, keep) -> None:
        counts = self.refcounts()
        unused = [key for key, page in self.indexed.items() if counts[page] == 1]
        self.cache, released = self.index.release_unused(self.cache, keep=keep)
        assert released == max(len(unused) - keep, 0)
        for key in unused[:released]:
            del self.indexed[key]

    @invariant()
    def agrees_with_the_model(self) -> None:
        counts = self.refcounts()
        np.testing.assert_array_equal(np.asarray(self.cache.refcounts), counts)
        free = np.asarray(self.cache.free_pages)[: int(self.cache.free_count)]
        assert sorted(free.tolist()) == np.flatnonzero(counts == 0).tolist()  # never a mapped page
        view = self.cache.view()
        kp, vp = np.asarray(view.k_pages), np.asarray(view.v_pages)
        for s, tokens in enumerate(self.tokens):
            if tokens is None:
                assert int(view.lengths[s]) == 0
                continue
            k, v = kv_of(tokens)
            rows = np.concatenate([kp[p] for p in self.pages[s]])[: len(tokens)]
            np.testing.assert_array_equal(rows, k, err_msg=f"slot {s}")
            np.testing.assert_array_equal(np.concatenate([vp[p] for p in self.pages[s]])[: len(tokens)], v)


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
