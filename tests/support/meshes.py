"""Meshes and shard-level helpers shared by the multi-device tests."""

import jax
import numpy as np
from jax.sharding import AxisType


def auto_mesh(shape, names, devices=None):
    """A mesh whose axes are all AxisType.Auto, over ``devices`` (default: all)."""
    if devices is None:
        devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def shard_pointers(tree):
    """(device id, buffer pointer) of every addressable shard of every array leaf."""
    return [
        tuple((s.device.id, s.data.unsafe_buffer_pointer()) for s in leaf.addressable_shards)
        for leaf in jax.tree_util.tree_leaves(tree)
        if isinstance(leaf, jax.Array)
    ]


def shardings(tree):
    """The sharding of every array leaf."""
    return [leaf.sharding for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, jax.Array)]
