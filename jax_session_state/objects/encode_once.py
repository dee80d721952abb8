"""``EncodeOnceKV``: conditioning K/V (text, image tokens), written once."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jax_session_state import _validation as v
from jax_session_state.base import StateObject
from jax_session_state.objects import _ring
from jax_session_state.objects.kv import KVChunk, KVView
from jax_session_state.sharding import ShardingRules

__all__ = ["EncodeOnceKV"]

# Values of ``EncodeOnceKV.phase``.
_EMPTY, _STAGED, _WRITTEN = 0, 1, 2


class EncodeOnceKV(StateObject, kw_only=True):
    """Cross-attention K/V of the conditioning, computed once per session.

    The first commit writes it; **every later commit is a no-op** and so is
    staging once written, so a rollout step can commit the conditioning
    unconditionally and only the first call writes.  It is usually rebuilt
    from a prompt embedding (``recompute_source="prompt"``) rather than kept
    when memory is short.  The view is a :class:`KVView` in append mode;
    attend to it with ``causal=False``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=2, head_dim=4, length=8)
      >>> cond = cond.commit((jnp.ones((1, 5, 2, 4)), jnp.ones((1, 5, 2, 4))))
      >>> cond = cond.commit((jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2, 4))))  # no-op
      >>> bool(cond.written), cond.view().lengths
      (True, Array([5], dtype=int32))
    """

    batch: int = struct.field(pytree_node=False)
    kv_heads: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)
    length: int = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)

    k: Array | None = None
    """``Float[Array, "batch kv_heads length head_dim"]``."""
    v: Array | None = None
    """``Float[Array, "batch kv_heads length head_dim"]``."""
    lengths: Array | None = None
    """``Int[Array, "batch"]`` conditioning tokens per row, written or staged
    (0 while there are none): what ``view()`` shows, so a step reads it as
    it is."""
    phase: Array | None = None
    """``Int[Array, ""]``: 0 nothing written, 1 staged, 2 written (later
    writes are no-ops); read it through :attr:`written` and :attr:`staged`.
    One scalar, so a commit updates it in one operation."""
    overflowed: Array | None = None
    """``Bool[Array, ""]`` a write with out-of-range counts was refused under jit."""

    can_overflow = True

    @property
    def written(self) -> Array | None:
        """``Bool[Array, ""]`` committed; later writes are no-ops."""
        return None if self.phase is None else self.phase == _WRITTEN

    @property
    def staged(self) -> Array | None:
        """``Bool[Array, ""]`` holds staged, uncommitted conditioning."""
        return None if self.phase is None else self.phase == _STAGED

    @classmethod
    def allocate(
        cls,
        *,
        batch: int,
        kv_heads: int,
        head_dim: int,
        length: int,
        dtype: Any = jnp.float32,
        recompute_source: str | tuple[str, ...] = (),
        recompute_cost: float = 0.0,
        sharding: ShardingRules | None = None,
    ) -> EncodeOnceKV:
        """An empty, unwritten conditioning cache.

        Args:
          batch: batch rows.
          kv_heads: K/V heads.
          head_dim: size of each head.
          length: the most conditioning tokens per row.
          dtype: storage dtype; payloads must match it exactly.
          recompute_source: sibling object(s) it is rebuilt from.
          recompute_cost: estimated work to rebuild it.
          sharding: where the storage lives on a mesh (see
            :mod:`jax_session_state.sharding`), or None for the default device.
            Its storage axes are ``("batch", "kv_heads", "length",
            "head_dim")`` for k and v and ``("batch",)`` for the lengths.
        """
        owner = "EncodeOnceKV.allocate"
        spec = cls(
            batch=v.positive_int(owner, "batch", batch),
            kv_heads=v.positive_int(owner, "kv_heads", kv_heads),
            head_dim=v.positive_int(owner, "head_dim", head_dim),
            length=v.positive_int(owner, "length", length),
            dtype=np.dtype(dtype),
            recompute_source=v.source_names(owner, recompute_source),
            recompute_cost=float(recompute_cost),
            sharding=v.sharding_rules(owner, sharding),
        )
        return spec.empty()

    def storage_axes(self) -> dict[str, Any]:
        kv = ("batch", "kv_heads", "length", "head_dim")
        return {"k": kv, "v": kv, "lengths": ("batch",), "phase": (), "overflowed": ()}

    def _empty_storage(self) -> dict[str, Any]:
        shape = (self.batch, self.kv_heads, self.length, self.head_dim)
        return {
            "k": jnp.zeros(shape, self.dtype),
            "v": jnp.zeros(shape, self.dtype),
            "lengths": jnp.zeros((self.batch,), jnp.int32),
            "phase": jnp.full((), _EMPTY, jnp.int32),
            "overflowed": jnp.zeros((), bool),
        }

    def _stage(self, payload: KVChunk | tuple[Array, ...], operation: str) -> tuple[EncodeOnceKV, Array]:
        """Stages the conditioning (replacing anything staged); a no-op once written.

        Args:
          payload: a :class:`KVChunk` or ``(k, v[, counts])`` with ``k, v:
            Float[Array, "batch T kv_heads head_dim"]``, ``T <= length``.
          operation: the public method, for messages.
        """
        owner = f"{self.describe()}.{operation}"
        if not isinstance(payload, tuple) or len(payload) not in (2, 3):
            raise TypeError(f"{owner}: payload must be a KVChunk(k, v[, counts]); got {type(payload).__name__}.")
        chunk = KVChunk(*payload)
        sizes: dict[str, int] = {}
        pattern = (self.batch, "T", self.kv_heads, self.head_dim)
        v.check_array(chunk.k, owner=owner, what="k", shape=pattern, dtype=self.dtype, sizes=sizes)
        v.check_array(chunk.v, owner=owner, what="v", shape=pattern, dtype=self.dtype, sizes=sizes)
        T = sizes["T"]
        if T > self.length:
            raise ValueError(f"{owner}: {T} conditioning tokens exceed length {self.length}.")
        if chunk.counts is None:
            counts = jnp.full((self.batch,), T, jnp.int32)
        else:
            v.check_array(chunk.counts, owner=owner, what="counts", shape=(self.batch,), dtype=jnp.int32)
            counts = chunk.counts
        refused = jnp.any((counts < 0) | (counts > T))
        self._refuse_now_if(
            refused, lambda: ValueError(f"{owner}: counts must lie in [0, {T}]; got {np.asarray(counts).tolist()}.")
        )
        skip = self.written | refused  # written: a no-op; refused: nothing written, flagged
        # Out-of-range slot indices make the scatter write nothing.
        slots = jnp.where(skip, self.length, jnp.arange(T, dtype=jnp.int32))
        new = self.with_storage(
            k=self.k.at[:, :, slots].set(chunk.k.transpose(0, 2, 1, 3), mode="drop"),
            v=self.v.at[:, :, slots].set(chunk.v.transpose(0, 2, 1, 3), mode="drop"),
            lengths=jnp.where(skip, self.lengths, counts),
            phase=jnp.where(skip, self.phase, _STAGED),
            overflowed=self.overflowed | refused,
        )
        return new, refused

    def _commit_staged(self, when: Array | bool = True) -> EncodeOnceKV:
        promoted = self.staged & when
        return self.with_storage(phase=jnp.where(promoted, _WRITTEN, self.phase))

    def discard(self) -> EncodeOnceKV:
        """Drops staged conditioning; written conditioning is never touched."""
        self._require_resident("discard")
        dropped = self.staged
        return self.with_storage(
            lengths=jnp.where(dropped, 0, self.lengths), phase=jnp.where(dropped, _EMPTY, self.phase)
        )

    def holds_staged(self) -> Array:
        return self.staged if self.resident else jnp.zeros((), bool)

    def fill(self) -> dict[str, Any]:
        if not self.resident:
            return {"committed": None, "staged": None, "capacity": self.length}
        lengths = self.lengths.tolist()
        written, staged = bool(self.written), bool(self.staged)
        return {
            "committed": lengths if written else 0,
            "staged": lengths if staged else 0,
            "capacity": self.length,
        }

    def view(self, *, include_staged: bool = True) -> KVView:
        """The conditioning as a :class:`KVView` (empty until written or staged)."""
        self._require_resident("view")
        lengths = self.lengths if include_staged else jnp.where(self.written, self.lengths, 0)
        positions = _ring.slot_positions(self.length, lengths, sink=0, ring=None)
        return KVView(k=self.k, v=self.v, lengths=lengths, positions=positions)
