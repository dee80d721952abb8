"""Fingerprints that let a restore refuse damaged array files instead of returning wrong data.

A fingerprint is two 32-bit sums of an array's bits: a plain sum, which any
one changed word changes, and a sum weighted by position, which data moved to
the wrong place changes.  It depends only on the array's contents, not on its
sharding, so a checkpoint saved on 8 devices checks on 1.

Large device arrays are summed on their devices (asynchronously, so a save
computes them while Orbax writes), a row (the last axis) at a time and then
weighted by row; small arrays and host arrays on the host, byte by byte.
Which one depends only on the array's size and type, so a save and its restore agree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["start", "start_on_owned_copy", "value"]

_DEVICE_BYTES = 1 << 22  # smaller arrays are summed on the host: no compile per shape


def start(x: Any) -> Any:
    """Starts fingerprinting ``x``; :func:`value` gives the result."""
    if isinstance(x, jax.Array) and x.nbytes >= _DEVICE_BYTES:
        return _on_device(x)
    words = np.ascontiguousarray(x).reshape(-1).view(np.uint8).astype(np.uint32)
    return _weighted(np, words, np.arange(words.size, dtype=np.uint32))


def start_on_owned_copy(x: jax.Array) -> tuple[jax.Array, Any]:
    """A copy of ``x`` in new runtime-owned buffers, and the started fingerprint, in one pass."""
    if x.nbytes >= _DEVICE_BYTES:
        return _copy_on_device(x)
    return jnp.copy(x), start(x)


def value(started: Any) -> list[int]:
    """The fingerprint, waiting for it if it is still being computed."""
    return [int(v) for v in started]


def _weighted(xnp: Any, words: Any, index: Any) -> list[Any]:
    odd = index * 2 + 1  # odd weights are invertible modulo 2**32: one changed word changes the sum
    return [xnp.sum(words, dtype=xnp.uint32), xnp.sum(words * odd, dtype=xnp.uint32)]


def _device_sums(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
    rows = jnp.sum(words.reshape(words.shape or (1,)), axis=-1, dtype=jnp.uint32)
    # Each row's row-major index, from iotas: flattening a sharded array would make XLA move it
    # between devices, this way each device sums its own shard.
    index, stride = jnp.zeros(rows.shape, jnp.uint32), 1
    for axis in reversed(range(rows.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, rows.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= rows.shape[axis]
    return jnp.stack(_weighted(jnp, rows, index))


_on_device = jax.jit(_device_sums)
_copy_on_device = jax.jit(lambda x: (jnp.copy(x), _device_sums(x)))
