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
  >>> from jax_session_state.manager import offload
  >>> carry = jss.FixedState.allocate(shapes=(2, 8))
  >>> carry.nbytes_by_device()
  {'cpu:0': 129}
  >>> parked = offload.park(carry)
  >>> parked.nbytes_by_device()
  {'cpu:0/pinned_host': 129}
  >>> offload.restore(parked).nbytes_by_device()
  {'cpu:0': 129}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from jax_session_state._core import _library
from jax_session_state.accounting import SeenStorages
from jax_session_state.base import StateObject
from jax_session_state.errors import DonatedError, NotResidentError, PayloadError, PayloadTypeError

__all__ = ["Parked", "Placement", "is_donated", "park", "place", "restore"]

T = TypeVar("T", bound=StateObject)


def is_donated(tree: Any) -> bool:
    """Whether any array of ``tree`` was deleted (donated to a jitted step, or deleted by hand).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_session_state.manager.offload import is_donated
      >>> x = jnp.ones(4)
      >>> y = jax.jit(lambda x: x + 1, donate_argnums=0)(x)
      >>> is_donated({"x": x}), is_donated({"y": y})
      (True, False)
    """
    return any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each array of an object lives: its pytree structure, each leaf's sharding and commitment.

    JAX compiles a jitted function once per placement of its arguments, and
    whether an array is *committed* to its device is part of that: an array
    made by ``jnp`` ops on the default device is not, one ``device_put`` on a
    sharding is.  A placement records both, so :meth:`apply` gives back
    arrays a jitted step takes without compiling again.

    Attributes:
      treedef: the object's pytree structure (its static spec included).
      shardings: one :class:`jax.sharding.Sharding` per leaf; None for leaves
        that are not jax arrays (they are left as they are).
      committed: per leaf, whether the array was committed to its sharding.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.manager.offload import Placement
      >>> carry = jss.FixedState.allocate(shapes=(2,))
      >>> placement = Placement.of(carry)
      >>> placement.committed  # made by jnp ops on the default device
      (False, False, False)
      >>> moved = jax.device_put(carry, jax.devices()[0])  # a transfer commits it
      >>> Placement.of(placement.apply(moved)) == placement
      True
    """

    treedef: jax.tree_util.PyTreeDef
    shardings: tuple[jax.sharding.Sharding | None, ...]
    committed: tuple[bool, ...]

    @classmethod
    def of(cls, obj: Any) -> Placement:
        """The placement of ``obj``'s arrays now."""
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        arrays = [leaf if isinstance(leaf, jax.Array) else None for leaf in leaves]
        return cls(
            treedef,
            tuple(None if x is None else x.sharding for x in arrays),
            tuple(x is None or x.committed for x in arrays),
        )

    def apply(self, obj: T) -> T:
        """``obj`` with every array put on its sharding here, committed as it was (a no-op where it is so).

        Raises:
          PayloadError: ``obj`` has another structure or spec than the object
            this placement was taken from.
        """
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        if treedef != self.treedef:
            raise PayloadError(
                f"cannot place {_name(obj)} where an object of another structure was: expected "
                f"{self.treedef}, got {treedef}. Rebuild it with the same spec as the original."
            )
        placed = [place(x, s, committed=c) for x, s, c in zip(leaves, self.shardings, self.committed)]
        return jax.tree_util.tree_unflatten(treedef, placed)


def place(x: Any, sharding: jax.sharding.Sharding | None, *, committed: bool) -> Any:
    """``x`` on ``sharding``, committed to it or not (None: ``x`` as it is).

    On CPU an uncommitted placement lands in buffers the runtime owns (a
    donated step reuses them); from 2 MiB on, the native library makes that
    one copy and asks Linux for huge pages first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_session_state.manager.offload import place
      >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      >>> [place(jnp.ones(2), sharding, committed=c).committed for c in (True, False)]
      [True, False]
    """
    if sharding is None:
        return x
    if committed:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.committed and x.sharding == sharding:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = place(jax.random.key_data(x), sharding, committed=False)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    # Only uncommitted arrays on one device exist, and only a transfer from the host makes one:
    # jax.device_put onto a device or sharding commits what it returns.
    (device,) = sharding.device_set
    data = np.asarray(x)
    with jax.default_device(device):
        if device.platform != "cpu":
            return jax.device_put(data)
        if _library.AVAILABLE and data.nbytes >= _HUGE_PAGE:  # wrapped where it lies, copied once onto huge pages
            return _library.owned_copy(jax.device_put(_aligned(data)))
        return runtime_owned(jax.device_put(data))


_ALIGNMENT = 64
"""The alignment at which XLA:CPU wraps a host array instead of copying it."""

_HUGE_PAGE = 2 << 20
"""Arrays from this size on are placed on CPU by the native library's copy (:func:`_library.owned_copy`)."""


def _aligned(data: np.ndarray) -> np.ndarray:
    """``data``, or a copy of it, C-contiguous at an address XLA:CPU wraps without copying."""
    if data.flags.c_contiguous and data.ctypes.data % _ALIGNMENT == 0:
        return data
    raw = np.empty(data.nbytes + _ALIGNMENT, np.uint8)  # numpy asks for huge pages for large arrays itself
    start = -raw.ctypes.data % _ALIGNMENT
    aligned = raw[start : start + data.nbytes].view(data.dtype).reshape(data.shape)
    np.copyto(aligned, data)
    return aligned


_identity_donated = jax.jit(lambda x: x, donate_argnums=0)


def runtime_owned(x: jax.Array) -> jax.Array:
    """``x`` in buffers the runtime owns, so that a donated step reuses them; ``x`` is consumed.

    On CPU, ``jax.device_put`` of a suitably aligned host buffer wraps it
    without copying (Orbax's reads return such shards, by chance of
    alignment), and a donated step cannot reuse a wrapped buffer: it copies
    the whole array.  Donating ``x`` to an identity keeps every shard the
    runtime owns where it is and copies only the wrapped ones; where ``x`` is
    placed, and whether it is committed, stay.  An array in a host memory
    kind (``pinned_host``, as parked arrays are) is returned as it is: XLA
    runs no donated step over host memory (on CPU it aborts the process).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_session_state.manager.offload import runtime_owned
      >>> x = jnp.arange(4.0) + 1
      >>> at = x.unsafe_buffer_pointer()
      >>> runtime_owned(x).unsafe_buffer_pointer() == at  # owned already: not copied
      True
    """
    if x.sharding.memory_kind not in (None, "device"):
        return x
    return _identity_donated(x)


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
      >>> parked = jss.manager.offload.park(jss.FixedState.allocate(shapes=(2, 8)))
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
      >>> parked = jss.manager.offload.park(kv.append((jnp.ones((1, 2, 1, 2)),) * 2))
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
      >>> back = jss.manager.offload.restore(jss.manager.offload.park(kv))
      >>> back.k.sharding.memory_kind, bool((back.view().k == kv.view().k).all())
      ('device', True)
    """
    return parked.placement.apply(parked.obj)


def _name(obj: Any) -> str:
    return obj.describe() if isinstance(obj, StateObject) else type(obj).__name__
