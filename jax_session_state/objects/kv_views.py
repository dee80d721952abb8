"""What K/V kinds are written with and read as.

:class:`KVChunk`, :class:`KVView`, :class:`BranchKVView`, :class:`PagedView`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jax_session_state._core import _validation as v
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import refuse_now_if
from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.objects import _batch
from jax_session_state.objects._batch import BatchShape
from jax_session_state.objects._quantize import dequantize

__all__ = ["BranchKVView", "KVChunk", "KVView", "PagedView", "read_chunk"]


class KVChunk(NamedTuple):
    """A chunk of K/V rows to write, token-major as a model produces them.

    Attributes:
      k: ``Float[Array, "*batch T kv_heads head_dim"]``, the cache's batch
        shape leading (``[B, P, T, ...]`` for ``batch=(B, P)``), or
        ``rows``' shape when ``rows`` is given.
      v: ``Float[Array, "*batch T kv_heads head_dim"]``, as ``k``.
      counts: ``Int[Array, "*batch"]`` rows of the chunk each batch row takes
        (a ragged write: row ``b`` takes ``k[b, :counts[b]]``), or None for
        all ``T``.
      rows: ``Int[Array, "*n"]`` distinct flat batch-row indices (into the
        flattened batch shape; ``jnp.ravel_multi_index`` turns per-axis
        indices into them) written by this chunk, whose ``k``, ``v`` and
        ``counts`` then lead with ``rows``' shape: only those rows are
        written, scattered in place (no full-size payload), as a full chunk
        with ``counts`` 0 for every other row would write them.  None: every
        batch row.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> rows = jnp.ones((2, 4, 1, 8))  # batch 2, T 4, one kv head of 8
      >>> kv = jss.KVCache.allocate(batch=2, kv_heads=1, head_dim=8, capacity=16)
      >>> kv.append(jss.KVChunk(rows, rows, counts=jnp.array([4, 1], jnp.int32))).committed
      Array([4, 1], dtype=int32)
      >>> one = jnp.ones((1, 3, 1, 8))  # 3 rows for batch row 1 alone
      >>> kv.append(jss.KVChunk(one, one, rows=jnp.array([1]))).committed
      Array([0, 3], dtype=int32)
    """

    k: Array
    v: Array
    counts: Array | None = None
    rows: Array | None = None


def read_chunk(obj: StateObject, payload: Any, operation: str, *, batch: BatchShape,
               subsets: bool = True) -> tuple[KVChunk, Array, Array]:
    """Checks a K/V payload written by ``obj.operation`` and flattens its batch axes.

    Args:
      obj: the object written; its ``kv_heads``, ``head_dim`` and ``dtype``
        fix the payload's trailing shape and dtype.
      payload: a :class:`KVChunk` or ``(k, v[, counts[, rows]])`` tuple.
      operation: the public method, for messages.
      batch: the object's batch shape (batch rows, sequence slots): the
        payload's leading axes unless it names ``rows``.
      subsets: whether ``obj`` takes a chunk of some rows (``rows=``).

    Returns:
      The chunk with ``k``, ``v`` ``[n, T, kv_heads, head_dim]`` and
      ``counts`` flattened over the batch axes (``n`` the batch's rows, or
      the rows named) and ``rows`` the flat indices (checked, or None), its
      counts ``Int[Array, "n"]`` (all ``T`` when None) and whether a count
      lies outside ``[0, T]`` or a row index is out of range or repeated:
      eagerly that raises ``ValueError`` at once; under jit the caller
      refuses the write.

    Raises:
      PayloadTypeError, PayloadError: the wrong structure, shape or dtype, naming ``obj``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.objects.kv_views import read_chunk
      >>> kv = jss.KVCache.allocate(batch=(2, 3), kv_heads=1, head_dim=2, capacity=8)
      >>> rows = jnp.ones((2, 3, 5, 1, 2))  # [*batch, T, kv_heads, head_dim]
      >>> chunk, counts, refused = read_chunk(kv, (rows, rows), "append", batch=kv.batch)
      >>> chunk.k.shape, counts.tolist(), bool(refused)  # stored flattened: [B * P, T, ...]
      ((6, 5, 1, 2), [5, 5, 5, 5, 5, 5], False)
    """
    owner = f"{obj.describe()}.{operation}"
    if not isinstance(payload, tuple) or len(payload) not in (2, 3, 4):
        raise PayloadTypeError(
            f"{owner}: payload must be a KVChunk(k, v[, counts][, rows]) or a (k, v[, counts[, rows]]) "
            f"tuple; got {type(payload).__name__}."
        )
    chunk = KVChunk(*payload)
    index, bad_rows = None, jnp.zeros((), bool)
    if chunk.rows is None:
        lead = _batch.shape_of(batch)
    elif not subsets:
        raise PayloadTypeError(f"{owner}: takes every batch row at once; write it without rows=.")
    else:
        index, lead, bad_rows = _batch.flat_rows(owner, chunk.rows, _batch.size_of(batch))
    n = math.prod(lead)
    sizes: dict[str, int] = {}
    pattern = (*lead, "T", obj.kv_heads, obj.head_dim)
    v.check_array(chunk.k, owner=owner, what="k", shape=pattern, dtype=obj.dtype, sizes=sizes)
    v.check_array(chunk.v, owner=owner, what="v", shape=pattern, dtype=obj.dtype, sizes=sizes)
    T = sizes["T"]
    if chunk.counts is None:
        counts = jnp.full((n,), T, jnp.int32)
    else:
        v.check_array(chunk.counts, owner=owner, what="counts", shape=lead, dtype=jnp.int32)
        counts = chunk.counts.reshape(n)
    bad_counts = jnp.any((counts < 0) | (counts > T))
    refuse_now_if(
        bad_counts,
        lambda: PayloadError(f"{owner}: counts must lie in [0, {T}]; got {np.asarray(counts).tolist()}."),
    )
    flat = KVChunk(
        chunk.k.reshape(n, T, obj.kv_heads, obj.head_dim),
        chunk.v.reshape(n, T, obj.kv_heads, obj.head_dim),
        None if chunk.counts is None else counts,
        index,
    )
    return flat, counts, bad_counts | bad_rows


class KVView(struct.PyTreeNode):
    """What attention reads from a K/V cache.

    Storage is head-major, ``[batch, kv_heads, capacity, head_dim]``: measured
    on XLA CPU, a token-major ``[batch, capacity, kv_heads, head_dim]`` cache
    made XLA transpose the whole cache every attention step (slower, and a
    peak of more than twice the cache's bytes), while head-major feeds the score matmuls
    directly.  Slots are not in position order in ring mode; ``positions``
    says which absolute position each slot holds.

    Attributes:
      k: ``Float[Array, "batch kv_heads capacity head_dim"]``.
      v: ``Float[Array, "batch kv_heads capacity head_dim"]``.
      lengths: ``Int[Array, "batch"]`` per row, one past the last position
        shown: the tokens written so far.  In append mode slots
        ``0..lengths-1`` are exactly the visible ones; in ring mode only the
        sinks and the most recent positions before ``lengths`` are held
        (``positions`` says which), so fewer tokens than ``lengths`` are
        visible once the ring has wrapped.
      positions: ``Int[Array, "batch capacity"]`` absolute position held by
        each slot, -1 where a slot is empty or not visible.
      window: sliding-window size, or None in append mode.  A query at ``q``
        sees key ``p`` when ``p < sink`` or ``q - p < window``.
      sink: number of first positions kept for ever (0 without a window).
      frame: tokens per frame when the cache was allocated in frames, else
        None: :func:`~jax_session_state.attend` then reads each query at its
        frame's last position, ``(q // frame + 1) * frame - 1``, for the
        causal mask and the window above (block-causal frames).
      k_scale: ``Float[Array, "batch kv_heads capacity 1"]`` for a quantized
        cache (``k`` then holds int8 or fp8 values and a row reads as
        ``k * k_scale``), None otherwise.  Attention dequantizes block by
        block, never the whole cache.
      v_scale: the same for ``v``.
      batch_shape: the batch axes the rows were allocated with
        (``KVCache.allocate(batch=(B, P))``), flattened into the first axis of
        ``k``, ``v``, ``lengths`` and ``positions``; queries lead with them
        (:func:`~jax_session_state.attend` flattens and unflattens them).
        None: one batch axis, ``k``'s first.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, window=2, sink=1, max_staged=1)
      >>> for t in range(6):
      ...     kv = kv.append((jnp.full((1, 1, 1, 2), float(t)),) * 2)
      >>> view = kv.view()  # slots hold positions out of order once the ring wraps
      >>> view.positions.tolist(), [row["positions"].tolist() for row in view.materialize()]
      ([[0, 4, 5, 3]], [[0, 3, 4, 5]])
    """

    k: Array
    v: Array
    lengths: Array
    positions: Array
    window: int | None = struct.field(pytree_node=False, default=None)
    sink: int = struct.field(pytree_node=False, default=0)
    k_scale: Array | None = None
    v_scale: Array | None = None
    frame: int | None = struct.field(pytree_node=False, default=None)
    batch_shape: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def quantized(self) -> bool:
        """Whether ``k`` and ``v`` hold quantized values read with their scales."""
        return self.k_scale is not None

    def materialize(self) -> list[dict[str, np.ndarray]]:
        """The visible rows of each (flat) batch row in position order, on the host (dequantized).

        Returns:
          One dict per batch row with ``positions`` ``[n]``, ``k`` and ``v``
          ``[n, kv_heads, head_dim]`` (numpy).
        """
        positions = np.asarray(self.positions)
        k = np.asarray(dequantize(self.k, self.k_scale))
        v_ = np.asarray(dequantize(self.v, self.v_scale))
        rows = []
        for b in range(positions.shape[0]):
            slots = np.flatnonzero(positions[b] >= 0)
            slots = slots[np.argsort(positions[b, slots], kind="stable")]
            rows.append(
                {
                    "positions": positions[b, slots],
                    "k": k[b][:, slots].transpose(1, 0, 2),
                    "v": v_[b][:, slots].transpose(1, 0, 2),
                }
            )
        return rows


class BranchKVView(struct.PyTreeNode):
    """What a speculative lane reads from a K/V cache: a shared prefix and its own rows.

    Attention over it reads the prefix once for every lane (under ``vmap``
    the prefix is not batched) and merges the two parts by log-sum-exp
    (cascade attention).

    Attributes:
      prefix: the committed cache, shared by all lanes.
      window: the lane's rows, positions absolute (after the prefix's).

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> rows = jnp.ones((1, 3, 1, 2))
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8).append((rows, rows))
      >>> branches = jss.Session(objects={"kv": kv}).branch(2, window=4)
      >>> branches = branches.map(lambda lane: lane.stage(kv=(rows[:, :1],) * 2))
      >>> view = branches.lane(0).view()["kv"]
      >>> type(view).__name__, view.prefix.lengths.tolist(), view.window.lengths.tolist()
      ('BranchKVView', [3], [4])
    """

    prefix: KVView
    window: KVView

    def materialize(self) -> list[dict[str, np.ndarray]]:
        """Prefix rows then window rows of each batch row, in position order."""
        return [
            {key: np.concatenate([a[key], b[key]]) for key in a}
            for a, b in zip(self.prefix.materialize(), self.window.materialize())
        ]


class PagedView(struct.PyTreeNode):
    """What attention reads from a paged cache: the pools and the page tables.

    Row ``p`` of slot ``s`` lies at ``pool[page_table[s, p // page_size],
    p % page_size]`` for ``p < lengths[s]``.  Pages are token-major, as a
    model writes them; :meth:`to_dense` gathers them into a head-major
    :class:`KVView` (the reference path of attention).

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> cache = jss.PagedKVCache.allocate(max_slots=2, kv_heads=1, head_dim=2, page_size=4, num_pages=4)
      >>> rows = jnp.ones((2, 5, 1, 2))
      >>> view = cache.append(jss.KVChunk(rows, rows, counts=jnp.array([5, 2], jnp.int32))).view()
      >>> view.page_table.tolist(), view.lengths.tolist()
      ([[0, 1, -1, -1], [2, -1, -1, -1]], [5, 2])

    Attributes:
      k_pages: ``Float[Array, "num_pages page_size kv_heads head_dim"]``
        (int8 or fp8 values when quantized).
      v_pages: ``Float[Array, "num_pages page_size kv_heads head_dim"]``
        (int8 or fp8 values when quantized).
      page_table: ``Int[Array, "max_slots max_pages_per_slot"]`` page ids,
        -1 where a slot holds no page.
      lengths: ``Int[Array, "max_slots"]`` rows visible per slot.
      page_size: rows per page.
      k_scale: ``Float[Array, "num_pages page_size kv_heads 1"]`` for a
        quantized cache, the float32 scale of each row of each head, laid
        out like the pages (a row reads as ``k_pages * k_scale``); None
        otherwise.  Attention applies the scales block by block, never to
        the whole pool.
      v_scale: the same for ``v_pages``.
      batch_shape: the slot axes the cache was allocated with
        (``PagedKVCache.allocate(max_slots=(B, P))``), flattened into the
        first axis of ``page_table`` and ``lengths``; None: one slot axis.
    """

    k_pages: Array
    v_pages: Array
    page_table: Array
    lengths: Array
    page_size: int = struct.field(pytree_node=False)
    k_scale: Array | None = None
    v_scale: Array | None = None
    batch_shape: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def quantized(self) -> bool:
        """Whether the pools hold quantized values read with their scales."""
        return self.k_scale is not None

    def positions(self) -> Array:
        """Position of each row of :meth:`to_dense`, -1 past a slot's length.

        Returns:
          ``Int[Array, "max_slots max_pages_per_slot*page_size"]``.
        """
        rows = jnp.arange(self.page_table.shape[1] * self.page_size, dtype=jnp.int32)
        return jnp.where(rows < self.lengths[:, None], rows, -1)

    def to_dense(self) -> KVView:
        """Every slot's pages gathered, in order, into a head-major :class:`KVView`.

        The dense view is ``[max_slots, kv_heads, max_pages_per_slot *
        page_size, head_dim]``: a copy as large as the page tables allow, so
        a reference path, not a decode kernel.  Rows past a slot's length
        hold whatever their page holds and are masked by ``positions``.  A
        quantized view stays quantized (its scales are gathered alongside).
        """
        slots, pages = self.page_table.shape
        ids = jnp.maximum(self.page_table, 0)

        def gather(pool: Array | None) -> Array | None:
            if pool is None:
                return None
            rows = pool[ids].reshape(slots, pages * self.page_size, *pool.shape[2:])
            return rows.transpose(0, 2, 1, 3)

        return KVView(
            k=gather(self.k_pages), v=gather(self.v_pages), lengths=self.lengths, positions=self.positions(),
            k_scale=gather(self.k_scale), v_scale=gather(self.v_scale), batch_shape=self.batch_shape,
        )

    def materialize(self) -> list[dict[str, np.ndarray]]:
        """The visible rows of each slot in position order, on the host (dequantized).

        Returns:
          One dict per slot with ``positions`` ``[n]``, ``k`` and ``v``
          ``[n, kv_heads, head_dim]`` (numpy), as :meth:`KVView.materialize`.
        """
        table, lengths = np.asarray(self.page_table), np.asarray(self.lengths)
        k = np.asarray(dequantize(self.k_pages, self.k_scale))
        v_ = np.asarray(dequantize(self.v_pages, self.v_scale))
        rows = []
        for s, n in enumerate(lengths):
            positions = np.arange(n, dtype=np.int32)
            pages, offsets = table[s, positions // self.page_size], positions % self.page_size
            rows.append({"positions": positions, "k": k[pages, offsets], "v": v_[pages, offsets]})
        return rows
