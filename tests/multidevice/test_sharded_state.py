"""State placed on a mesh of 8 fake devices: placement, lifecycle, donation, accounting, attention."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_session_state as jss
from jax_session_state.testing import assert_logically_equal
from tests.support.meshes import auto_mesh, shard_pointers, shardings

B, H, D = 2, 8, 4
MESH = auto_mesh((2, 4), ("data", "model"))
RULES = jss.ShardingRules(MESH, {"batch": "data", "kv_heads": "model", "slots": "data", "hidden": "model"})


def kv_chunk(rng, T=3, heads=H):
    k, v = (jnp.asarray(rng.normal(size=(B, T, heads, D)), jnp.float32) for _ in range(2))
    return jss.KVChunk(k, v, jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32))


# name -> (factory taking sharding=, payload generator, expected partition spec of each storage leaf)
KINDS = {
    "kv_append": (
        lambda **kw: jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=16, **kw),
        kv_chunk,
        {"k": P("data", "model"), "v": P("data", "model"), "k_scale": None, "v_scale": None,
         "bookkeeping": P(None, "data")},
    ),
    "kv_ring": (
        lambda **kw: jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, window=6, sink=2, max_staged=8, **kw),
        kv_chunk,
        {"k": P("data", "model"), "v": P("data", "model"), "k_scale": None, "v_scale": None,
         "bookkeeping": P(None, "data")},
    ),
    "encode_once": (
        lambda **kw: jss.EncodeOnceKV.allocate(batch=B, kv_heads=4, head_dim=D, capacity=8, **kw),
        lambda rng: kv_chunk(rng, T=5, heads=4)[:2],
        {
            "k": P("data", "model"), "v": P("data", "model"), "lengths": P("data"),
            "phase": P(), "refused": P(),
        },
    ),
    "fixed": (
        lambda **kw: jss.FixedState.allocate(
            shapes={"h": (B, 8), "conv": (B, 3, 8)}, axes={"h": (None, "hidden"), "conv": (None, None, "hidden")}, **kw
        ),
        lambda rng: {
            "h": jnp.asarray(rng.normal(size=(B, 8)), jnp.float32),
            "conv": jnp.asarray(rng.normal(size=(B, 3, 8)), jnp.float32),
        },
        {
            "value": {"conv": P(None, None, "model"), "h": P(None, "model")},
            "undo_value": {"conv": P(None, None, "model"), "h": P(None, "model")},
            "has_staged": P(),
        },
    ),
    "latent_ring": (
        lambda **kw: jss.LatentBuffer.allocate(
            capacity=6, item_shape=(4,), ring=True, max_staged=4, axes=("hidden",), **kw
        ),
        lambda rng: jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),
        {"items": P("data", "model"), "bookkeeping": P()},
    ),
    "paged": (
        lambda **kw: jss.PagedKVCache.allocate(max_slots=B, kv_heads=H, head_dim=D, page_size=4, num_pages=16, **kw),
        kv_chunk,
        {
            "k_pages": P(None, None, "model"), "v_pages": P(None, None, "model"), "k_scale": None, "v_scale": None,
            "page_table": P(), "committed": P(), "staged": P(), "refcounts": P(), "free_pages": P(),
            "free_count": P(), "refused": P(),
        },
    ),
    "paged_int8": (
        lambda **kw: jss.PagedKVCache.allocate(max_slots=B, kv_heads=H, head_dim=D, page_size=4, num_pages=16,
                                               quantize="int8", **kw),
        kv_chunk,
        {
            "k_pages": P(None, None, "model"), "v_pages": P(None, None, "model"), "k_scale": P(None, None, "model"),
            "v_scale": P(None, None, "model"), "page_table": P(), "committed": P(), "staged": P(), "refcounts": P(),
            "free_pages": P(), "free_count": P(), "refused": P(),
        },
    ),
    "retrieval": (
        lambda **kw: jss.RetrievalStore.allocate(
            capacity=6, key_dim=4, value_shapes={"a": (4,)}, max_staged=4, axes={"a": ("hidden",)}, **kw
        ),
        lambda rng: (
            jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),
            {"a": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)},
        ),
        {"keys": P("data"), "values": {"a": P("data", "model")}, "bookkeeping": P()},
    ),
}

METHODS = {
    "stage": lambda obj, payload: obj.stage(payload),
    "commit": lambda obj, payload: obj.commit(),
    "commit(payload)": lambda obj, payload: obj.commit(payload),
    "append": lambda obj, payload: obj.append(payload),
    "discard": lambda obj, payload: obj.discard(),
}


def storage(obj):
    return {name: getattr(obj, name) for name in obj.storage_fields()}


def twins(kind, seed=0):
    """The same history written into a sharded and an unsharded object, and the next payload."""
    make, payload, _ = KINDS[kind]
    rng = np.random.default_rng(seed)
    history = [payload(rng) for _ in range(3)]
    sharded, plain = make(sharding=RULES), make()
    for p in history[:2]:
        sharded, plain = sharded.append(p), plain.append(p)
    sharded, plain = sharded.stage(history[2]), plain.stage(history[2])
    return sharded, plain, payload(rng)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_allocate_places_each_storage_leaf_by_the_rules(kind):
    make, _, expected = KINDS[kind]
    obj = make(sharding=RULES)
    specs = jax.tree_util.tree_map(lambda x: x.sharding.spec, storage(obj))
    normalise = lambda spec: tuple(spec) + (None,) * 8  # noqa: E731  (trailing Nones are equal)
    got = jax.tree_util.tree_map(lambda s: normalise(s)[:4], specs, is_leaf=lambda x: isinstance(x, P))
    want = jax.tree_util.tree_map(lambda s: normalise(s)[:4], expected, is_leaf=lambda x: isinstance(x, P))
    assert got == want
    assert all(s.mesh == MESH for s in shardings(obj))
    assert obj.sharding == RULES and obj.empty().sharding == RULES


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_jitted_donated_method_keeps_sharding_aliases_every_shard_and_matches_unsharded(kind, method):
    sharded, plain, payload = twins(kind)
    expected = METHODS[method](plain, payload)
    before_shardings, before_pointers = shardings(sharded), shard_pointers(sharded)
    out = jax.jit(METHODS[method], donate_argnums=0)(sharded, payload)
    assert shardings(out) == before_shardings
    assert shard_pointers(out) == before_pointers, "a donated write moved a shard"
    assert_logically_equal(out.view(), expected.view(), f"{kind}.{method} sharded != unsharded")
    assert_logically_equal(out.view(include_staged=False), expected.view(include_staged=False), method)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_eager_methods_keep_sharding(kind):
    sharded, _, payload = twins(kind, seed=1)
    for name, method in METHODS.items():
        assert shardings(method(sharded, payload)) == shardings(sharded), name


@pytest.mark.parametrize("kind", ["kv_append", "kv_ring", "encode_once"])
def test_jitted_view_reads_kv_in_place(kind):
    sharded, _, _ = twins(kind)
    view = jax.jit(lambda obj: obj.view())(sharded)
    assert view.k.sharding == sharded.k.sharding and view.v.sharding == sharded.v.sharding
    assert view.lengths.sharding.spec == P("data")


def test_sharded_append_compiles_once():
    make, payload, _ = KINDS["kv_append"]
    rng, traces = np.random.default_rng(3), []

    def append(kv, chunk):
        traces.append(None)
        return kv.append(chunk)

    step = jax.jit(append, donate_argnums=0)
    kv = make(sharding=RULES)
    for _ in range(4):
        kv = step(kv, payload(rng))
    jss.check(kv)
    assert len(traces) == 1


def test_indivisible_axis_raises_naming_kind_axis_sizes_and_mesh_axis():
    with pytest.raises(ValueError) as error:
        jss.KVCache.allocate(batch=B, kv_heads=6, head_dim=D, capacity=8, sharding=RULES)
    message = str(error.value)
    for part in ("KVCache", "'kv_heads'", "size 6", "('model',)", "size 4", "replicate_indivisible"):
        assert part in message, message
    session = jss.Session(objects={"kv": jss.KVCache.allocate(batch=B, kv_heads=6, head_dim=D, capacity=8)})
    with pytest.raises(ValueError, match="kv_heads"):
        jss.shard(session, RULES)


def test_indivisible_axis_is_replicated_when_the_rules_say_so():
    rules = jss.ShardingRules(MESH, dict(RULES.axes), replicate_indivisible=True)
    kv = jss.KVCache.allocate(batch=B, kv_heads=6, head_dim=D, capacity=8, sharding=rules)
    assert kv.k.sharding.spec == P("data") and kv.committed.sharding.spec == P("data")
    assert kv.k.addressable_shards[0].data.shape == (1, 6, 8, D)


def test_one_mesh_axis_used_twice_in_one_array_is_refused():
    rules = jss.ShardingRules(MESH, {"batch": "model", "kv_heads": "model"})
    with pytest.raises(ValueError, match="'batch' and 'kv_heads' both map to mesh axis 'model'"):
        jss.KVCache.allocate(batch=4, kv_heads=4, head_dim=D, capacity=8, sharding=rules)


def test_an_axis_over_two_mesh_axes_splits_eight_ways():
    rules = jss.ShardingRules(MESH, {"kv_heads": ("data", "model")})
    kv = jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=8, sharding=rules)
    assert kv.k.sharding.spec == P(None, ("data", "model"))
    assert {s.data.shape for s in kv.k.addressable_shards} == {(B, 1, 8, D)}


def test_bytes_per_device_are_an_eighth_of_a_head_sharded_cache_and_replicas_count_everywhere():
    mesh = auto_mesh((8,), ("model",))
    kv = jss.KVCache.allocate(
        batch=B, kv_heads=8, head_dim=16, capacity=64, sharding=jss.ShardingRules(mesh, {"kv_heads": "model"})
    )
    session = jss.shard(jss.Session(objects={"kv": kv}, attrs={"rng": jax.random.key(0)}), kv.sharding)
    cache_bytes = 2 * B * 8 * 64 * 16 * 4  # k and v, float32
    replicated = 4 * B * 4  # the bookkeeping (int32 [4, batch]), whole on every device
    key_bytes = 8  # a threefry key: uint32[2], replicated
    by_device = session.nbytes_by_device()
    assert sorted(by_device) == sorted(f"cpu:{d.id}" for d in jax.devices())
    assert set(by_device.values()) == {cache_bytes // 8 + replicated + key_bytes}
    assert kv.nbytes == cache_bytes + 8 * replicated
    assert kv.evict()[1] == kv.nbytes


def test_session_step_keeps_every_placement_compiles_once_and_matches_unsharded():
    rng = np.random.default_rng(4)

    def make_session():
        return jss.Session(
            objects={name: KINDS[name][0]() for name in ("kv_append", "fixed", "latent_ring", "retrieval")},
            attrs={"rng": jax.random.key(7), "step": jnp.zeros((), jnp.int32)},
        )

    traces = []

    def step(session, chunk, h):
        key, sub = jax.random.split(session.attrs["rng"])
        frame = jax.random.normal(sub, (1, 4))
        session = session.append(kv_append=chunk, latent_ring=frame, retrieval=(frame, {"a": frame}))
        session = session.commit(fixed={"h": h, "conv": jnp.broadcast_to(h[:, None], (B, 3, 8))})
        return session.with_attrs(rng=key, step=session.attrs["step"] + 1)

    sharded, plain = jss.shard(make_session(), RULES), make_session()
    jitted = jax.jit(lambda *args: traces.append(None) or step(*args), donate_argnums=0)
    placement = shardings(sharded)
    for _ in range(3):
        chunk, h = kv_chunk(rng), jnp.asarray(rng.normal(size=(B, 8)), jnp.float32)
        pointers = shard_pointers(sharded)
        sharded, plain = jitted(sharded, chunk, h), step(plain, chunk, h)
        assert shardings(sharded) == placement and shard_pointers(sharded) == pointers
    assert len(traces) == 1
    for a, b in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(plain)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_paged_fork_and_free_keep_sharding_and_write_in_place():
    k, v = kv_chunk(np.random.default_rng(6), T=6)[:2]
    cache = KINDS["paged"][0](sharding=RULES).append(jss.KVChunk(k, v, jnp.array([6, 0], jnp.int32)))
    placement, pointers = shardings(cache), shard_pointers(cache)
    fork = jax.jit(lambda c: c.fork(0, 1), donate_argnums=0)
    cache = fork(cache)
    jss.check(cache)
    assert shardings(cache) == placement and shard_pointers(cache) == pointers
    free = jax.jit(lambda c: c.free(1), donate_argnums=0)
    cache = free(cache)
    assert shardings(cache) == placement and shard_pointers(cache) == pointers


def test_branches_of_a_sharded_session_keep_the_placement():
    session = jss.shard(jss.Session(objects={"kv": KINDS["kv_append"][0]()}, attrs={"rng": jax.random.key(1)}), RULES)
    rows = kv_chunk(np.random.default_rng(7))[:2]
    session = session.append(kv=rows)
    branches = session.branch(2, window=4)

    def guess(lane, scale):
        return lane.stage(kv=(rows[0] * scale, rows[1] * scale)), scale

    branches, _ = jax.jit(lambda b: b.map(guess, jnp.arange(2.0)))(branches)
    adopted = jax.jit(lambda b: b.adopt(1))(branches)
    assert shardings(adopted["kv"]) == shardings(session["kv"])
    expected = session["kv"].append((rows[0], rows[1]))
    assert_logically_equal(adopted.view()["kv"], expected.view(), "the adopted lane")


def test_non_resident_objects_keep_their_rules_and_reallocate_sharded():
    session = jss.shard(jss.Session(objects={"kv": KINDS["kv_append"][0]()}), RULES)
    kv = session["kv"]
    for gone in (kv.reset(), kv.evict()[0]):
        assert not gone.resident and gone.sharding == RULES
        assert shardings(gone.empty()) == shardings(kv)
    assert shardings(session.fork()) == shardings(session)
    assert jss.shard(kv.reset(), RULES).sharding == RULES


# ---------------------------------------------------------------- attention
def dense_attend(q, view):
    """Causal dense attention of the last ``T`` positions over a head-major :class:`KVView`.

    ``q: [batch, T, heads, dim]`` (heads a multiple of kv_heads, grouped) against
    ``k, v: [batch, kv_heads, capacity, dim]``; softmax over capacity, masked
    to the slots a query may see.
    """
    batch, T, heads, dim = q.shape
    kv_heads = view.k.shape[1]
    q = q.reshape(batch, T, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("btkgd,bkcd->bkgtc", q, view.k) / np.sqrt(dim)
    query_positions = view.lengths[:, None] - T + jnp.arange(T)
    seen = (view.positions[:, None, :] >= 0) & (view.positions[:, None, :] <= query_positions[:, :, None])
    weights = jax.nn.softmax(jnp.where(seen[:, None, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgtc,bkcd->btkgd", weights, view.v).reshape(batch, T, heads, dim)




def reference_attention(q, view):
    """float64 numpy attention of each query over the visible rows of its batch row."""
    q = np.asarray(q, np.float64)
    _batch, T, heads, dim = q.shape
    out = np.zeros_like(q)
    for b, row in enumerate(view.materialize()):
        group = heads // row["k"].shape[1]
        k, v = np.repeat(row["k"], group, axis=1), np.repeat(row["v"], group, axis=1)  # [n, heads, dim]
        end = int(row["positions"].max()) + 1 if len(row["positions"]) else 0
        for t in range(T):
            seen = row["positions"] <= end - T + t
            scores = np.einsum("hd,nhd->hn", q[b, t], k[seen]) / np.sqrt(dim)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[b, t] = np.einsum("hn,nhd->hd", weights / weights.sum(axis=1, keepdims=True), v[seen])
    return out


@pytest.mark.parametrize("attend", [dense_attend, jss.attend], ids=["einsum", "jss.attend"])
@pytest.mark.parametrize(
    "mesh_shape, names, rules",
    [
        ((8,), ("model",), {"kv_heads": "model", "heads": "model"}),
        ((2, 4), ("data", "model"), {"batch": "data", "kv_heads": "model", "heads": "model"}),
    ],
)
def test_attention_over_head_sharded_cache_never_gathers_it(mesh_shape, names, rules, attend):
    mesh = auto_mesh(mesh_shape, names)
    rules = jss.ShardingRules(mesh, rules)
    kv_heads, heads, T = 8, 16, 4
    kv = jss.KVCache.allocate(batch=B, kv_heads=kv_heads, head_dim=D, capacity=32, sharding=rules)
    rng = np.random.default_rng(5)
    append = jax.jit(lambda kv, chunk: kv.append(chunk))  # eagerly, JAX 0.10.2 mixes up meshes of one device set
    for _ in range(2):
        kv = append(kv, kv_chunk(rng, T=5, heads=kv_heads)[:2])
    q_spec = rules.partition_spec(("batch", None, "heads", None), (B, T, heads, D))
    q_sharding = jax.sharding.NamedSharding(mesh, q_spec)
    q = jax.device_put(jnp.asarray(rng.normal(size=(B, T, heads, D)), jnp.float32), q_sharding)
    chunk = kv_chunk(rng, T=T, heads=kv_heads)[:2]

    def step(kv, chunk, q):
        kv = kv.append(chunk)
        return kv, attend(q, kv.view())

    jitted = jax.jit(step, donate_argnums=0)
    hlo = jitted.lower(kv, chunk, q).compile().as_text()
    collectives = re.findall(r"\b(all-gather|all-to-all|collective-permute)[-a-z]*\(", hlo)
    assert not collectives, f"the step moves data between devices: {sorted(set(collectives))}"

    expected = reference_attention(q, append(kv, chunk).view())
    pointers = shard_pointers(kv)
    kv, out = jitted(kv, chunk, q)
    assert shard_pointers(kv) == pointers
    assert out.sharding.is_equivalent_to(q_sharding, out.ndim)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


def test_the_manager_budgets_each_device_of_a_sharded_session():
    mesh = auto_mesh((8,), ("model",))
    rules = jss.ShardingRules(mesh, {"kv_heads": "model"})

    def make():
        kv = jss.KVCache.allocate(batch=1, kv_heads=8, head_dim=16, capacity=64, sharding=rules)
        return jss.Session(objects={"kv": kv})

    per_device = make().nbytes_by_device()["cpu:0"]
    manager = jss.SessionStateManager(byte_budget={f"cpu:{d.id}": per_device * 3 // 2 for d in jax.devices()})
    rng = np.random.default_rng(8)
    k, v = (jnp.asarray(rng.normal(size=(1, 4, 8, 16)), jnp.float32) for _ in range(2))
    written = make().append(kv=(k, v))
    expected = np.asarray(written["kv"].k)
    manager.create("a", written)
    manager.create("b", make())  # each device holds one session: a is parked, shard by shard
    parked = manager.stats()["bytes"]
    assert manager.stats()["parks"] == 1
    assert {parked[f"cpu:{d.id}/pinned_host"] for d in jax.devices()} == {per_device}
    restored = manager.get("a")["kv"]
    assert restored.sharding == rules and restored.k.sharding == written["kv"].k.sharding
    np.testing.assert_array_equal(np.asarray(restored.k), expected)


def test_native_attention_kernel_stays_off_on_several_cpu_devices():
    """The FFI kernel has no partitioning rule: on a CPU mesh attention runs the pure loop."""
    from jax_session_state._core import _library

    status = jss.attention.native_status()
    assert status.startswith("pure JAX")
    if _library.AVAILABLE:
        assert status == f"pure JAX: {len(jax.devices('cpu'))} CPU devices (the kernel has no partitioning rule)"
