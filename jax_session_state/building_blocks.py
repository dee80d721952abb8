"""Building blocks of a kind of state: its allocate path, its fill record and its write helpers.

What :class:`~jax_session_state.StateObject` kinds share, the library's and
yours (see the guide on writing your own): :func:`allocator` and
:class:`ManagedOptions` give every ``allocate`` the same keywords and the
same refusal of unknown ones; :class:`Fill` is what ``fill()`` reports;
:func:`overwrite`, :func:`update_slice_or_keep` and :func:`refuse_now_if`
write storage in place and refuse what does not fit.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from jax_session_state._core import _writes
from jax_session_state.errors import PayloadTypeError

if TYPE_CHECKING:
    from jax_session_state.sharding import ShardingRules

__all__ = [
    "Fill",
    "ManagedOptions",
    "allocator",
    "check_same_spec",
    "overwrite",
    "refuse_now_if",
    "update_slice_or_keep",
]

_MANAGED = ("recompute_source", "recompute_cost", "sharding")
# Static fields that say how an object is managed, not what it holds: not part of its spec.
_MANAGEMENT_FIELDS = (*_MANAGED, "demote_fn")


class ManagedOptions(TypedDict, total=False):
    """The keywords every ``allocate`` takes besides its sizes: how the object is managed.

    Attributes:
      recompute_source: the sibling object(s) this object can be recomputed
        from (a name or names); without one, a kind that cannot be dropped
        is never evictable.
      recompute_cost: estimated work to recompute it (any unit, compared
        across objects by the eviction planner).
      sharding: where the storage lives on a mesh
        (:class:`~jax_session_state.ShardingRules` over the logical axes of
        :meth:`StateObject.storage_axes`), or None for the default device.

    Example:
      >>> import jax_session_state as jss
      >>> cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4,
      ...                                  recompute_source="prompt", recompute_cost=2.0)
      >>> cond.recompute_source, cond.recompute_cost
      (('prompt',), 2.0)
    """

    recompute_source: str | tuple[str, ...]
    recompute_cost: float
    sharding: ShardingRules | None


class Fill(NamedTuple):
    """How full an object is, in one vocabulary for every kind (host values, for reports).

    Attributes:
      committed: entries committed (rows, tokens, items; a carry counts as
        one): an int, or a list with one count per batch row or slot.
      staged: entries staged after them, shaped like ``committed``.
      capacity: the most entries visible per row.
      margin: storage slots held beyond ``capacity`` for staged entries
        (a ring's staging margin), 0 where staging needs none.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> frames = jss.LatentBuffer.allocate(capacity=4, item_shape=(2,), ring=True, max_staged=2)
      >>> frames.append(jnp.ones((3, 2))).stage(jnp.ones(2)).fill()
      Fill(committed=3, staged=1, capacity=4, margin=2)
    """

    committed: int | list[int] | None
    staged: int | list[int] | None
    capacity: int
    margin: int = 0


def allocator() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wraps a kind's ``allocate`` so an unknown keyword is a ``TypeError`` before anything else.

    ``allocate`` takes its sizes by name and the :class:`ManagedOptions` in
    ``**options``.  Use it under ``@classmethod``.

    Example:
      >>> from jax_session_state.building_blocks import allocator
      >>> class Carry:
      ...     @classmethod
      ...     @allocator()
      ...     def allocate(cls, *, size, **options):
      ...         return cls()
      >>> try:
      ...     Carry.allocate(size=2, sise=3)
      ... except TypeError as error:
      ...     print(error)
      Carry.allocate() got unexpected keyword argument(s): sise; it takes recompute_cost,
      recompute_source, sharding, size.
    """

    def wrap(allocate: Callable[..., Any]) -> Callable[..., Any]:
        parameters = inspect.signature(allocate).parameters
        known = {name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        known |= set(_MANAGED)

        @functools.wraps(allocate)
        def checked(cls: type, **kwargs: Any) -> Any:
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise PayloadTypeError(
                    f"{cls.__name__}.allocate() got unexpected keyword argument(s): {', '.join(unknown)}; "
                    f"it takes {', '.join(sorted(known))}."
                )
            return allocate(cls, **kwargs)

        return checked

    return wrap


def overwrite(old: Any, new: Any) -> Any:
    """``new``, shaped and typed like ``old``, computed into ``old``'s buffers.

    ``jit`` prunes inputs a function never reads, and a pruned donated input
    cannot lend its buffer to the output.  A method that replaces a storage
    leaf wholesale (a flag reset, a new carry) goes through here so the old
    leaf stays an input and donation still aliases it.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax_session_state.building_blocks import overwrite
      >>> overwrite({"flag": jnp.zeros(2, jnp.int32)}, {"flag": jnp.ones(2)})  # keeps old's dtype
      {'flag': Array([1, 1], dtype=int32)}
    """
    return jax.tree_util.tree_map(_overwrite_leaf, old, new)


def _overwrite_leaf(old: Any, new: Any) -> Any:
    if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):  # typed keys: through their key data
        data = _overwrite_leaf(jax.random.key_data(old), jax.random.key_data(new))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
    return jnp.where(True, new, old).astype(old.dtype)


def refuse_now_if(refused: Any, error: Callable[[], Exception]) -> None:
    """Raises ``error()`` at once when ``refused`` is concretely True.

    Under ``jit`` (or ``vmap``) ``refused`` is traced; the caller records it
    in the object's ``overflowed`` flag instead and writes nothing.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_session_state.building_blocks import refuse_now_if
      >>> try:
      ...     refuse_now_if(jnp.array(5) > 4, lambda: ValueError("5 rows do not fit 4"))
      ... except ValueError as error:
      ...     print(error)
      5 rows do not fit 4
      >>> def write(n):
      ...     refuse_now_if(n > 4, lambda: ValueError("not raised: n is traced"))
      ...     return n > 4  # what the caller records in the overflowed flag
      >>> bool(jax.jit(write)(5))
      True
    """
    if not isinstance(refused, jax.core.Tracer) and bool(refused):
        raise error()


def check_same_spec(obj: Any, name: str, old: Any, new: Any) -> None:
    """Raises when ``new`` storage differs from ``old`` in structure, shape or dtype (nothing to check when None).

    Example:
      >>> import jax_session_state as jss
      >>> from jax_session_state.building_blocks import check_same_spec
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
      >>> check_same_spec(kv, "k", kv.k, kv.k + 1)  # same shape and dtype: nothing to say
      >>> try:
      ...     check_same_spec(kv, "k", kv.k, kv.k[:, :, :4])
      ... except jss.PayloadTypeError as error:
      ...     print(error)
      KVCache(...): a write changed storage 'k' from PyTreeDef(*) [float32[1, 1, 8, 2]] to
      PyTreeDef(*) [float32[1, 1, 4, 2]]; every write must keep structure, shapes and dtypes (a
      changed one compiles the step again and breaks donation).
    """
    if old is None:
        return
    old_leaves, old_tree = jax.tree_util.tree_flatten(old)
    new_leaves, new_tree = jax.tree_util.tree_flatten(new)
    same = old_tree == new_tree and all(
        jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
        for a, b in zip(old_leaves, new_leaves)
    )
    if not same:
        def spec(leaves: list[Any]) -> str:
            return ", ".join(f"{np.dtype(jnp.result_type(x)).name}{list(jnp.shape(x))}" for x in leaves)

        raise PayloadTypeError(
            f"{obj.describe()}: a write changed storage {name!r} from {old_tree} [{spec(old_leaves)}] to "
            f"{new_tree} [{spec(new_leaves)}]; every write must keep structure, shapes and dtypes "
            "(a changed one compiles the step again and breaks donation)."
        )


def update_slice_or_keep(buffer: jax.Array, update: jax.Array, start: Any, *, axis: int, lands: Any) -> jax.Array:
    """``buffer`` with ``update`` written in place at ``start`` along ``axis`` where ``lands``.

    One ``dynamic_update_slice``: where nothing lands (a refused write, rows
    past a short chunk) the window takes back what it held, so nothing
    outside the landing rows changes.  XLA fuses the read-back and the mask
    into the update, one operation where a scatter takes several.  A
    bfloat16 or float8 buffer on CPU, which XLA:CPU would convert whole, is
    written by the native row writer instead, where ``lands`` varies along
    ``axis`` only (``jax_session_state._core._writes``).

    Example:
      >>> import jax.numpy as jnp
      >>> from jax_session_state.building_blocks import update_slice_or_keep
      >>> lands = jnp.array([True, True, False])  # the third row of the chunk is past its end
      >>> update_slice_or_keep(jnp.zeros(6), jnp.ones(3), 2, axis=0, lands=lands)
      Array([0., 0., 1., 1., 0., 0.], dtype=float32)
    """
    def in_xla() -> jax.Array:
        kept = jax.lax.dynamic_slice_in_dim(buffer, start, update.shape[axis], axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(lands, update, kept), start, axis=axis)

    lands_shape = (1,) * (update.ndim - jnp.ndim(lands)) + jnp.shape(lands)
    off_axis = any(n != 1 for i, n in enumerate(lands_shape) if i != axis)  # then no slots can say where it lands
    if off_axis or not _writes.in_place_natively(buffer):
        return in_xla()
    T, size = update.shape[axis], buffer.shape[axis]
    first = jnp.clip(jnp.asarray(start).astype(jnp.int32), 0, size - T)  # clamped as XLA clamps the window
    slots = jnp.where(jnp.reshape(lands, (-1,)), first + jnp.arange(T, dtype=jnp.int32), size)  # size: dropped
    return _writes.write_rows(buffer, slots, update, axis=axis, otherwise=in_xla)
