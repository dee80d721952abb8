"""PagedKVCache against a plain-Python model of slots and pages; forks, frees, refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jax_session_state as jss
from jax_session_state.testing import logical
from tests.support.devices import DEVICE

H, D = 2, 3  # two kv heads: a head-major / token-major mix-up moves rows between heads


# --------------------------------------------------------------------- model
class PagedModel:
    """Per slot: rows by position, the committed count, and the pages held (abstract ids).

    Pages are tracked only as identities: a new page is a fresh int, a fork
    shares the source's full pages and adds one fresh page for a partial last
    page.  The free count follows from the ids in use.
    """

    def __init__(self, slots: int, *, page_size: int, num_pages: int, max_pages_per_slot: int):
        self.page_size, self.num_pages, self.max_pages = page_size, num_pages, max_pages_per_slot
        self.rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(slots)]
        self.committed = [0] * slots
        self.pages: list[list[int]] = [[] for _ in range(slots)]
        self._next_page = 0

    def _new_page(self) -> int:
        self._next_page += 1
        return self._next_page

    def free_count(self, without: int | None = None) -> int:
        """Free pages, or free pages once slot ``without`` let go of its pages."""
        used = {p for s, pages in enumerate(self.pages) if s != without for p in pages}
        return self.num_pages - len(used)

    def write(self, name: str, chunk: jss.KVChunk) -> type[Exception] | None:
        """Applies stage / append / commit_payload; returns the error it must raise, if refused."""
        k, v = np.asarray(chunk.k), np.asarray(chunk.v)
        counts = [int(c) for c in np.asarray(chunk.counts)]
        ends = [committed + c for committed, c in zip(self.committed, counts)]  # a write replaces what was staged
        if any(end > self.max_pages * self.page_size for end in ends):
            return jss.CapacityError
        new_pages = [max(0, math.ceil(end / self.page_size) - len(held)) for end, held in zip(ends, self.pages)]
        if sum(new_pages) > self.free_count():
            return jss.CapacityError
        for s, c in enumerate(counts):
            self.pages[s] += [self._new_page() for _ in range(new_pages[s])]
            self.rows[s] = self.rows[s][:self.committed[s]] + [(k[s, t], v[s, t]) for t in range(c)]
        if name != "stage":
            self.commit()
        return None

    def commit(self) -> None:
        self.committed = [len(rows) for rows in self.rows]

    def discard(self) -> None:
        self.rows = [rows[:c] for rows, c in zip(self.rows, self.committed)]  # pages stay attached

    def fork(self, src: int, dst: int) -> type[Exception] | None:
        n = self.committed[src]
        if n == 0 or self.rows[dst]:
            return ValueError
        full, partial = divmod(n, self.page_size)
        if partial and self.free_count(without=dst) < 1:
            return jss.CapacityError
        self.pages[dst] = self.pages[src][:full] + ([self._new_page()] if partial else [])
        self.rows[dst] = self.rows[src][:n]
        self.committed[dst] = n
        return None

    def free(self, slot: int) -> type[Exception] | None:
        if not self.pages[slot]:
            return ValueError
        self.pages[slot], self.rows[slot], self.committed[slot] = [], [], 0
        return None

    def view(self, include_staged: bool) -> list[dict[str, np.ndarray]]:
        out = []
        for rows, committed in zip(self.rows, self.committed):
            shown = rows if include_staged else rows[:committed]
            out.append({
                "positions": np.arange(len(shown), dtype=np.int32),
                "k": np.asarray([r[0] for r in shown], np.float32).reshape(-1, H, D),
                "v": np.asarray([r[1] for r in shown], np.float32).reshape(-1, H, D),
            })
        return out


# ------------------------------------------------------------ invariants
def assert_pages_consistent(cache: jss.PagedKVCache, model: PagedModel | None = None) -> None:
    """Refcounts, the free list and the page tables agree (and match the model's page sharing)."""
    table = np.asarray(cache.page_table)
    refcounts, free_count = np.asarray(cache.refcounts), int(cache.free_count)
    held = table >= 0
    for row, used in zip(table, held):
        n = used.sum()
        assert used[:n].all() and not used[n:].any(), f"a page table row is not a prefix: {row}"
        assert len(set(row[:n])) == n, f"a slot refers to a page twice: {row}"
    np.testing.assert_array_equal(refcounts, np.bincount(table[held], minlength=cache.num_pages))
    free = np.asarray(cache.free_pages)[:free_count]
    assert len(set(free)) == free_count and (refcounts[free] == 0).all(), "the free list holds a page in use"
    assert free_count + (refcounts > 0).sum() == cache.num_pages, "free + referenced pages != num_pages"
    if model is not None:
        assert free_count == model.free_count()
        real_of: dict[int, int] = {}
        for s, pages in enumerate(model.pages):
            assert held[s].sum() == len(pages), f"slot {s} holds {held[s].sum()} pages, the model's {len(pages)}"
            for entry, page in enumerate(pages):  # the same sharing: a bijection of page ids
                assert real_of.setdefault(page, table[s, entry]) == table[s, entry]
        assert len(set(real_of.values())) == len(real_of)


def assert_views_equal(cache: jss.PagedKVCache, model: PagedModel, where: str) -> None:
    for include_staged in (True, False):
        got, want = logical(cache.view(include_staged=include_staged)), model.view(include_staged)
        for s, (g, w) in enumerate(zip(got, want)):
            for key in w:
                np.testing.assert_array_equal(g[key], w[key], err_msg=f"{where}: slot {s} {key}")


# ------------------------------------------------ stateful property test
SLOTS, PAGE, PAGES, PER_SLOT = 3, 2, 5, 4
CHUNKS = (1, 3)  # few distinct T: few compiles

JITTED = {  # compiled once per shape for the whole module
    "stage": jax.jit(lambda c, p: c.stage(p), donate_argnums=0),
    "append": jax.jit(lambda c, p: c.append(p), donate_argnums=0),
    "commit_payload": jax.jit(lambda c, p: c.commit(p), donate_argnums=0),
    "commit": jax.jit(lambda c: c.commit(), donate_argnums=0),
    "discard": jax.jit(lambda c: c.discard(), donate_argnums=0),
    "fork": jax.jit(lambda c, src, dst: c.fork(src, dst), donate_argnums=0),
    "free": jax.jit(lambda c, slot: c.free(slot), donate_argnums=0),
}

EAGER = {
    "stage": lambda c, p: c.stage(p),
    "append": lambda c, p: c.append(p),
    "commit_payload": lambda c, p: c.commit(p),
    "commit": lambda c: c.commit(),
    "discard": lambda c: c.discard(),
    "fork": lambda c, src, dst: c.fork(src, dst),
    "free": lambda c, slot: c.free(slot),
}

slots = st.integers(0, SLOTS - 1)


class PagedMachine(RuleBasedStateMachine):
    """Random interleavings of every operation across slots, checked after each step."""

    jit = False

    def __init__(self) -> None:
        super().__init__()
        self.cache = jss.PagedKVCache.allocate(
            max_slots=SLOTS, kv_heads=H, head_dim=D, page_size=PAGE, num_pages=PAGES,
            max_pages_per_slot=PER_SLOT,
        )
        self.model = PagedModel(SLOTS, page_size=PAGE, num_pages=PAGES, max_pages_per_slot=PER_SLOT)

    def apply(self, name: str, refusal: type[Exception] | None, *args) -> None:
        """Runs ``name`` on the cache; a refusal must raise eagerly, or flag and write nothing under jit."""
        if not self.jit:
            if refusal is None:
                self.cache = EAGER[name](self.cache, *args)
            else:
                with pytest.raises(refusal, match="PagedKVCache"):
                    EAGER[name](self.cache, *args)
            return
        self.cache = JITTED[name](self.cache, *args)
        assert bool(self.cache.overflowed) == (refusal is not None), f"{name}: overflowed flag is wrong"
        self.cache = self.cache.replace(refused=jnp.zeros((), bool))  # check each operation's flag alone

    def write(self, name: str, T: int, data: st.DataObject) -> None:
        counts = data.draw(st.lists(st.sampled_from(range(T + 1)), min_size=SLOTS, max_size=SLOTS), label="n")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        k, v = (jnp.asarray(rng.normal(size=(SLOTS, T, H, D)), jnp.float32) for _ in range(2))
        chunk = jss.KVChunk(k, v, jnp.asarray(counts, jnp.int32))
        self.apply(name, self.model.write(name, chunk), chunk)

    @rule(T=st.sampled_from(CHUNKS), data=st.data())
    def stage(self, T, data) -> None:
        self.write("stage", T, data)

    @rule(name=st.sampled_from(["append", "commit_payload"]), T=st.sampled_from(CHUNKS), data=st.data())
    def append(self, name, T, data) -> None:
        self.write(name, T, data)

    @rule(name=st.sampled_from(["commit", "discard"]))
    def settle(self, name) -> None:
        getattr(self.model, name)()
        self.apply(name, None)

    @precondition(lambda self: any(self.model.committed) and not all(self.model.rows))
    @rule(data=st.data())
    def fork(self, data) -> None:
        """A fork the rules allow (it may still run out of pages)."""
        src = data.draw(st.sampled_from([s for s in range(SLOTS) if self.model.committed[s]]), label="src")
        dst = data.draw(st.sampled_from([s for s in range(SLOTS) if not self.model.rows[s]]), label="dst")
        self.apply("fork", self.model.fork(src, dst), src, dst)

    @rule(src=slots, dst=slots)
    def fork_any(self, src, dst) -> None:
        self.apply("fork", self.model.fork(src, dst), src, dst)

    @rule(slot=slots)
    def free(self, slot) -> None:
        self.apply("free", self.model.free(slot), slot)

    @invariant()
    def matches_model(self) -> None:
        assert_views_equal(self.cache, self.model, "after a step")
        assert_pages_consistent(self.cache, self.model)

    def teardown(self) -> None:
        for slot, pages in enumerate(self.model.pages):
            if pages:
                self.apply("free", self.model.free(slot), slot)
        assert_pages_consistent(self.cache, self.model)
        assert int(self.cache.free_count) == PAGES and not np.asarray(self.cache.refcounts).any()
        assert sorted(np.asarray(self.cache.free_pages).tolist()) == list(range(PAGES))


class PagedJitMachine(PagedMachine):
    jit = True


TestPagedEager = PagedMachine.TestCase
TestPagedEager.settings = settings(max_examples=200, stateful_step_count=12)
TestPagedJit = PagedJitMachine.TestCase
TestPagedJit.settings = settings(max_examples=200, stateful_step_count=12)


# ------------------------------------------------------------ unit tests
def _cache(*, slots=3, page_size=4, num_pages=8, max_pages_per_slot=None) -> jss.PagedKVCache:
    return jss.PagedKVCache.allocate(
        max_slots=slots, kv_heads=H, head_dim=D, page_size=page_size, num_pages=num_pages,
        max_pages_per_slot=max_pages_per_slot,
    )


def _chunk(rng: np.random.Generator, counts: list[int], T: int | None = None, *, heads: int = H,
           dim: int = D) -> jss.KVChunk:
    T = max(counts) if T is None else T
    k, v = (jnp.asarray(rng.normal(size=(len(counts), T, heads, dim)), jnp.float32) for _ in range(2))
    return jss.KVChunk(k, v, jnp.asarray(counts, jnp.int32))


def _host(cache: jss.PagedKVCache) -> dict[str, np.ndarray]:
    return {name: np.array(getattr(cache, name)) for name in cache.storage_fields()}


def _assert_unchanged_but_flagged(before: dict[str, np.ndarray], after: jss.PagedKVCache) -> None:
    assert bool(after.overflowed), "a refused operation under jit did not set overflowed"
    for name, value in before.items():
        if name != "refused":
            np.testing.assert_array_equal(getattr(after, name), value, err_msg=f"a refusal changed {name}")
    with pytest.raises(jss.CapacityError, match=r"\['paged'\]: PagedKVCache"):
        jss.check({"paged": after})


def test_fork_shares_full_pages_and_copies_only_the_partial_one():
    rng = np.random.default_rng(0)
    cache = _cache(num_pages=16).append(_chunk(rng, [10, 8, 0]))  # 2 full pages + 2 rows; 2 full pages
    free, nbytes = int(cache.free_count), cache.nbytes
    forked = cache.fork(0, 2)
    table, before = np.asarray(forked.page_table), np.asarray(cache.page_table)
    np.testing.assert_array_equal(table[2, :2], before[0, :2])  # the full pages are shared
    assert table[2, 2] >= 0 and table[2, 2] not in before  # the partial page is a fresh copy
    assert int(forked.free_count) == free - 1 and forked.nbytes == nbytes  # one page, nothing allocated
    np.testing.assert_array_equal(np.asarray(forked.refcounts)[before[0, :3]], [2, 2, 1])
    np.testing.assert_array_equal(forked.k_pages[table[2, 2]], cache.k_pages[before[0, 2]])
    np.testing.assert_array_equal(logical(forked.view())[2]["k"], logical(cache.view())[0]["k"])
    aligned = cache.fork(1, 2)  # a page-aligned sequence copies nothing
    assert int(aligned.free_count) == free
    np.testing.assert_array_equal(np.asarray(aligned.page_table)[2, :2], before[1, :2])
    np.testing.assert_array_equal(logical(aligned.view())[2]["v"], logical(cache.view())[1]["v"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_writes_after_a_fork_never_leak_into_the_other_slot(jit):
    rng = np.random.default_rng(1)
    append, fork = (JITTED["append"], JITTED["fork"]) if jit else (EAGER["append"], EAGER["fork"])
    cache = append(_cache(num_pages=16), _chunk(rng, [6, 0, 0], T=6))
    prefix = logical(cache.view())[0]
    shared = int(cache.page_table[0, 0])
    shared_rows = np.array(cache.k_pages[shared])
    cache = fork(cache, 0, 1)
    after = _chunk(rng, [5, 3, 0], T=5)  # different rows for each side of the fork
    cache = append(cache, after)
    rows, new_rows = logical(cache.view()), np.asarray(after.k)
    np.testing.assert_array_equal(rows[0]["k"], np.concatenate([prefix["k"], new_rows[0, :5]]))
    np.testing.assert_array_equal(rows[1]["k"], np.concatenate([prefix["k"], new_rows[1, :3]]))
    np.testing.assert_array_equal(cache.k_pages[shared], shared_rows)  # the shared page was never written
    assert_pages_consistent(cache)


def test_free_returns_only_pages_no_other_slot_holds():
    rng = np.random.default_rng(2)
    cache = _cache(num_pages=16).append(_chunk(rng, [10, 0, 0])).fork(0, 1)
    forked_view = logical(cache.view())[1]
    free = int(cache.free_count)
    cache = cache.free(0)
    assert int(cache.free_count) == free + 1  # only slot 0's partial page; the shared two stay with slot 1
    np.testing.assert_array_equal(logical(cache.view())[1]["k"], forked_view["k"])
    cache = cache.free(1)
    assert int(cache.free_count) == 16 and not np.asarray(cache.refcounts).any()
    assert_pages_consistent(cache)


def test_discarded_rows_keep_their_pages_for_the_next_write():
    rng = np.random.default_rng(3)
    cache = _cache().stage(_chunk(rng, [6, 0, 0])).discard()
    assert int(cache.free_count) == 6 and cache.view().lengths.tolist() == [0, 0, 0]
    assert int(cache.append(_chunk(rng, [5, 0, 0])).free_count) == 6  # the kept pages take the next rows
    assert int(cache.free(0).free_count) == 8  # a slot holding only kept pages can be freed
    # A fork into a slot holding only kept pages releases them first.
    cache = _cache().append(_chunk(rng, [6, 0, 0])).stage(_chunk(rng, [0, 3, 0])).discard()
    assert int(cache.free_count) == 5
    forked = cache.fork(0, 1)  # releases slot 1's page, shares one page, copies the partial one
    assert int(forked.free_count) == 5
    assert np.asarray(forked.page_table)[1, 0] == np.asarray(cache.page_table)[0, 0]
    np.testing.assert_array_equal(logical(forked.view())[1]["k"], logical(cache.view())[0]["k"])
    assert_pages_consistent(forked)


# Each bad call: (method, args, eager error, what the message says).
BAD_CALLS = {
    "fork into an occupied slot": (
        "fork", (0, 1), ValueError, r"dst slot 1 is occupied \(3 rows\); fork needs a slot without rows"
    ),
    "fork into itself": ("fork", (0, 0), ValueError, r"dst slot 0 is occupied"),
    "fork from an empty slot": ("fork", (2, 1), ValueError, r"src slot 2 holds no committed rows"),
    "fork from staged-only rows": ("fork", (1, 2), ValueError, r"src slot 1 holds no committed rows"),
    "fork src out of range": ("fork", (3, 2), IndexError, r"src must be a slot in \[0, 3\); got 3"),
    "fork dst out of range": ("fork", (0, -1), IndexError, r"dst must be a slot in \[0, 3\); got -1"),
    "free of a free slot": ("free", (2,), ValueError, r"slot 2 is already free \(it holds no pages\)"),
    "free out of range": ("free", (5,), IndexError, r"slot must be a slot in \[0, 3\); got 5"),
}


def _occupied_cache() -> jss.PagedKVCache:
    """Slot 0: 5 committed rows; slot 1: 3 staged rows; slot 2: free."""
    rng = np.random.default_rng(4)
    return _cache().append(_chunk(rng, [5, 0, 0])).stage(_chunk(rng, [0, 3, 0]))


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_slot_operations_raise_eagerly_and_change_nothing_under_jit(case):
    method, args, error, match = BAD_CALLS[case]
    cache = _occupied_cache()
    with pytest.raises(error, match=match) as raised:
        getattr(cache, method)(*args)
    assert "PagedKVCache(max_slots=3" in str(raised.value)
    before = _host(cache)
    _assert_unchanged_but_flagged(before, JITTED[method](cache, *args))


@pytest.mark.parametrize(
    ("slot", "shown"),
    [(1.0, "1.0"), (jnp.array([0, 1]), r"shape \[2\] and dtype int32"), (True, "True"), ("1", "'1'"), (None, "None")],
)
def test_slot_must_be_an_integer_scalar(slot, shown):
    with pytest.raises(jss.PayloadTypeError, match=rf"\.fork: src must be an integer scalar; got {shown}\.$"):
        _occupied_cache().fork(slot, 2)


@pytest.mark.parametrize(
    "counts, match",
    [
        ([4, 4, 2], r"needs 3 new pages but 2 of 8 are free"),  # out of pages
        ([0, 0, 10], r"exceeds a slot's 16 rows \(max_pages_per_slot 4 x page_size 4\)"),  # out of table room
    ],
    ids=["pages", "table"],
)
def test_overflow_writes_nothing_eagerly_or_under_jit(counts, match):
    rng = np.random.default_rng(5)
    cache = _cache(num_pages=8, max_pages_per_slot=4).append(_chunk(rng, [8, 8, 7]))  # 6 pages used, 2 free
    chunk = _chunk(rng, counts, T=10)
    with pytest.raises(jss.CapacityError, match=match):
        cache.append(chunk)
    before = _host(cache)
    for name in ("stage", "append"):
        _assert_unchanged_but_flagged(before, JITTED[name](jax.tree_util.tree_map(jnp.copy, cache), chunk))


def test_fork_out_of_pages_copies_nothing():
    rng = np.random.default_rng(6)
    cache = _cache(num_pages=4).append(_chunk(rng, [6, 8, 0]))  # every page in use; slot 0 ends mid-page
    with pytest.raises(jss.CapacityError, match="last page of slot 0 needs a copy but no page of 4 is free"):
        cache.fork(0, 2)
    before = _host(cache)
    _assert_unchanged_but_flagged(before, JITTED["fork"](jax.tree_util.tree_map(jnp.copy, cache), 0, 2))
    assert int(cache.fork(1, 2).free_count) == 0  # a page-aligned fork needs no free page


def test_bad_counts_eager_and_jit():
    rng = np.random.default_rng(7)
    cache = _cache()
    chunk = _chunk(rng, [1, 4, 0], T=3)
    with pytest.raises(ValueError, match=r"PagedKVCache.*counts must lie in \[0, 3\]; got \[1, 4, 0\]"):
        cache.stage(chunk)
    _assert_unchanged_but_flagged(_host(cache), JITTED["stage"](cache, chunk))


def test_jitted_steps_compile_once():
    traces = {"append": 0, "fork": 0, "free": 0}

    def traced(name, method):
        def run(*args):
            traces[name] += 1
            return method(*args)
        return jax.jit(run, donate_argnums=0)

    append = traced("append", lambda c, p: c.append(p))
    fork = traced("fork", lambda c, src, dst: c.fork(src, dst))
    free = traced("free", lambda c, slot: c.free(slot))
    rng = np.random.default_rng(8)
    cache = _cache(slots=4, num_pages=32)
    for step in range(12):
        cache = append(cache, _chunk(rng, rng.integers(0, 4, size=4).tolist(), T=3))
        if step % 3 == 2:
            src = int(np.argmax(np.asarray(cache.committed)))
            dst = (src + 1) % 4
            cache = fork(free(cache, dst), src, dst)
    jss.check(cache)
    assert traces == {"append": 1, "fork": 1, "free": 1}
    assert_pages_consistent(cache)


@pytest.mark.parametrize("method", ["fork", "free"])
def test_donated_fork_and_free_write_in_place(method):
    cache = _cache().append(_chunk(np.random.default_rng(9), [6, 0, 0]))
    if method == "free":
        cache = cache.fork(0, 1)
    args = (0, 1) if method == "fork" else (1,)
    step = JITTED[method]
    storage = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    aliased = step.lower(cache, *args).compile().memory_analysis().alias_size_in_bytes
    assert aliased == storage, f"{aliased} of {storage} storage bytes aliased"
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(cache)]
    out = step(cache, *args)
    assert [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(out)] == pointers
    assert not bool(out.overflowed)


@pytest.mark.parametrize("num_pages", [64, 1024])
def test_a_fork_touches_one_page_of_the_pools_whatever_their_size(num_pages):
    """The compiled fork reads and writes the partial page's rows, never the pools: its bytes accessed
    stay within a few pages plus passes over the bookkeeping, and only the copy's page changes."""
    cache = jss.PagedKVCache.allocate(max_slots=4, kv_heads=8, head_dim=64, page_size=16, num_pages=num_pages)
    cache = cache.append(_chunk(np.random.default_rng(3), [3 * 16 + 5, 0, 0, 0], heads=8, dim=64))
    fork = jax.jit(lambda c, src, dst: c.fork(src, dst), donate_argnums=0)
    page = cache.k_pages[0].nbytes
    pools = cache.k_pages.nbytes + cache.v_pages.nbytes
    bookkeeping = sum(getattr(cache, name).nbytes for name in ("page_table", "committed", "staged", "refcounts",
                                                              "free_pages", "free_count", "refused"))
    accessed = fork.lower(cache, 0, 1).compile().cost_analysis()["bytes accessed"]
    assert accessed <= 16 * page + 32 * bookkeeping < pools / 4, (accessed, page, bookkeeping, pools)
    before = np.asarray(cache.k_pages)
    forked = fork(cache, 0, 1)
    changed = np.flatnonzero(np.any(np.asarray(forked.k_pages) != before, axis=(1, 2, 3)))
    assert changed.tolist() == [int(forked.page_table[1, 3])]


def test_to_dense_is_head_major_and_matches_the_pages():
    rng = np.random.default_rng(10)
    cache = _cache(max_pages_per_slot=3).append(_chunk(rng, [9, 2, 0])).stage(_chunk(rng, [1, 0, 4]))
    for include_staged in (True, False):
        view = cache.view(include_staged=include_staged)
        dense = view.to_dense()
        assert dense.k.shape == (3, H, 12, D)  # [slots, kv_heads, max_pages_per_slot * page_size, head_dim]
        for got, want in zip(dense.materialize(), view.materialize()):
            for key in ("positions", "k", "v"):
                np.testing.assert_array_equal(got[key], want[key])
    np.testing.assert_array_equal(dense.positions[1], [0, 1] + [-1] * 10)
    np.testing.assert_array_equal(dense.lengths, [9, 2, 0])
    np.testing.assert_array_equal(jax.jit(lambda v: v.to_dense().k)(view), dense.k)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"page_sise": 4}, TypeError, "page_sise"),
        ({"page_size": 0}, ValueError, "page_size must be >= 1"),
        ({"num_pages": 2.0}, TypeError, "num_pages must be an int"),
        ({"max_pages_per_slot": 9}, ValueError, r"max_pages_per_slot must be <= num_pages \(8\)"),
    ],
)
def test_allocate_rejects_bad_arguments(kwargs, error, match):
    args = {"max_slots": 2, "kv_heads": H, "head_dim": D, "page_size": 4, "num_pages": 8, **kwargs}
    with pytest.raises(error, match=match):
        jss.PagedKVCache.allocate(**args)


def test_summary_reports_rows_per_slot():
    rng = np.random.default_rng(12)
    cache = _cache().append(_chunk(rng, [5, 0, 0])).stage(_chunk(rng, [0, 2, 0]))
    (row,) = jss.summary(cache).rows
    assert row["committed"] == [5, 0, 0] and row["staged"] == [0, 2, 0]
    assert row["capacity"] == cache.capacity == 32 and row["margin"] == 0 and row[DEVICE] == cache.nbytes
    assert row["shapes"] == f"[8, 4, {H}, {D}]"  # the pools (K and V)
    assert jss.summary(cache.reset()).rows[0]["capacity"] == 32  # 8 pages of 4 rows per slot at most


def test_in_a_session_lanes_share_it_read_only():
    rng = np.random.default_rng(11)
    session = jss.Session(objects={"paged": _cache().append(_chunk(rng, [3, 0, 0]))})
    copy = session.fork()
    assert copy["paged"].k_pages.unsafe_buffer_pointer() != session["paged"].k_pages.unsafe_buffer_pointer()
    branches = session.branch(2)
    with pytest.raises(TypeError, match="lanes cannot write 'paged'"):
        branches.lane(0).stage(paged=_chunk(rng, [1, 0, 0]))
    np.testing.assert_array_equal(branches.lane(1).view()["paged"].lengths, [3, 0, 0])
