"""The spine every kind shares: one allocate path, one vocabulary, checked writes, clear errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.errors import DonatedError, PayloadError, PayloadTypeError
from tests.support.kinds import KINDS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unknown_keyword_is_a_type_error_naming_it(kind):
    make, _ = KINDS[kind]
    obj = make()
    message = rf"{type(obj).__name__}\.allocate\(\) got unexpected keyword argument\(s\): sizee"
    with pytest.raises(PayloadTypeError, match=message):
        type(obj).allocate(sizee=3)


@pytest.mark.parametrize(
    ("cost", "error", "shown"),
    [("2.5", PayloadTypeError, "'2.5'"), (None, PayloadTypeError, "None"), (-1, PayloadError, "-1"),
     (float("nan"), PayloadError, "nan")],
)
@pytest.mark.parametrize(
    "allocate",
    [lambda **kw: jss.FixedState.allocate(shapes=(1, 2), **kw),
     lambda **kw: jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4, **kw)],
    ids=["FixedState", "KVCache"],
)
def test_recompute_cost_is_a_number_at_least_zero(allocate, cost, error, shown):
    with pytest.raises(error, match=rf"^\w+\.allocate: recompute_cost must be (a number )?>= 0; got {shown}\.$"):
        allocate(recompute_cost=cost)
    assert allocate(recompute_cost=np.float32(2.5)).recompute_cost == 2.5
    assert type(allocate(recompute_cost=3).recompute_cost) is float


def test_ring_capacity_is_what_stays_visible_and_the_margin_is_extra():
    kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, window=6, sink=2, max_staged=3)
    assert (kv.capacity, kv.staging_margin, kv.slots) == (8, 3, 11) and kv.k.shape[2] == 11
    frames = jss.LatentBuffer.allocate(capacity=2, item_shape=(1,), ring=True, max_staged=8)
    assert frames.fill() == jss.Fill(committed=0, staged=0, capacity=2, margin=8)


def test_recompute_source_given_as_one_name_is_one_name():
    kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    assert kv.replace(recompute_source="prompt").recompute_source == ("prompt",)
    prompt = jss.FixedState.allocate(shapes=(2,))
    session = jss.Session(objects={"prompt": prompt, "kv": kv.replace(recompute_source="prompt")})
    assert session.recomputable("kv")


@pytest.mark.parametrize(
    ("source", "error"),
    [
        (3, PayloadTypeError),  # neither a name nor names
        (("prompt", 3), PayloadTypeError),
        ("", PayloadError),  # a str, but no object can have the empty name
        (("prompt", ""), PayloadError),
    ],
)
def test_recompute_source_tells_a_non_name_from_an_empty_name(source, error):
    message = rf"^FixedState\.allocate: recompute_source must be object names; got {re.escape(repr(source))}\.$"
    with pytest.raises(error, match=message) as raised:
        jss.FixedState.allocate(shapes=(2,), recompute_source=source)
    assert not isinstance(raised.value, TypeError if error is PayloadError else ValueError)


def test_nbytes_by_device_accepts_a_plain_set_and_dedups_through_it():
    kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    seen = set()
    first = kv.nbytes_by_device(seen)
    assert sum(first.values()) == kv.nbytes > 0 and len(seen) == 3  # k, v, bookkeeping
    assert kv.nbytes_by_device(seen) == {}  # the same buffers again: counted once


def test_a_donated_session_raises_naming_the_object():
    rng = np.random.default_rng(0)
    session = jss.Session(objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)})
    rows = jnp.asarray(rng.normal(size=(1, 2, 1, 2)), jnp.float32)
    out = jax.jit(lambda s: s.append(kv=(rows, rows)), donate_argnums=0)(session)
    assert out["kv"].committed.tolist() == [2]
    for use in (session.view, session.nbytes_by_device, lambda: jss.summary(session)):
        with pytest.raises(DonatedError, match=r"KVCache\(.*was donated to a jitted call"):
            use()
    assert isinstance(DonatedError("x"), jss.NotResidentError)


def test_payload_errors_are_session_state_errors_and_stdlib_errors():
    kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
    with pytest.raises(PayloadError) as shape:
        kv.append((jnp.ones((1, 2, 1, 3)), jnp.ones((1, 2, 1, 3))))
    with pytest.raises(PayloadTypeError) as dtype:
        kv.append((jnp.ones((1, 2, 1, 2), jnp.bfloat16), jnp.ones((1, 2, 1, 2), jnp.bfloat16)))
    assert isinstance(shape.value, ValueError) and isinstance(shape.value, jss.SessionStateError)
    assert isinstance(dtype.value, TypeError) and isinstance(dtype.value, jss.SessionStateError)


@pytest.mark.parametrize("jit", [False, True])
def test_a_write_that_changes_a_storage_spec_is_refused_at_trace_time(jit):
    kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)

    def widen(obj):
        return obj.with_storage(k=obj.k.astype(jnp.bfloat16))

    def grow(obj):
        return obj.with_storage(v=jnp.concatenate([obj.v, obj.v], axis=2))

    for write, change in ((widen, "bfloat16"), (grow, r"\[1, 1, 8, 2\]")):
        with pytest.raises(PayloadTypeError, match=rf"KVCache\(.*a write changed storage '[kv]' from .*{change}"):
            (jax.jit(write) if jit else write)(kv)
    np.testing.assert_array_equal(kv.k, np.zeros((1, 1, 4, 2)))  # nothing changed


def with_wrong_dtype(payload):
    """``payload`` with its first leaf in float16 (no kind's payload dtype here)."""
    leaves, treedef = jax.tree_util.tree_flatten(payload)
    return treedef.unflatten([leaves[0].astype(jnp.float16), *leaves[1:]])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("method", ["stage", "commit", "append"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_write_errors_name_the_method_called(kind, method, jit):
    make, payload_of = KINDS[kind]
    obj = make()
    wrong = with_wrong_dtype(payload_of(np.random.default_rng(0)))

    def write(obj, payload):
        return getattr(obj, method)(payload)

    with pytest.raises(PayloadTypeError) as raised:
        (jax.jit(write) if jit else write)(obj, wrong)
    message = str(raised.value)
    assert message.startswith(f"{obj.describe()}.{method}: "), message
    assert "float16" in message and "got" in message, message
    others = {"stage", "commit", "append"} - {method}
    assert not any(f".{other}" in message for other in others), message
    assert obj.fill() == make().fill()  # nothing was written
    not_resident = rf"^{method}\(\) on {re.escape(obj.describe())}, which is not resident"
    with pytest.raises(jss.NotResidentError, match=not_resident):
        getattr(obj.reset(), method)(payload_of(np.random.default_rng(0)))
