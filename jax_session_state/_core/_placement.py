"""Where an object's arrays live, and putting them there: the placement helpers below the manager.

:class:`Placement` records each array's sharding and whether it is committed
(what JAX compiles a jitted step for), :func:`place` puts one array back
there, :func:`runtime_owned` gives an array in buffers the runtime owns (so a
donated step reuses them) and :func:`is_donated` says whether a pytree lost
arrays to a donated step.  The manager parks and restores objects with them,
and a checkpoint restore places what it reads with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import numpy as np

from jax_session_state._core import _library
from jax_session_state.errors import PayloadError

__all__ = ["Placement", "is_donated", "place", "runtime_owned"]

T = TypeVar("T")


def is_donated(tree: Any) -> bool:
    """Whether any array of ``tree`` was deleted (donated to a jitted step, or deleted by hand).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_session_state._core._placement import is_donated
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
      >>> from jax_session_state._core._placement import Placement
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
                f"{self.treedef}, got {treedef}. Allocate it with the same spec as the original."
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
      >>> from jax_session_state._core._placement import place
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
      >>> from jax_session_state._core._placement import runtime_owned
      >>> x = jnp.arange(4.0) + 1
      >>> at = x.unsafe_buffer_pointer()
      >>> runtime_owned(x).unsafe_buffer_pointer() == at  # owned already: not copied
      True
    """
    if x.sharding.memory_kind not in (None, "device"):
        return x
    return _identity_donated(x)


def _name(obj: Any) -> str:
    describe = getattr(obj, "describe", None)
    return describe() if callable(describe) else type(obj).__name__
