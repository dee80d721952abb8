"""Fingerprints that let a restore refuse damaged array files instead of returning wrong data.

An array's fingerprint is two sums modulo 2**32 over its *rows* (the last axis;
a scalar is one row), where a row's value is the sum of the 32-bit words (or
the 16- or 8-bit values) of its elements: the plain sum of all rows, which any
one changed word changes, and the sum of the rows weighted by ``2 * i + 1``
for row ``i`` in row-major order, which rows moved to the wrong place change.
Both are linear, so they add up over the pieces of a sharded array and do not
depend on its sharding: a checkpoint saved on 8 devices checks on 1.

Arrays on the host or on CPU devices are summed with numpy over each distinct
shard, in place (a CPU shard's host view costs nothing); arrays on
accelerators are summed on their devices.  Both give the same numbers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fingerprint"]


def fingerprint(x: Any) -> list[int]:
    """The two sums of ``x`` (a jax array, a numpy array or a numpy scalar)."""
    if isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.sharding.device_set):
        return [int(v) for v in _on_device(x)]
    if isinstance(x, jax.Array):
        pieces = {_starts(shard.index, x.ndim): shard.data for shard in x.addressable_shards}  # one per replica set
    else:
        x = np.asarray(x)
        pieces = {(0,) * x.ndim: x}
    plain = weighted = 0
    for starts, data in pieces.items():
        rows = _host_rows(np.asarray(data))
        index = _row_index(np, rows.shape, x.shape[:-1], starts[:-1])
        plain += int(np.sum(rows, dtype=np.uint32))
        weighted += int(np.sum(rows * (index * 2 + 1), dtype=np.uint32))
    return [plain % 2**32, weighted % 2**32]


def _starts(index: tuple[slice, ...], ndim: int) -> tuple[int, ...]:
    return tuple(s.start or 0 for s in index) if index else (0,) * ndim


def _words_and_bits(dtype: np.dtype) -> tuple[Any, int]:
    """The unsigned type each element is read as, and how many of them make an element."""
    itemsize = np.dtype(dtype).itemsize
    return {1: (np.uint8, 1), 2: (np.uint16, 1)}.get(itemsize, (np.uint32, itemsize // 4))


def _host_rows(data: np.ndarray) -> np.ndarray:
    word, per_element = _words_and_bits(data.dtype)
    words = np.ascontiguousarray(data).reshape(-1).view(word).reshape(*data.shape, per_element)
    elements = words[..., 0] if per_element == 1 else np.sum(words, axis=-1, dtype=np.uint32)
    return np.sum(elements, axis=-1, dtype=np.uint32) if data.ndim else elements.astype(np.uint32)


def _row_index(xnp: Any, shape: tuple[int, ...], global_shape: tuple[int, ...], starts: tuple[int, ...]) -> Any:
    """Each row's row-major index in the whole array, from the piece's offset (modulo 2**32)."""
    index, stride = xnp.zeros(shape, xnp.uint32), 1
    for axis in reversed(range(len(shape))):
        position = xnp.arange(starts[axis], starts[axis] + shape[axis], dtype=xnp.uint32)
        index = index + position.reshape((-1,) + (1,) * (len(shape) - axis - 1)) * xnp.uint32(stride % 2**32)
        stride *= global_shape[axis]
    return index


@jax.jit
def _on_device(x: jax.Array) -> jax.Array:
    ndim = x.ndim
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)  # an element's words: real, then imaginary
    elif x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(x, _words_and_bits(x.dtype)[0]).astype(jnp.uint32)
    # A row sums its elements' words: the last axis (if any) and the word axis (8-byte elements).
    rows = jnp.sum(words, axis=tuple(range(max(ndim - 1, 0), words.ndim)), dtype=jnp.uint32)
    # Row indices from iotas: flattening a sharded array would move it between devices.
    index = _row_index(jnp, rows.shape, rows.shape, (0,) * rows.ndim)
    return jnp.stack([jnp.sum(rows, dtype=jnp.uint32), jnp.sum(rows * (index * 2 + 1), dtype=jnp.uint32)])
