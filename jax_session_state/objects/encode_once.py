"""``EncodeOnceKV``: conditioning K/V (text, image tokens), written once."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jax_session_state._core import _validation as v, _writes
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import allocator, refuse_now_if
from jax_session_state.errors import CapacityError
from jax_session_state.objects import _batch, _ring
from jax_session_state.objects._batch import BatchShape
from jax_session_state.objects.kv_views import KVChunk, KVView, read_chunk

__all__ = ["EncodeOnceKV"]

# Values of ``EncodeOnceKV.phase``.
_EMPTY, _STAGED, _WRITTEN = 0, 1, 2


class EncodeOnceKV(StateObject, kw_only=True):
    """Cross-attention K/V of the conditioning, computed once per session.

    The first commit writes it; **every later commit is a no-op** and so is
    staging once written, so a rollout step can commit the conditioning
    unconditionally and only the first call writes.  It is usually recomputed
    from a prompt embedding (``recompute_source="prompt"``) rather than kept
    when memory is short.  The view is a :class:`KVView` in append mode;
    attend to it with ``causal=False``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
      >>> cond = cond.commit((jnp.ones((1, 5, 2, 4)), jnp.ones((1, 5, 2, 4))))
      >>> cond = cond.commit((jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2, 4))))  # no-op
      >>> bool(cond.written), cond.view().lengths
      (True, Array([5], dtype=int32))
    """

    batch: BatchShape = struct.field(pytree_node=False)
    kv_heads: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)
    capacity: int = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)

    k: Array | None = None
    """``Float[Array, "batch_size kv_heads capacity head_dim"]``, the batch axes flattened."""
    v: Array | None = None
    """``Float[Array, "batch_size kv_heads capacity head_dim"]``, the batch axes flattened."""
    lengths: Array | None = None
    """``Int[Array, "batch"]`` conditioning tokens per row, written or staged
    (0 while there are none): what ``view()`` shows, so a step reads it as
    it is."""
    phase: Array | None = None
    """``Int[Array, ""]``: 0 nothing written, 1 staged, 2 written (later
    writes are no-ops); read it through :attr:`written`, :attr:`committed`
    and :attr:`staged`.  One scalar, so a commit updates it in one
    operation."""
    refused: Array | None = None
    """``Bool[Array, ""]`` a write with out-of-range counts, or more tokens
    than the capacity, was refused under jit; read it through
    :attr:`overflowed`."""

    can_overflow = True
    data_fields = ("k", "v")

    @property
    def written(self) -> Array | None:
        """``Bool[Array, ""]`` committed; later writes are no-ops."""
        return None if self.phase is None else self.phase == _WRITTEN

    @property
    def committed(self) -> Array | None:
        """``Int[Array, "batch"]`` conditioning tokens written per row (0 until the commit)."""
        return None if self.phase is None else jnp.where(self.phase == _WRITTEN, self.lengths, 0)

    @property
    def staged(self) -> Array | None:
        """``Int[Array, "batch"]`` conditioning tokens staged per row, not yet committed."""
        return None if self.phase is None else jnp.where(self.phase == _STAGED, self.lengths, 0)

    @property
    def overflowed(self) -> Array | None:
        """``Bool[Array, ""]`` a write was refused under jit."""
        return self.refused

    @classmethod
    @allocator()
    def allocate(cls, *, batch: BatchShape, kv_heads: int, head_dim: int, capacity: int | None = None,
                 dtype: Any = jnp.float32, **options: Any) -> EncodeOnceKV:
        """An empty, unwritten conditioning cache.

        Args:
          batch: batch rows, or a tuple of batch axes (``(B, P)``): payloads
            lead with them and the storage holds their rows flattened, as
            :meth:`KVCache.allocate <jax_session_state.KVCache.allocate>`.
          kv_heads: K/V heads.
          head_dim: size of each head.
          capacity: the most conditioning tokens per row.
          dtype: storage dtype; payloads must match it exactly.
          **options: how the object is managed
            (:class:`~jax_session_state.building_blocks.ManagedOptions`:
            ``recompute_source``, typically the prompt embedding,
            ``recompute_cost``, ``sharding``).  Its storage axes are
            ``("batch", "kv_heads", "capacity", "head_dim")`` for k and v and
            ``("batch",)`` for the lengths (``("batch", "batch_1")`` for the
            flattened axis of ``batch=(B, P)``).
        """
        owner = "EncodeOnceKV.allocate"
        capacity = v.required(owner, "capacity", capacity)
        sizes = {"batch": _batch.checked(owner, "batch", batch),
                 **v.positive_ints(owner, kv_heads=kv_heads, head_dim=head_dim, capacity=capacity)}
        return cls._allocated(options, **sizes, dtype=np.dtype(dtype))

    def storage_axes(self) -> dict[str, Any]:
        batch = _batch.logical_name("batch", self.batch)
        kv = (batch, "kv_heads", "capacity", "head_dim")
        return {"k": kv, "v": kv, "lengths": (batch,), "phase": (), "refused": ()}

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading axes of payloads and queries: ``(batch,)``, or ``batch`` when it is a tuple."""
        return _batch.shape_of(self.batch)

    def _empty_storage(self) -> dict[str, Any]:
        shape = (_batch.size_of(self.batch), self.kv_heads, self.capacity, self.head_dim)
        return {
            "k": jnp.zeros(shape, self.dtype),
            "v": jnp.zeros(shape, self.dtype),
            "lengths": jnp.zeros((_batch.size_of(self.batch),), jnp.int32),
            "phase": jnp.full((), _EMPTY, jnp.int32),
            "refused": jnp.zeros((), bool),
        }

    def _stage(self, payload: KVChunk | tuple[Array, ...], operation: str) -> tuple[EncodeOnceKV, Array]:
        """Stages the conditioning (replacing anything staged); a no-op once written.

        Args:
          payload: a :class:`KVChunk` or ``(k, v[, counts])`` with ``k, v:
            Float[Array, "*batch T kv_heads head_dim"]``; each row's count
            (``T`` without counts) at most ``capacity``, or the write is
            refused (:class:`CapacityError` at once outside jit).
          operation: the public method, for messages.
        """
        chunk, counts, bad_counts = read_chunk(self, payload, operation, batch=self.batch, subsets=False)
        T = chunk.k.shape[1]
        too_long = jnp.any(counts > self.capacity)  # rows past the capacity may be padding, not tokens
        refuse_now_if(
            too_long,
            lambda: CapacityError(
                f"{self.describe()}.{operation}: {np.asarray(counts).tolist()} conditioning tokens exceed "
                f"capacity {self.capacity}; nothing was written. Allocate more capacity."
            ),
        )
        refused = bad_counts | too_long
        skip = self.written | refused  # written: a no-op; refused: nothing written, flagged
        # Out-of-range slot indices make the scatter write nothing.
        slots = jnp.where(skip, self.capacity, jnp.arange(T, dtype=jnp.int32))
        new = self.with_storage(
            k=_write_tokens(self.k, slots, chunk.k),
            v=_write_tokens(self.v, slots, chunk.v),
            lengths=jnp.where(skip, self.lengths, counts),
            phase=jnp.where(skip, self.phase, _STAGED),
            refused=self.refused | refused,
        )
        return new, refused

    def _commit_staged(self, when: Array | bool = True) -> EncodeOnceKV:
        promoted = (self.phase == _STAGED) & when
        return self.with_storage(phase=jnp.where(promoted, _WRITTEN, self.phase))

    def discard(self) -> EncodeOnceKV:
        """Drops staged conditioning; written conditioning is never touched."""
        self._require_resident("discard")
        dropped = self.phase == _STAGED
        return self.with_storage(
            lengths=jnp.where(dropped, 0, self.lengths), phase=jnp.where(dropped, _EMPTY, self.phase)
        )

    def view(self, *, include_staged: bool = True) -> KVView:
        """The conditioning as a :class:`KVView` (empty until written or staged)."""
        self._require_resident("view")
        lengths = self.lengths if include_staged else jnp.where(self.written, self.lengths, 0)
        positions = _ring.slot_positions(self.capacity, lengths, sink=0, ring=None)
        return KVView(k=self.k, v=self.v, lengths=lengths, positions=positions, batch_shape=self.batch_shape)


def _write_tokens(cache: Array, slots: Array, rows: Array) -> Array:
    """``cache [B, kv_heads, capacity, D]`` with token ``t`` of ``rows [B, T, kv_heads, D]`` in slot ``slots[t]``.

    An out-of-range slot writes nothing (a no-op once written costs no more
    than its rows; a bfloat16 or float8 cache on CPU takes the native row
    writer of ``_writes``, which XLA:CPU would otherwise convert whole).
    """
    return _writes.write_rows(cache, slots, rows.transpose(0, 2, 1, 3), axis=2)
