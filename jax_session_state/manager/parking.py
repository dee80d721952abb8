"""Park a state object's storage in a host memory kind, and bring it back.

:func:`park` copies every array of an object to a host memory kind of the
same devices (``jax.device_put`` with the array's sharding carrying
``memory_kind="pinned_host"``), so the accounting moves its bytes from
``"cpu:0"`` to ``"cpu:0/pinned_host"`` (``"cuda:0"`` to
``"cuda:0/pinned_host"``).  :func:`restore` puts them back on their original
shardings — same devices, same memory kind, committed or not as they were,
bit for bit — so a jitted step sees exactly what it saw before: it neither
retraces nor compiles again.

A :class:`Parked` is deliberately not a pytree: a jitted step cannot take it
by accident (``jit`` rejects it), it must be restored first.

Example:
  >>> import jax_session_state as jss
  >>> from jax_session_state.manager import parking
  >>> carry = jss.FixedState.allocate(shapes=(2, 8))
  >>> carry.nbytes_by_device()
  {'cpu:0': 129}
  >>> parked = parking.park(carry)
  >>> parked.nbytes_by_device()
  {'cpu:0/pinned_host': 129}
  >>> parking.restore(parked).nbytes_by_device()
  {'cpu:0': 129}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import jax

from jax_session_state._core._placement import Placement, is_donated
from jax_session_state.accounting import SeenStorages
from jax_session_state.base import StateObject
from jax_session_state.errors import DonatedError, NotResidentError, PayloadError, PayloadTypeError

__all__ = ["Parked", "park", "restore"]

T = TypeVar("T", bound=StateObject)


@dataclasses.dataclass(frozen=True)
class Parked(Generic[T]):
    """A state object whose arrays sit in a host memory kind, and where they came from.

    Not a pytree, so no jitted step takes it by accident: :func:`restore` it.

    Attributes:
      obj: the object, its arrays in ``memory_kind`` of their devices.
      placement: where its arrays were before parking.
      memory_kind: the host memory kind holding them.

    Example:
      >>> import jax
      >>> import jax_session_state as jss
      >>> parked = jss.manager.parking.park(jss.FixedState.allocate(shapes=(2, 8)))
      >>> parked.memory_kind, parked.nbytes_by_device()
      ('pinned_host', {'cpu:0/pinned_host': 129})
      >>> try:
      ...     jax.jit(lambda state: state)(parked)  # restore() it first
      ... except TypeError as error:
      ...     print(type(error).__name__)
      TypeError
    """

    obj: T
    placement: Placement
    memory_kind: str

    def nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes held in host memory, by device key (``"cpu:0/pinned_host"``)."""
        return self.obj.nbytes_by_device(seen)


def park(obj: T, memory_kind: str = "pinned_host") -> Parked[T]:
    """Copies ``obj``'s arrays to ``memory_kind`` of their devices; waits until the copy is done.

    Args:
      obj: a resident state object whose arrays are alive.
      memory_kind: a memory kind every device of the object has (see
        ``device.addressable_memories()``).

    Returns:
      The :class:`Parked` object.  ``obj`` itself is untouched: its device
      memory is released when the last reference to it goes.

    Raises:
      PayloadTypeError: ``obj`` is not a state object.
      NotResidentError: ``obj`` holds no storage.
      DonatedError: some array of ``obj`` was deleted (donated); park the
        step's output instead.
      PayloadError: a device of ``obj`` has no ``memory_kind`` memory.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> parked = jss.manager.parking.park(kv.append((jnp.ones((1, 2, 1, 2)),) * 2))
      >>> parked.obj.k.sharding.memory_kind, parked.nbytes_by_device()
      ('pinned_host', {'cpu:0/pinned_host': 80})
    """
    if not isinstance(obj, StateObject):
        raise PayloadTypeError(
            f"park() takes a state object (a StateObject such as KVCache or FixedState); got "
            f"{type(obj).__qualname__}. Park each object of a session on its own."
        )
    if not obj.resident:
        raise NotResidentError(f"park() of {_name(obj)}, which is not resident: there is nothing to park.")
    if is_donated(obj):
        raise DonatedError(
            f"park() of {_name(obj)}, whose arrays were deleted (donated to a jitted step). "
            "Park the step's output instead."
        )
    placement = Placement.of(obj)
    for sharding in placement.shardings:
        for device in sharding.device_set if sharding is not None else ():
            kinds = [memory.kind for memory in device.addressable_memories()]
            if memory_kind not in kinds:
                raise PayloadError(
                    f"park() of {_name(obj)}: device {device} has no {memory_kind!r} memory; "
                    f"it has {kinds}. Pass one of those."
                )
    parked = placement.treedef.unflatten(
        leaf if s is None else jax.device_put(leaf, s.with_memory_kind(memory_kind))
        for leaf, s in zip(jax.tree_util.tree_leaves(obj), placement.shardings)
    )
    return Parked(jax.block_until_ready(parked), placement, memory_kind)


def restore(parked: Parked[T]) -> T:
    """The parked object back on its original shardings (devices, memory kind, committed or not), bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> kv = kv.append((jnp.arange(4.0).reshape(1, 2, 1, 2),) * 2)
      >>> back = jss.manager.parking.restore(jss.manager.parking.park(kv))
      >>> back.k.sharding.memory_kind, bool((back.view().k == kv.view().k).all())
      ('device', True)
    """
    return parked.placement.apply(parked.obj)


def _name(obj: Any) -> str:
    return obj.describe() if isinstance(obj, StateObject) else type(obj).__name__
