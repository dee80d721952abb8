"""The sharded session every multi-host test rolls out, importable by the parent (reference) and the children."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

import jax_session_state as jss

B, H, D, CAPACITY, T, STEPS = 2, 8, 4, 32, 2, 3
AXES = {"kv_heads": "model", "heads": "model", "hidden": "model"}


ROW_AXES = {"batch": "model"}  # every device holds its own rows of a K/V cache (and of its counts)
FAULT_TIMEOUT_S = 10  # how long a save or restore of the fault tests waits for a process that never answers


def make_rules(devices=None, axes=None):
    """Rules (``AXES`` unless given) over a 1-D ``model`` mesh of every device of every process (or ``devices``)."""
    devices = jax.devices() if devices is None else devices
    mesh = jax.make_mesh((len(devices),), ("model",), axis_types=(AxisType.Auto,), devices=devices)
    return jss.ShardingRules(mesh, AXES if axes is None else axes)


def row_counts(rows):
    """The tokens written into each of ``rows`` rows by ``rows_session``."""
    return [1 + (3 * row) % 4 for row in range(rows)]


def rows_session():
    """A K/V cache of one row per device (of every process), rows of different lengths, and an RNG key attr; on this
    process's first device, the same values on every process."""
    rows = jax.device_count()
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.normal(size=(rows, 4, H, D)).astype(np.float32)) for _ in range(2))
    kv = jss.KVCache.allocate(batch=rows, kv_heads=H, head_dim=D, capacity=8)
    kv = kv.append(jss.KVChunk(k, v, counts=jnp.asarray(row_counts(rows), jnp.int32)))
    return jss.Session(objects={"kv": kv}, attrs={"rng": jax.random.key(11)})


def global_array(value, sharding):
    """``value`` (the same numpy value on every process) as a global array on ``sharding``."""
    value = np.asarray(value)
    if sharding is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def new_session(rules=None):
    return jss.Session(
        objects={
            "kv": jss.KVCache.allocate(batch=B, kv_heads=H, head_dim=D, capacity=CAPACITY, sharding=rules),
            "carry": jss.FixedState.allocate(shapes={"h": (B, H)}, axes={"h": ("batch", "hidden")}, sharding=rules),
        },
        attrs={"step": global_array(np.int32(0), None if rules is None else rules.replicated())},
    )


def inputs(i, rules=None):
    """Step ``i``'s new K/V rows and queries, placed head-sharded by ``rules``."""
    rng = np.random.default_rng(i)
    k, v, q = (rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
    if rules is None:
        return tuple(map(jnp.asarray, (k, v, q)))
    where = NamedSharding(rules.mesh, rules.partition_spec((None, None, "heads", None), k.shape))
    return tuple(global_array(x, where) for x in (k, v, q))


def step(session, k, v, q):
    """Append the rows, update the carry, attend over the cache."""
    h = jnp.tanh(session["carry"].value["h"] + k.sum(axis=(1, 3)))
    session = session.append(kv=(k, v), carry={"h": h})
    out = jss.attend(q, session["kv"].view())
    return session.with_attrs(step=session.attrs["step"] + 1), out


run = jax.jit(step, donate_argnums=0)


def rolled_out(rules=None, steps=STEPS):
    """The session after ``steps`` donated steps, and every step's attention output."""
    session, outs = new_session(rules), []
    for i in range(steps):
        session, out = run(session, *inputs(i, rules))
        outs.append(out)
    return session, outs


def host_leaves(tree):
    """Every array leaf of ``tree`` as numpy (gathered from every process)."""
    from jax.experimental import multihost_utils

    leaves = []
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        leaves.append(np.asarray(x))
    return leaves


POOL_SLOTS, POOL_LIVE = 8, 7  # slots 0..6 live, slot 7 empty


def pool_session(slot):
    """The session inserted into ``slot``: rolled out ``slot % 3`` steps alone, on one device."""
    return rolled_out(None, steps=slot % 3)[0]


def pool_inputs(slot):
    """The K/V rows and queries slot ``slot`` steps with."""
    return inputs(100 + slot)


def replicated(tree, mesh):
    """Every leaf of ``tree`` (the same on every process) as a global array replicated over ``mesh``."""
    from jax.sharding import PartitionSpec

    where = NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map(lambda x: global_array(np.asarray(x), where), tree)
