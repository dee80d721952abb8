"""ShardingRules and the placement spec of every kind, on one device (meshes of 8: tests/multidevice)."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_session_state as jss
from jax_session_state.testing import assert_logically_equal
from tests.support.kinds import KINDS, kv_payload

MESH = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
RULES = jss.ShardingRules(MESH, {"batch": "data", "kv_heads": "model"})


def test_rules_are_compared_and_hashed_by_value():
    same = jss.ShardingRules(MESH, {"kv_heads": ("model",), "batch": "data"})
    assert same == RULES and hash(same) == hash(RULES)
    assert RULES != jss.ShardingRules(MESH, {"batch": "data"})
    assert RULES != jss.ShardingRules(MESH, dict(RULES.axes), replicate_indivisible=True)
    assert RULES.mesh_axes("kv_heads") == ("model",) and RULES.mesh_axes("capacity") == ()
    assert RULES.mesh_axes(None) == ()


def test_equal_rules_do_not_retrace_a_jitted_step():
    traces = []

    def append(kv, chunk):
        traces.append(None)
        return kv.append(chunk)

    step = jax.jit(append)
    rng = np.random.default_rng(0)
    for rules in (RULES, jss.ShardingRules(MESH, {"kv_heads": "model", "batch": "data"})):
        kv = jss.KVCache.allocate(batch=2, kv_heads=3, head_dim=4, capacity=8, sharding=rules)
        step(kv, kv_payload(rng))
    assert len(traces) == 1


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: jss.ShardingRules(np.array(jax.devices()), {}), jss.PayloadTypeError, "jax.sharding.Mesh"),
        (lambda: jss.ShardingRules(jax.make_mesh((1,), ("model",)), {}), jss.PayloadError, r"AxisType.Auto"),
        (
            lambda: jss.ShardingRules(MESH, {"kv_heads": "tensor"}),
            jss.PayloadError,
            r"'tensor', which is not in the mesh",
        ),
        (
            lambda: jss.ShardingRules(MESH, {"kv_heads": ("model", "model")}),
            jss.PayloadError,
            "names a mesh axis twice",
        ),
        (
            lambda: jss.ShardingRules(MESH, {0: "model"}),
            jss.PayloadTypeError,
            r"^ShardingRules: logical axis names must be non-empty strings; got 0\.$",
        ),
        (  # the right type, a value no axis can have
            lambda: jss.ShardingRules(MESH, {"": "model"}),
            jss.PayloadError,
            r"^ShardingRules: logical axis names must be non-empty strings; got ''\.$",
        ),
        (lambda: jss.ShardingRules(MESH, [("kv_heads", "model")]), jss.PayloadTypeError, "must map logical names"),
    ],
)
def test_bad_rules_are_refused_clearly(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_partition_spec_rejects_names_that_do_not_fit_the_shape():
    with pytest.raises(jss.PayloadError, match=r"2 logical axis names .* for shape \[2, 3, 4\]"):
        RULES.partition_spec(("batch", "kv_heads"), (2, 3, 4))


def test_one_mesh_axis_for_two_axes_of_one_array_is_refused():
    rules = jss.ShardingRules(MESH, {"batch": "model", "kv_heads": "model"})
    with pytest.raises(jss.PayloadError, match=r"KVCache.*'k'.*'batch' and 'kv_heads' both map to mesh axis 'model'"):
        jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8, sharding=rules)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_names_each_axis_of_each_storage_leaf(kind):
    obj = KINDS[kind][0]()
    storage = {name: getattr(obj, name) for name in obj.storage_fields()}
    leaves, treedef = jax.tree_util.tree_flatten(storage)
    names = treedef.flatten_up_to(obj.storage_axes())
    assert [len(n) for n in names] == [leaf.ndim for leaf in leaves]
    def is_name(a):  # a logical name, several for axes stored flattened (batch=(B, P)), or None
        return a is None or isinstance(a, str) or (isinstance(a, tuple) and all(isinstance(x, str) for x in a))

    assert all(isinstance(n, tuple) and all(is_name(a) for a in n) for n in names)


def test_kinds_name_their_axes_after_their_sizing_arguments():
    kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
    assert kv.storage_axes()["k"] == ("batch", "kv_heads", "capacity", "head_dim")
    cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
    assert cond.storage_axes()["v"] == ("batch", "kv_heads", "capacity", "head_dim")
    carry = jss.FixedState.allocate(shapes={"h": (2, 6), "c": (3,)}, axes={"h": ("batch", None), "c": None})
    assert carry.storage_axes()["value"] == {"h": ("batch", None), "c": (None,)}
    frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(2, 3), axes=(None, "channels"))
    assert frames.storage_axes()["items"] == ("slots", None, "channels")
    bank = jss.RetrievalStore.allocate(capacity=4, key_dim=3, value_shapes={"a": (2,)}, axes={"a": ("x",)})
    assert bank.storage_axes()["keys"] == ("slots", "key_dim")
    assert bank.storage_axes()["values"] == {"a": ("slots", "x")}


@pytest.mark.parametrize(
    "allocate, match",
    [
        (lambda: jss.FixedState.allocate(shapes=(2, 3), axes=("batch",)), r"FixedState.allocate: axes of leaf 0"),
        (lambda: jss.FixedState.allocate(shapes={"h": (2,)}, axes={"c": ("x",)}), "structure of the spec"),
        (lambda: jss.LatentBuffer.allocate(capacity=2, item_shape=(3,), axes=("a", "b")), "name each of the 1"),
        (lambda: jss.LatentBuffer.allocate(capacity=2, item_shape=(3,), axes="a"), "tuple of axis names"),
        (
            lambda: jss.RetrievalStore.allocate(capacity=2, key_dim=2, value_shapes=(3,), axes=((1,),)),
            "RetrievalStore.allocate: axes",
        ),
        (
            lambda: jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=1, capacity=1, sharding={"kv_heads": "model"}),
            "KVCache.allocate: sharding must be jax_session_state.ShardingRules",
        ),
    ],
)
def test_bad_axis_names_and_shardings_at_allocate_are_refused(allocate, match):
    with pytest.raises((jss.PayloadTypeError, jss.PayloadError), match=match):
        allocate()


@pytest.mark.parametrize(
    ("axes", "error", "got"),
    [
        ((3,), jss.PayloadTypeError, r"\(3,\)"),  # a name that is not a str (nor None)
        ((3, "b"), jss.PayloadTypeError, r"\(3, 'b'\)"),  # the type is told first, before the count
        (("a", "b"), jss.PayloadError, r"\('a', 'b'\)"),  # names for 2 axes of a 1-axis item
        (("",), jss.PayloadError, r"\('',\)"),  # a str, but empty
    ],
)
def test_axis_names_tell_a_name_of_the_wrong_type_from_a_wrong_count_or_an_empty_name(axes, error, got):
    expected = r"axes must name each of the 1 axes \(a str, or None for unnamed\)"
    message = rf"^LatentBuffer\.allocate: {expected}; got {got}\.$"
    with pytest.raises(error, match=message) as raised:
        jss.LatentBuffer.allocate(capacity=2, item_shape=(3,), axes=axes)
    assert not isinstance(raised.value, TypeError if error is jss.PayloadError else ValueError)


def test_a_kind_without_axis_names_is_replicated():
    class UnnamedFrames(jss.LatentBuffer, kw_only=True):
        def storage_axes(self):
            return jss.StateObject.storage_axes(self)

    frames = UnnamedFrames.allocate(capacity=4, item_shape=(2,), sharding=RULES)
    assert frames.storage_axes()["items"] == (None, None)
    assert frames.items.sharding.spec == jax.sharding.PartitionSpec()


def test_placement_is_kept_by_reset_evict_and_empty_but_not_part_of_describe():
    kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8, sharding=RULES)
    for gone in (kv.reset(), kv.evict()[0]):
        assert gone.sharding == RULES and gone.empty().sharding == RULES
        assert gone.empty().k.sharding.mesh == MESH
    assert kv.describe() == jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8).describe()
    assert "sharding" not in kv.spec_fields()


def test_sharded_writes_match_unsharded_ones():
    rng = np.random.default_rng(1)
    make, payload = KINDS["kv_ring"]
    plain = make()
    sharded = jss.shard(plain, RULES)
    for _ in range(3):
        chunk = payload(rng)
        plain, sharded = plain.append(chunk), sharded.append(chunk)
    assert_logically_equal(sharded.view(), plain.view(), "a sharded ring differs from an unsharded one")


def test_shard_places_objects_and_replicates_jax_attrs_only():
    session = jss.Session(
        objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)},
        attrs={"rng": jax.random.key(0), "table": np.arange(3), "step": 3},
    )
    placed = jss.shard(session, RULES)
    assert placed["kv"].sharding == RULES
    assert placed.attrs["rng"].sharding == RULES.replicated()
    assert isinstance(placed.attrs["table"], np.ndarray) and placed.attrs["step"] == 3
    with pytest.raises(jss.PayloadTypeError, match="shard\\(\\) takes ShardingRules"):
        jss.shard(session, MESH)

