"""``KVCache``: growing self-attention K/V, append mode or a sink + window ring."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jax_session_state._core import _validation as v, _writes
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import allocator, refuse_now_if, update_slice_or_keep
from jax_session_state.errors import CapacityError, PayloadTypeError
from jax_session_state.objects import _batch, _frames, _quantize, _ring
from jax_session_state.objects._batch import BatchShape
from jax_session_state.objects.kv_views import BranchKVView, KVChunk, KVView, read_chunk

__all__ = ["BranchKVView", "KVCache", "KVChunk", "KVView"]

# Rows of ``KVCache.bookkeeping``.
_COMMITTED, _STAGED, _HIGH_WATER, _REFUSED = range(4)


class KVCache(StateObject, kw_only=True):
    """Self-attention K/V that grows by appends, per-row (ragged) lengths.

    Two modes:

    - append mode (``window=None``): ``capacity`` rows per batch row; a write
      past capacity writes nothing and is a :class:`CapacityError` (raised at
      once eagerly; under ``jit`` the ``overflowed`` flag is set and
      :func:`jax_session_state.check` raises).
    - ring mode (``window=W, sink=S, max_staged=C``): the first ``S`` tokens
      are kept for ever and the last ``W`` in a ring of ``W + C`` slots, so a
      chunk of up to ``C`` rows, staged or appended, never overwrites the
      window its own queries attend to, and ``discard()`` restores the
      committed view exactly.  Staging more than ``C`` rows at once
      is a :class:`CapacityError`; ``append`` (and ``commit(payload)``)
      takes a chunk of any length, a prefill: the ring keeps its sinks
      (from the chunk's first rows) and its last rows, as appending it in
      chunks of ``C`` would, in one in-place write.  ``view(include_staged=False)`` shows the
      sinks and the last ``W`` committed tokens (what later queries need);
      ``view()`` shows every token still held, so attention right after an
      ``append`` of a chunk of at most ``C`` rows sees each of its queries'
      whole window (a longer prefill's own queries attend it before it is
      written).
      ``capacity`` is ``S + W`` (what stays visible) and the storage holds
      ``slots = S + W + C`` rows per batch row.

    Frames (``frame=N``): the cache's queries come in frames of ``N``
    tokens aligned to absolute positions, each seeing its whole frame and
    everything before it (block-causal); its views carry ``N`` and
    :func:`~jax_session_state.attend` applies that mask without being told.
    A ring may then be sized in frames as Self-Forcing sizes its rolling
    cache: ``window_frames=L, sink_frames=S`` keeps the first ``S`` frames
    and shows each frame the last ``L - S`` frames including its own, so
    ``L`` counts the sink frames and the current frame (``window = (L - S)
    * N`` and ``sink = S * N`` tokens; ``max_staged`` defaults to ``N``).

    Quantized storage (``quantize="int8"`` or ``"fp8"``): each written row of
    each head is stored as int8 (or ``float8_e4m3fn``) values and one float32
    scale, symmetric (``x ~= q * scale``, ``scale = max|x| / 127``): a
    quarter of the bytes plus 4 bytes per row and head.  Payloads stay in
    ``dtype``; ``append`` quantizes the rows it writes, and attention
    dequantizes block by block.  Each value is within half a step,
    ``max|row| / 254``, of what was written (fp8: ``2**-4`` relative or
    ``max|row| / (448 * 2**10)`` absolute, whichever is larger: entries
    below ``max|row| * 2**-6 / 448`` are float8 subnormals).  A cache that
    declares ``tiers=("int8",)`` may be demoted to that form (:meth:`demote`)
    when memory is short.

    Batch axes (``batch=(B, P)``, an axial model's batch of spatial
    positions): payloads, counts and queries lead with ``[B, P]`` and the
    storage holds the ``B * P`` rows flattened, so reads and writes reuse
    the one-axis paths with no copy.  A :class:`KVChunk` with ``rows=``
    writes some rows only (their payload alone, scattered in place).

    Staging is in-buffer: ``stage`` writes rows past the committed length,
    ``commit()`` advances the length and ``discard()`` forgets the staged
    count, both O(1).  Under ``jit`` with the cache donated every write is in
    place and costs what it writes.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=2, kv_heads=4, head_dim=8, capacity=64)
      >>> rows = jnp.ones((2, 16, 4, 8))
      >>> kv = kv.append(jss.KVChunk(rows, rows, counts=jnp.array([16, 5])))
      >>> kv.view().lengths
      Array([16,  5], dtype=int32)
    """

    batch: BatchShape = struct.field(pytree_node=False)
    kv_heads: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)
    capacity: int = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)
    sink: int = struct.field(pytree_node=False, default=0)
    max_staged: int = struct.field(pytree_node=False, default=0)
    frame: int | None = struct.field(pytree_node=False, default=None)
    quantize: str | None = struct.field(pytree_node=False, default=None)
    tiers: tuple[str, ...] = struct.field(pytree_node=False, default=())

    k: Array | None = None
    """``Float[Array, "batch_size kv_heads slots head_dim"]`` (int8 / fp8 values when quantized); the batch
    axes flattened."""
    v: Array | None = None
    """``Float[Array, "batch_size kv_heads slots head_dim"]`` (int8 / fp8 values when quantized)."""
    k_scale: Array | None = None
    """``Float[Array, "batch_size kv_heads slots 1"]`` the scale of each row of ``k`` when quantized, else None."""
    v_scale: Array | None = None
    """``Float[Array, "batch_size kv_heads slots 1"]`` the scale of each row of ``v`` when quantized, else None."""
    bookkeeping: Array | None = None
    """``Int[Array, "4 batch_size"]``, per (flat) batch row: committed tokens, staged
    tokens after them, the high-water mark (one past the largest position
    ever written; a ring slot holds the largest position below it that maps
    to the slot) and the writes refused under jit (the same in every row).
    One array, so a step updates all of it in one operation; read it
    through :attr:`committed`, :attr:`staged`,
    :attr:`high_water` and :attr:`overflowed`."""

    can_overflow = True
    data_fields = ("k", "v")

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading axes of payloads and queries: ``(batch,)``, or ``batch`` when it is a tuple."""
        return _batch.shape_of(self.batch)

    @property
    def batch_size(self) -> int:
        """Rows of storage: the product of :attr:`batch_shape` (the flattened batch axes)."""
        return _batch.size_of(self.batch)

    @property
    def committed(self) -> Array | None:
        """``Int[Array, "batch_size"]`` committed tokens per (flat) row."""
        return self._counter(_COMMITTED)

    @property
    def staged(self) -> Array | None:
        """``Int[Array, "batch_size"]`` staged tokens per (flat) row, after the committed ones."""
        return self._counter(_STAGED)

    @property
    def high_water(self) -> Array | None:
        """``Int[Array, "batch_size"]`` one past the largest position ever written."""
        return self._counter(_HIGH_WATER)

    @property
    def overflowed(self) -> Array | None:
        """``Bool[Array, ""]`` a write was refused under jit."""
        return None if self.bookkeeping is None else self.bookkeeping[..., _REFUSED, 0] > 0

    def _counter(self, row: int) -> Array | None:
        return None if self.bookkeeping is None else self.bookkeeping[..., row, :]

    @property
    def staging_margin(self) -> int:
        """Ring mode: the ``max_staged`` slots beyond the visible ``capacity``; 0 in append mode."""
        return self.max_staged

    @property
    def slots(self) -> int:
        """Rows of storage per batch row: ``capacity`` plus the staging margin."""
        return self.capacity + self.max_staged


    def _with_bookkeeping(self, *, committed: Array, staged: Array, high_water: Array, refused: Array,
                          **storage: Array) -> KVCache:
        rows = [committed, staged, high_water, jnp.broadcast_to(refused, committed.shape)]
        return self.with_storage(bookkeeping=jnp.stack(rows, axis=-2).astype(jnp.int32), **storage)

    @classmethod
    @allocator()
    def allocate(
        cls,
        *,
        batch: BatchShape,
        kv_heads: int,
        head_dim: int,
        capacity: int | None = None,
        dtype: Any = jnp.float32,
        window: int | None = None,
        sink: int = 0,
        max_staged: int | None = None,
        frame: int | None = None,
        window_frames: int | None = None,
        sink_frames: int = 0,
        quantize: str | None = None,
        tiers: tuple[str, ...] = (),
        **options: Any,
    ) -> KVCache:
        """An empty cache.

        Args:
          batch: batch rows, or a tuple of batch axes (``(B, P)``: an axial
            model's batch of spatial positions, each with its own
            sequence).  Payloads, counts and queries then lead with these
            axes (``[B, P, T, kv_heads, head_dim]``); the storage holds
            their ``B * P`` rows flattened, so nothing is copied or
            transposed to write or read them.
          kv_heads: K/V heads.
          head_dim: size of each head.
          capacity: rows per batch row in append mode (in ring mode it is
            ``sink + window``, derived).
          dtype: storage dtype; payloads must match it exactly.
          window: ring mode: the last ``window`` tokens are kept.
          sink: ring mode: the first ``sink`` tokens are kept for ever.
          max_staged: ring mode: the most rows staged or appended between
            commits; the ring keeps this many slots beyond the window; with
            ``frame``, default one frame.
          frame: tokens per frame: queries come in block-causal frames of
            this many tokens (see the class docstring); views carry it.
          window_frames: ring mode in frames (needs ``frame``, replaces
            ``window`` and ``sink``): the frames each frame sees, counting
            the sink frames and itself, as Self-Forcing's
            ``local_attn_size``.
          sink_frames: the first frames kept for ever, as Self-Forcing's
            ``sink_size``; fewer than ``window_frames``.
          quantize: store the rows quantized: ``"int8"`` or ``"fp8"``
            (``float8_e4m3fn``); ``dtype`` stays the payloads' dtype.
          tiers: the quantized forms it may be demoted to when memory is
            short (``("int8",)``), highest precision first.
          **options: how the object is managed
            (:class:`~jax_session_state.building_blocks.ManagedOptions`:
            ``recompute_source``, ``recompute_cost``, ``sharding``).  Its
            storage axes are ``("batch", "kv_heads", "capacity",
            "head_dim")`` for k and v and ``(None, "batch")`` for the
            bookkeeping; with batch axes ``(B, P)`` the flattened axis is
            named ``("batch", "batch_1")``, each axis its own logical name.

        Returns:
          An empty, resident cache.

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> kv = jss.KVCache.allocate(batch=(2, 3), kv_heads=1, head_dim=4, capacity=8)
          >>> kv = kv.append((jnp.ones((2, 3, 5, 1, 4)),) * 2)  # [B, P, T, kv_heads, head_dim]
          >>> kv.k.shape, kv.view().lengths.shape  # stored flattened: no copy to read it
          ((6, 1, 8, 4), (6,))
        """
        owner = "KVCache.allocate"
        heads = {"batch": _batch.checked(owner, "batch", batch),
                 **v.positive_ints(owner, kv_heads=kv_heads, head_dim=head_dim)}
        frame = None if frame is None else v.positive_int(owner, "frame", frame)
        window, sink, max_staged = _frames.ring_in_tokens(owner, frame, window_frames, sink_frames, window, sink,
                                                          max_staged)
        if window is None:
            if sink or max_staged is not None:
                raise PayloadTypeError(f"{owner}: sink= and max_staged= apply only to ring mode (window=...).")
            if capacity is None:
                raise PayloadTypeError(f"{owner}: append mode needs capacity=... (or window= for ring mode).")
            capacity = v.positive_int(owner, "capacity", capacity)
            max_staged = 0
        else:
            window = v.positive_int(owner, "window", window)
            sink = v.positive_int(owner, "sink", sink, minimum=0)
            if max_staged is None:
                raise PayloadTypeError(
                    f"{owner}: ring mode needs max_staged=..., the most rows staged or "
                    "appended between commits (the ring keeps that many extra slots)."
                )
            max_staged = v.positive_int(owner, "max_staged", max_staged)
            if capacity is not None:
                raise PayloadTypeError(f"{owner}: in ring mode capacity is sink + window; do not pass it.")
            capacity = sink + window
        dtype = np.dtype(dtype)
        quantize, tiers = _quantize.check_args(owner, dtype, quantize, tiers)
        return cls._allocated(
            options, **heads, capacity=capacity, dtype=dtype, window=window, sink=sink, max_staged=max_staged,
            frame=frame, quantize=quantize, tiers=tiers,
        )

    def storage_axes(self) -> dict[str, Any]:
        batch = _batch.logical_name("batch", self.batch)
        kv = (batch, "kv_heads", "capacity", "head_dim")
        scale = (batch, "kv_heads", "capacity", None) if self.quantize else None
        return {"k": kv, "v": kv, "k_scale": scale, "v_scale": scale, "bookkeeping": (None, batch)}

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of ``k`` and ``v``: ``dtype``, or the quantized format's."""
        return self.dtype if self.quantize is None else _quantize.storage_dtype(self.quantize)

    def _empty_storage(self) -> dict[str, Any]:
        shape = (self.batch_size, self.kv_heads, self.slots, self.head_dim)
        scale = jnp.ones((*shape[:-1], 1), jnp.float32) if self.quantize else None
        return {
            "k": jnp.zeros(shape, self.storage_dtype),
            "v": jnp.zeros(shape, self.storage_dtype),
            "k_scale": scale,
            "v_scale": None if scale is None else jnp.ones_like(scale),
            "bookkeeping": jnp.zeros((4, self.batch_size), jnp.int32),
        }

    @property
    def ring_slots(self) -> int | None:
        """Slots of the ring after the sinks, or None in append mode."""
        return None if self.window is None else self.slots - self.sink

    # ------------------------------------------------------------- writes
    def _write_and_commit(self, payload: KVChunk | tuple[Array, ...], operation: str) -> KVCache:
        """``append`` / ``commit(payload)``: a ring takes a chunk of any length (a prefill), keeping what it shows."""
        written, refused = self._stage(payload, operation, committing=True)
        return written._commit_staged(when=jnp.logical_not(refused))

    def _stage(self, payload: KVChunk | tuple[Array, ...], operation: str, *,
               committing: bool = False) -> tuple[KVCache, Array]:
        """Writes rows after the committed ones, replacing what was staged.

        Args:
          payload: a :class:`KVChunk` or ``(k, v)`` / ``(k, v, counts)`` with
            ``k, v: Float[Array, "*batch T kv_heads head_dim"]`` of the cache's
            dtype and ``counts: Int[Array, "*batch"]`` in ``[0, T]``; with
            ``rows`` (a :class:`KVChunk` of some batch rows) the leading axes
            are ``rows``' and only those rows are written, the others
            staging nothing.
          operation: the public method, for messages.
          committing: the rows are committed at once (``append``,
          ``commit(payload)``): a ring then takes a chunk longer than
          ``max_staged`` (a prefill), keeping its rows among the sinks and
          the last ``slots - sink`` positions, as row-by-row appends would;
          rows a later position replaces in the ring are not written.

        Returns:
          The cache with the rows staged, and whether the write was refused:
          if any row would overflow (append mode: past capacity; ring mode:
          more than ``max_staged`` rows staged) or a count or row index is out of
          range, nothing is written: eagerly a :class:`CapacityError` /
          :class:`ValueError` is raised, under jit ``overflowed`` is set.
        """
        chunk, counts, bad_input = read_chunk(self, payload, operation, batch=self.batch)
        start = self.committed if chunk.rows is None else self.committed[chunk.rows]
        if self.window is None:
            room = self.capacity - start
            limit = f"capacity {self.capacity}"
        else:
            room = jnp.full_like(start, np.iinfo(np.int32).max if committing else self.max_staged)
            limit = f"max_staged {self.max_staged} rows staged between commits (append takes any length)"
        too_long = jnp.any(counts > room)
        refuse_now_if(
            too_long,
            lambda: CapacityError(
                f"{self.describe()}.{operation}: writing {np.asarray(counts).tolist()} rows after "
                f"{np.asarray(start).tolist()} exceeds {limit}; nothing was written. Allocate "
                "more, or commit sooner."
            ),
        )
        refused = bad_input | too_long
        written = jnp.where(refused, 0, counts)
        rows = {"k": chunk.k, "v": chunk.v}
        if self.quantize is not None:
            for name in ("k", "v"):
                rows[name], rows[f"{name}_scale"] = _quantize.quantize(rows[name], self.quantize)
        if chunk.rows is None:
            storage = {name: self._write_rows(getattr(self, name), x, start, written, whole=chunk.counts is None)
                       for name, x in rows.items()}
            written_per_row = written
        else:
            storage = {name: self._write_some_rows(getattr(self, name), x, chunk.rows, start, written)
                       for name, x in rows.items()}
            written_per_row = jnp.zeros_like(self.committed).at[chunk.rows].set(written)
        new = self._with_bookkeeping(
            **storage,
            committed=self.committed,
            staged=jnp.where(refused, self.staged, written_per_row),
            high_water=jnp.maximum(self.high_water, self.committed + written_per_row),
            refused=self.bookkeeping[..., _REFUSED, :] + refused,
        )
        return new, refused

    def _commit_staged(self, when: Array | bool = True) -> KVCache:
        promoted = jnp.where(when, self.staged, 0)
        return self._with_bookkeeping(
            committed=self.committed + promoted,
            staged=self.staged - promoted,
            high_water=self.high_water,
            refused=self.bookkeeping[..., _REFUSED, :],
        )

    def discard(self) -> KVCache:
        """Forgets staged rows (O(1)); committed rows are untouched."""
        self._require_resident("discard")
        return self.with_storage(bookkeeping=self.bookkeeping.at[..., _STAGED, :].set(0))

    # -------------------------------------------------------------- reads
    def view(self, *, include_staged: bool = True) -> KVView:
        """The cache as attention reads it; see :class:`KVView`.

        In ring mode the committed view (``include_staged=False``) holds the
        sinks and the last ``window`` committed positions, which ``discard()``
        restores exactly; the full view holds every position still in the
        ring up to the staged ones, enough for each query of a chunk just
        staged or appended.
        """
        self._require_resident("view")
        end = self.committed + self.staged if include_staged else self.committed
        positions = _ring.slot_positions(self.slots, self.high_water, sink=self.sink, ring=self.ring_slots)
        start = 0 if self.window is None or include_staged else (self.committed - self.window)[:, None]
        shown = _ring.visible(positions, start=start, end=end[:, None], sink=self.sink)
        return KVView(
            k=self.k,
            v=self.v,
            lengths=end,
            positions=jnp.where(shown, positions, -1),
            window=self.window,
            sink=self.sink,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            frame=self.frame,
            batch_shape=self.batch_shape,
        )

    # -------------------------------------------------------------- tiers
    @property
    def demotable(self) -> bool:
        """Whether ``tiers`` names a lower tier."""
        return bool(self.tiers)

    def demote(self) -> KVCache:
        """The next lower tier of this cache: its rows quantized to ``tiers[0]``.

        Every slot is quantized as :meth:`allocate` with ``quantize=``
        would have written it (the error bound is in the class docstring);
        counts, positions and staged rows are kept, so attention reads the
        demoted cache unchanged.  Under ``jit`` with the cache donated the
        float storage is read once and freed: the peak is the float cache
        plus its quantized copy.

        Returns:
          The cache quantized to ``tiers[0]``, with the remaining tiers.

        Raises:
          NotDemotableError: the cache declares no (further) tier.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> rows = jax.random.normal(jax.random.key(0), (1, 4, 1, 4))
          >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=8, tiers=("int8",))
          >>> kv = kv.append((rows, rows))
          >>> low = kv.demote()
          >>> low.quantize, low.tiers, low.view().lengths, kv.nbytes, low.nbytes
          ('int8', (), Array([4], dtype=int32), 272, 144)
          >>> bool(jnp.allclose(jss.attend(rows, low.view()), jss.attend(rows, kv.view()), atol=0.05))
          True
        """
        return _quantize.demoted(self, (("k", "k_scale"), ("v", "v_scale")))

    def _write_rows(self, cache: Array, rows: Array, start: Array, written: Array, *, whole: bool) -> Array:
        """``cache`` with ``rows[b, :written[b]]`` written at positions from ``start[b]``; nothing else changes.

        ``whole``: each ``written[b]`` is all of ``rows`` or nothing.
        """
        T = rows.shape[1]
        if self.window is None and self.batch_size == 1 and self.sharding is None and T <= self.slots:
            return _write_row_slice(cache, rows, start[0], written[0], whole=whole)
        return _writes.write_rows(cache, self._slots_of(start, written, T), rows.transpose(0, 2, 1, 3), axis=2)

    def _write_some_rows(self, cache: Array, rows: Array, index: Array, start: Array, written: Array) -> Array:
        """``cache`` with ``rows[i, :written[i]]`` written into batch row ``index[i]`` at positions from ``start[i]``.

        One scatter of the ``len(index) * T`` rows, in place under donation:
        no other batch row is read or written.
        """
        slots = self._slots_of(start, written, rows.shape[1])
        return cache.at[index[:, None], :, slots].set(rows, mode="drop")

    def _slots_of(self, start: Array, written: Array, T: int) -> Array:
        """``Int[Array, "n T"]`` the slot of each chunk row, ``slots`` (out of range: dropped) past ``written``.

        A ring also drops the rows a later row of the same chunk replaces
        (more rows than its ring slots: a prefill), so no slot is written twice.
        """
        index = jnp.arange(T, dtype=jnp.int32)
        positions = start[:, None] + index
        slots = _ring.slot_of(positions, sink=self.sink, ring=self.ring_slots)
        kept = index < written[:, None]
        if self.ring_slots is not None and T > self.ring_slots:
            kept &= (positions < self.sink) | (index >= written[:, None] - self.ring_slots)
        return jnp.where(kept, slots, self.slots)

    # ------------------------------------------------------------ branches
    def branch_window(self, size: int | None) -> KVCache:
        """An append-mode cache of ``size`` rows for one lane's K/V."""
        if size is None:
            raise PayloadTypeError(f"{self.describe()}: lanes need a window size (rows per lane).")
        return KVCache.allocate(
            batch=self.batch, kv_heads=self.kv_heads, head_dim=self.head_dim, capacity=size, dtype=self.dtype,
            quantize=self.quantize, sharding=self.sharding,
        )

    def branch_view(self, window: KVCache) -> BranchKVView:
        """The committed cache and the lane's rows at positions after it."""
        prefix = self.view(include_staged=False)
        rows = window.view()
        offset = prefix.lengths[:, None]
        return BranchKVView(
            prefix=prefix,
            window=KVView(
                k=rows.k,
                v=rows.v,
                lengths=prefix.lengths + rows.lengths,
                positions=jnp.where(rows.positions >= 0, rows.positions + offset, -1),
                window=self.window,
                sink=self.sink,
                k_scale=rows.k_scale,
                v_scale=rows.v_scale,
                frame=self.frame,
                batch_shape=self.batch_shape,
            ),
        )

    def commit_window(self, window: KVCache) -> KVCache:
        """Appends the lane's rows (in pieces of ``max_staged`` for a ring).

        The window's refused writes are added to this cache's, so ``overflowed``
        tells that rows of the lane were lost.
        """
        counts = window.committed + window.staged
        k, v = (_quantize.dequantize(x, scale, self.dtype).transpose(0, 2, 1, 3)  # token-major, window-sized
                for x, scale in ((window.k, window.k_scale), (window.v, window.v_scale)))
        k, v = (x.reshape(*self.batch_shape, *x.shape[1:]) for x in (k, v))
        counts = counts.reshape(self.batch_shape)
        piece = window.capacity if self.window is None else self.max_staged
        cache = self
        for start in range(0, window.capacity, piece):
            taken = jnp.clip(counts - start, 0, piece).astype(jnp.int32)
            lead = (slice(None),) * len(self.batch_shape)
            cache = cache.append(KVChunk(k[(*lead, slice(start, start + piece))],
                                         v[(*lead, slice(start, start + piece))], taken))
        return cache.with_storage(
            bookkeeping=cache.bookkeeping.at[..., _REFUSED, :].add(window.bookkeeping[..., _REFUSED, :])
        )


def _write_row_slice(cache: Array, rows: Array, start: Array, count: Array, *, whole: bool) -> Array:
    """``cache`` with ``rows[0, :count]`` written at slots ``start..start+count-1`` of its one batch row.

    ``cache: [1, kv_heads, capacity, head_dim]``, ``rows: [1, T, kv_heads,
    head_dim]`` with ``T <= capacity``; ``start + count <= capacity``.  One
    in-place ``dynamic_update_slice`` of ``T`` rows: the window starts at
    ``start`` clamped so it fits, each of its rows takes the chunk's row
    that lands there or keeps what the cache holds, so nothing outside the
    ``count`` rows changes (:func:`update_slice_or_keep`; XLA fuses the
    shift and the transpose too).  With ``whole`` (``count`` is ``T`` or 0)
    a write that happens starts at ``start`` itself, so the rows need no
    shift.
    """
    T = rows.shape[1]
    window_start = jnp.minimum(start, cache.shape[2] - T)
    if whole:
        return update_slice_or_keep(cache, rows.transpose(0, 2, 1, 3), window_start, axis=2, lands=count > 0)
    shift = start - window_start
    index = jnp.arange(T, dtype=jnp.int32)
    shifted = jnp.take(rows, jnp.clip(index - shift, 0, T - 1), axis=1).transpose(0, 2, 1, 3)
    lands = ((index >= shift) & (index < shift + count))[None, None, :, None]
    return update_slice_or_keep(cache, shifted, window_start, axis=2, lands=lands)

