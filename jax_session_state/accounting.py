"""Byte accounting by device key, de-duplicated by storage.

A *device key* names where bytes live:

- ``"cpu:0"``, ``"cuda:0"``, ``"tpu:3"`` (``platform:id``) for a device's
  default memory;
- ``"cpu:0/pinned_host"`` for another memory kind of that device;
- ``"host"`` for numpy arrays (a view counts as the whole array it reads).

A sharded :class:`jax.Array` counts each addressable shard on its own device,
so a replicated array counts once on every device that holds it.  Storage is
de-duplicated by ``(device key, buffer pointer)`` through a caller-owned
:class:`SeenStorages`, so two references to one buffer count once — across the
objects of a session and across sessions.

:data:`HOST` is the key of numpy arrays; a :data:`Storage` is one buffer as
``(device key, buffer pointer, bytes)``.

Example:
  >>> import jax.numpy as jnp
  >>> from jax_session_state.accounting import SeenStorages, device_bytes
  >>> x = jnp.zeros((4, 4), jnp.float32)
  >>> seen = SeenStorages()
  >>> device_bytes(x, seen)
  {'cpu:0': 64}
  >>> device_bytes(x, seen)  # the same buffer again counts nothing
  {}
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jax_session_state.errors import PayloadTypeError

__all__ = [
    "HOST",
    "SeenStorages",
    "Storage",
    "add_bytes",
    "device_bytes",
    "device_key",
    "storages",
    "tree_bytes_by_device",
    "tree_storages",
]

HOST = "host"
"""Device key of numpy (host) arrays."""


class SeenStorages:
    """The set of storages already counted, keyed by (device key, pointer).

    Pass one instance through every ``nbytes_by_device`` call that should
    count a shared buffer once.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=8)
      >>> seen = jss.SeenStorages()
      >>> kv.nbytes_by_device(seen), kv.nbytes_by_device(seen)  # the second call finds nothing new
      ({'cpu:0': 272}, {})
      >>> len(seen)  # the cache's buffers, each recorded once
      3
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def add(self, key: str, pointer: int) -> bool:
        """Records a storage; returns True when it was not seen before."""
        entry = (key, pointer)
        if entry in self._seen:
            return False
        self._seen.add(entry)
        return True

    def __contains__(self, entry: object) -> bool:
        return entry in self._seen

    def __len__(self) -> int:
        return len(self._seen)


def _platform_name(device: jax.Device) -> str:
    # jax calls every NVIDIA/AMD device platform "gpu"; the client says which.
    if device.platform == "gpu":
        return getattr(device.client, "platform", "gpu")
    return device.platform


@functools.cache  # devices live as long as the process: a few keys, asked per buffer
def device_key(device: jax.Device, memory_kind: str | None = None) -> str:
    """The device key of ``device``'s ``memory_kind`` memory.

    Args:
      device: a jax device.
      memory_kind: a memory kind of that device, or None for its default.

    Returns:
      ``"platform:id"`` for the default memory kind, else
      ``"platform:id/memory_kind"``.

    Example:
      >>> import jax
      >>> from jax_session_state.accounting import device_key
      >>> cpu = jax.devices("cpu")[0]
      >>> device_key(cpu), device_key(cpu, "pinned_host")
      ('cpu:0', 'cpu:0/pinned_host')
    """
    base = f"{_platform_name(device)}:{device.id}"
    if memory_kind is None:
        return base
    try:
        default_kind = device.default_memory().kind
    except Exception:  # backends without memory kinds: one memory per device
        return base
    return base if memory_kind == default_kind else f"{base}/{memory_kind}"


def add_bytes(total: dict[str, int], more: Mapping[str, int]) -> dict[str, int]:
    """Adds ``more`` into ``total`` per key (in place) and returns ``total``.

    Example:
      >>> from jax_session_state.accounting import add_bytes
      >>> add_bytes({"cpu:0": 64}, {"cpu:0": 32, "host": 8})
      {'cpu:0': 96, 'host': 8}
    """
    for key, nbytes in more.items():
        total[key] = total.get(key, 0) + nbytes
    return total


Storage = tuple[str, int, int]
"""One buffer: ``(device key, buffer pointer, bytes)``."""


def storages(x: Any) -> list[Storage]:
    """The buffers ``x`` holds, one per addressable shard.

    Args:
      x: a :class:`jax.Array` (one storage per addressable shard, on its
        device and memory kind), a :class:`numpy.ndarray` (under ``"host"``;
        a view counts as the whole array it reads), or anything else (no
        storage).

    Returns:
      ``(device key, pointer, bytes)`` per buffer; none for a deleted (donated)
      array.

    Raises:
      PayloadTypeError: ``x`` is a tracer (inside ``jit`` there is no storage).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jax_session_state.accounting import storages
      >>> [(key, nbytes) for key, _, nbytes in storages(jnp.zeros(8))]
      [('cpu:0', 32)]
      >>> [(key, nbytes) for key, _, nbytes in storages(np.zeros(8))], storages(3.0)
      ([('host', 64)], [])
    """
    if isinstance(x, jax.core.Tracer):
        raise PayloadTypeError(
            "byte accounting counts the storage of concrete arrays; it got a traced "
            "value. Count bytes outside jit, on the step's inputs or outputs."
        )
    if isinstance(x, jax.Array):
        if x.is_deleted():  # donated away: it holds nothing any more
            return []
        memory_kind = getattr(x.sharding, "memory_kind", None)
        if len(x.sharding.device_set) == 1:  # one buffer: no shard objects to build
            (device,) = x.sharding.device_set
            return [(device_key(device, memory_kind), x.unsafe_buffer_pointer(), x.nbytes)]
        return [
            (device_key(shard.device, memory_kind), shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
            for shard in x.addressable_shards
        ]
    if isinstance(x, np.ndarray):
        owner = _owning_array(x)
        return [(HOST, owner.__array_interface__["data"][0], owner.nbytes)]
    return []


def _owning_array(x: np.ndarray) -> np.ndarray:
    """The array whose memory the view ``x`` reads (``x`` itself when it owns its memory).

    Views of one array (``a[:1]``, ``a[500:]``) all count as its whole
    storage, once: what they keep alive is the owner's memory, not the part
    they show.
    """
    while isinstance(x.base, np.ndarray):
        x = x.base
    return x


def tree_storages(tree: Any) -> list[Storage]:
    """:func:`storages` of every leaf of a pytree, in leaf order (repeats kept).

    Example:
      >>> import jax.numpy as jnp
      >>> from jax_session_state.accounting import tree_storages
      >>> x = jnp.zeros(4)
      >>> [(key, nbytes) for key, _, nbytes in tree_storages({"a": x, "b": x, "n": 1})]
      [('cpu:0', 16), ('cpu:0', 16)]
    """
    return [storage for leaf in jax.tree_util.tree_leaves(tree) for storage in storages(leaf)]


def _adder(seen: SeenStorages | set | None) -> Callable[[str, int], bool]:
    """``seen``'s "record this storage, True if new", for a :class:`SeenStorages` or a plain set of pairs."""
    if seen is None:
        seen = SeenStorages()
    if isinstance(seen, SeenStorages):
        return seen.add

    def add(key: str, pointer: int) -> bool:
        if (key, pointer) in seen:
            return False
        seen.add((key, pointer))
        return True

    return add


def device_bytes(x: Any, seen: SeenStorages | set | None = None) -> dict[str, int]:
    """Bytes of storage ``x`` holds, by device key, skipping storages in ``seen``.

    Args:
      x: a :class:`jax.Array` (each addressable shard counts on its device), a
        :class:`numpy.ndarray` (counts under ``"host"``; a view counts as the
        whole array it reads), or anything else (Python scalars, None: no
        storage).
      seen: storages already counted (a :class:`SeenStorages`, or a plain
        set of ``(device key, pointer)`` pairs); updated with those counted
        here.  None counts everything.

    Returns:
      A dict from device key to bytes; keys with nothing new are absent.

    Raises:
      PayloadTypeError: ``x`` is a tracer (inside ``jit`` there is no storage to count).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_session_state as jss
      >>> jss.device_bytes(jnp.zeros((2, 8))), jss.device_bytes(np.zeros(2)), jss.device_bytes(None)
      ({'cpu:0': 64}, {'host': 16}, {})
      >>> try:
      ...     jax.jit(jss.device_bytes)(jnp.zeros(2))
      ... except TypeError as error:
      ...     print(error)
      byte accounting counts the storage of concrete arrays; it got a traced value. Count bytes
      outside jit, on the step's inputs or outputs.
    """
    add = _adder(seen)
    out: dict[str, int] = {}
    for key, pointer, nbytes in storages(x):
        if add(key, pointer):
            out[key] = out.get(key, 0) + nbytes
    return out


def tree_bytes_by_device(
    tree: Any, seen: SeenStorages | set | None = None
) -> dict[str, int]:
    """Sums :func:`device_bytes` over the leaves of a pytree.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jax_session_state.accounting import tree_bytes_by_device
      >>> x = jnp.zeros(4)
      >>> tree_bytes_by_device({"a": x, "same": x, "host": np.zeros(2)})  # x counts once
      {'cpu:0': 16, 'host': 16}
    """
    if seen is None:
        seen = SeenStorages()
    total: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        add_bytes(total, device_bytes(leaf, seen))
    return total
