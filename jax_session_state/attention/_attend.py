"""``attend`` and ``attend_with_lse``: the checks, the dispatch by view, and ``merge_attention``.

What each view is read by is told in the package docstring (:mod:`jax_session_state.attention`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from jax_session_state._core import _library
from jax_session_state.attention import _append, _branch, _paged, _ring
from jax_session_state.attention._operands import checked, checked_scale, default_positions
from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.objects.kv import BranchKVView, KVView
from jax_session_state.objects.paged import PagedView

IMPLEMENTATIONS = ("auto", "native", "loop", "bucketed", "pallas")
"""The ways :func:`attend` reads append-mode and paged views."""

_F32 = jnp.float32


def native_status() -> str:
    """Whether append-mode float32 attention on CPU runs the native kernel here, and why (not).

    The kernel is compiled at install when a C++17 compiler is present; it is
    used on a single CPU device unless ``JSS_NATIVE_ATTENTION=0`` is set.

    Example:
      >>> import jax_session_state as jss
      >>> jss.attention.native_status().startswith(("native kernel", "pure JAX"))
      True
    """
    return _library.status()


def attend(
    q: Array,
    view: KVView | BranchKVView | PagedView,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_positions: Array | None = None,
    implementation: str = "auto",
    frame: int | None = None,
    rows: Array | None = None,
) -> Array:
    """Attention of ``q`` over a view.

    Args:
      q: ``Float[Array, "*batch T q_heads head_dim"]``, token-major, its
        leading axes the view's batch shape (``[B, P, T, ...]`` over a cache
        allocated with ``batch=(B, P)``, or those rows flattened), or
        ``rows``' shape; ``q_heads`` a multiple of the view's ``kv_heads``
        (GQA: query head ``h`` reads kv head ``h // (q_heads // kv_heads)``).
      view: a :class:`KVView`, :class:`BranchKVView` or :class:`PagedView`.
      causal: mask keys after each query's position (with a frame, after
        its frame's last position).  ``causal=False`` shows every valid key
        of an append-mode or paged view; on a ring view (``window=``) it has
        no single meaning and raises: give the frame instead.
      scale: score scale, default ``1 / sqrt(head_dim)``; a traced scalar
        (or an array) is folded into the queries, in float32.
      q_positions: ``Int[Array, "*batch T"]`` absolute query positions;
        default the view's last ``T`` positions (the rows just written).
      implementation: how append-mode, ring and paged views are read (a
        ring by its runs of slots; a branch's own rows are always one
        dense pass):
        ``"auto"``: on CPU the native kernel on a single device where
        built, else ``"loop"``; on CUDA, where this process has a GPU,
        ``"pallas"``; on TPU, and elsewhere, ``"bucketed"``;
        ``"native"``: the native kernel (an error where it is not
        available; CPU only); ``"loop"``: the pure-JAX blockwise loop;
        ``"bucketed"``: one fused dense pass over the valid prefix rounded
        up to a power of two, picked by ``lax.switch`` (a handful of
        kernels; in chunks past :data:`BUCKET_SCORE_BYTES` of scores);
        ``"pallas"``: the split-K Pallas kernel (GPU; interpreted on CPU),
        on TPU the Mosaic kernel of ``_pallas_tpu`` (opt-in: not yet run on a
        TPU); buckets for views they do not take (rings among them), as
        above.
      frame: ``N``: queries come in frames of ``N`` tokens aligned to
        absolute positions (frame ``f`` holds ``[f*N, (f+1)*N)``), and each
        sees its whole frame and everything before it (block-causal): its
        position reads as its frame's last, ``(q // N + 1) * N - 1``, for
        the causal mask and a ring's window.  Default: the frame the view's
        cache was allocated with (``KVCache.allocate(frame=N)``), else none;
        a different one raises.
      rows: ``Int[Array, "*n"]`` distinct flat indices of the view's batch
        rows that ``q``'s ``n`` batch entries read (query entry ``i`` reads
        row ``rows[i]``): a query batch that is a subset of the cache's
        rows.  A paged view reads them through its page table (no copy of
        the pages); a dense view gathers the named rows (a copy of ``n``
        rows, not of the cache).  None: every row.

    Returns:
      ``Float[Array, "*batch T q_heads head_dim"]`` in ``q``'s dtype.

    Example:
      Causal attention of the 3 rows just written, against a dense numpy reference:

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_session_state as jss
      >>> k, v, q = jax.random.normal(jax.random.key(0), (3, 1, 3, 1, 4))  # [batch, T, heads, dim]
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=4, capacity=16).append((k, v))
      >>> causal = np.triu(np.full((3, 3), -np.inf), 1)  # a key after the query is hidden
      >>> scores = np.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0]) / np.sqrt(4) + causal
      >>> weights = np.exp(scores - scores.max(-1, keepdims=True))
      >>> reference = (weights / weights.sum(-1, keepdims=True)) @ v[0, :, 0]
      >>> bool(np.allclose(jss.attend(q, kv.view())[0, :, 0], reference, atol=1e-5))
      True

      The same 3 rows as one frame: every query sees all 3 (block-causal).

      >>> bool(jnp.allclose(jss.attend(q, kv.view(), frame=3), jss.attend(q, kv.view(), causal=False), atol=1e-6))
      True

      Leading batch axes (an axial model's batch of positions), and a query
      batch reading some of the rows:

      >>> kv = jss.KVCache.allocate(batch=(2, 3), kv_heads=1, head_dim=4, capacity=8)
      >>> x = jax.random.normal(jax.random.key(2), (2, 3, 5, 1, 4))  # [B, P, T, heads, dim]
      >>> kv = kv.append((x, x))
      >>> jss.attend(x, kv.view()).shape
      (2, 3, 5, 1, 4)
      >>> some = jss.attend(x.reshape(6, 5, 1, 4)[jnp.array([4, 1])], kv.view(), rows=jnp.array([4, 1]))
      >>> bool(jnp.allclose(some, jss.attend(x, kv.view()).reshape(6, 5, 1, 4)[jnp.array([4, 1])], atol=1e-6))
      True
    """
    return attend_with_lse(q, view, causal=causal, scale=scale, q_positions=q_positions,
                           implementation=implementation, frame=frame, rows=rows)[0]


def attend_with_lse(
    q: Array, view: KVView | BranchKVView | PagedView, *, causal: bool = True, scale: float | None = None,
    q_positions: Array | None = None, implementation: str = "auto", frame: int | None = None,
    rows: Array | None = None,
) -> tuple[Array, Array]:
    """:func:`attend`, plus the log-sum-exp of each query's visible scores.

    Args:
      q: ``Float[Array, "*batch T q_heads head_dim"]``, token-major, as for
        :func:`attend`; ``q_heads`` a multiple of the view's ``kv_heads``.
      view: a :class:`KVView`, :class:`BranchKVView` or :class:`PagedView`.
      causal: mask keys after each query's position, as for :func:`attend`.
      scale: score scale, default ``1 / sqrt(head_dim)``, as for :func:`attend`.
      q_positions: ``Int[Array, "*batch T"]`` absolute query positions;
        default the view's last ``T`` positions.
      implementation: ``"auto"``, ``"native"``, ``"loop"``,
        ``"bucketed"`` or ``"pallas"``, as for :func:`attend`.
      frame: queries in block-causal frames of this many tokens, as for
        :func:`attend`.
      rows: the view's batch rows the query batch reads, as for :func:`attend`.

    Returns:
      ``(out, lse)``: ``out`` is ``Float[Array, "*batch T q_heads head_dim"]``
      in ``q``'s dtype, as :func:`attend` returns it (zeros where a query
      sees nothing); ``lse`` is ``Float32[Array, "*batch T q_heads"]``,
      ``-inf`` where a query sees nothing.  Two results over disjoint keys
      merge exactly with :func:`merge_attention`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> k = jax.random.normal(jax.random.key(0), (1, 4, 1, 8))
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=8, capacity=16).append((k, k))
      >>> out, lse = jss.attend_with_lse(k, kv.view())
      >>> out.shape, lse.shape, lse.dtype
      ((1, 4, 1, 8), (1, 4, 1), dtype('float32'))
      >>> _, nothing = jss.attend_with_lse(k, kv.view(), q_positions=jnp.full((1, 4), -1))  # sees no key
      >>> bool(jnp.isneginf(nothing).all())
      True
    """
    if implementation not in IMPLEMENTATIONS:
        raise PayloadError(f"attend(): implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}.")
    if implementation == "native" and not _library.enabled():
        raise RuntimeError(f"attend(implementation='native'): the native kernel is not in use: {_library.status()}")
    if not isinstance(view, (KVView, BranchKVView, PagedView)):
        raise PayloadTypeError(f"attend() reads a KVView, BranchKVView or PagedView; got {type(view).__name__}.")
    frame = _checked_mask(view, causal, frame)
    lead = _batch_axes(q, view, rows)
    q, q_positions = _flattened(q, q_positions, lead)
    if rows is not None:
        view = _rows_of(view, rows)
    if _eager(q, view, q_positions, scale):  # one compiled program per signature, not one per call
        out, lse = _compiled_attend(q, view, q_positions, causal=causal, scale=scale,
                                    implementation=implementation, frame=frame, native=_library.enabled())
    else:
        out, lse = _attend(q, view, q_positions, causal=causal, scale=scale, implementation=implementation,
                           frame=frame)
    return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])


def _batch_axes(q: Any, view: KVView | BranchKVView | PagedView, rows: Any) -> tuple[int, ...]:
    """The leading (batch) axes of ``q``: the view's batch shape, its rows flattened, or ``rows``' shape.

    Raises:
      PayloadError: ``q`` has fewer than 4 axes, or leading axes the view
        (or ``rows``) does not give, saying what was expected.
      PayloadTypeError: ``rows`` is not an integer array.
    """
    if not hasattr(q, "ndim") or q.ndim < 4:
        raise PayloadError(f"attend(): q must be [*batch, T, q_heads, head_dim]; got shape "
                           f"{list(getattr(q, 'shape', ()))}.")
    lead = tuple(q.shape[:-3])
    if rows is not None:
        if not hasattr(rows, "shape") or not jnp.issubdtype(rows.dtype, jnp.integer):
            raise PayloadTypeError(f"attend(): rows must be an integer array of flat indices of the view's batch "
                                   f"rows; got {type(rows).__name__}.")
        if lead != tuple(rows.shape):
            raise PayloadError(f"attend(): q's batch axes must be rows' shape {list(rows.shape)} (one query entry "
                               f"per row read); got q of shape {list(q.shape)}.")
        return lead
    head = view.prefix if isinstance(view, BranchKVView) else view
    size = head.page_table.shape[0] if isinstance(head, PagedView) else head.k.shape[0]
    shape = head.batch_shape or (size,)
    if lead not in (shape, (size,)):
        raise PayloadError(
            f"attend(): q must be [*batch, T, q_heads, head_dim] with batch {list(shape)} (the view's batch axes, "
            f"or their {size} rows flattened; pass rows= to read some rows only); got q of shape {list(q.shape)}."
        )
    return lead


def _flattened(q: Array, q_positions: Array | None, lead: tuple[int, ...]) -> tuple[Array, Array | None]:
    """``q`` and ``q_positions`` with their batch axes flattened into one (a free reshape)."""
    n = math.prod(lead)
    q = q.reshape(n, *q.shape[len(lead):])
    if q_positions is not None and jnp.ndim(q_positions) == len(lead) + 1:
        if tuple(jnp.shape(q_positions)[:-1]) != lead:
            raise PayloadError(f"attend(): q_positions must be [*batch, T] with batch {list(lead)}; got shape "
                               f"{list(jnp.shape(q_positions))}.")
        q_positions = jnp.reshape(q_positions, (n, -1))
    return q, q_positions


def _rows_of(view: KVView | BranchKVView | PagedView, rows: Array) -> KVView | BranchKVView | PagedView:
    """The view of batch rows ``rows`` only: a paged view through its page table (no page is copied), a dense
    view by gathering those rows.  Under ``jit`` a row out of range shows no key.

    Raises:
      PayloadError: an index is out of range or repeated (at once when ``rows`` is concrete).
    """
    index = jnp.reshape(rows, (-1,)).astype(jnp.int32)
    head = view.prefix if isinstance(view, BranchKVView) else view
    size = head.page_table.shape[0] if isinstance(head, PagedView) else head.k.shape[0]
    if not isinstance(index, jax.core.Tracer):
        found = index.tolist()
        if any(i < 0 or i >= size for i in found) or len(set(found)) != len(found):
            raise PayloadError(f"attend(): rows must be distinct flat indices of the view's batch rows in "
                               f"[0, {size}); got {found}.")
    if isinstance(view, BranchKVView):
        return BranchKVView(prefix=_rows_of(view.prefix, rows), window=_rows_of(view.window, rows))
    valid = (index >= 0) & (index < size)  # traced: a row out of range sees nothing (zeros, lse -inf)
    lengths = jnp.where(valid, view.lengths[index], 0)
    if isinstance(view, PagedView):
        return view.replace(page_table=view.page_table[index], lengths=lengths, batch_shape=None)
    taken = {name: None if getattr(view, name) is None else getattr(view, name)[index]
             for name in ("k", "v", "k_scale", "v_scale")}
    positions = jnp.where(valid[:, None], view.positions[index], -1)
    return view.replace(**taken, lengths=lengths, positions=positions, batch_shape=None)


def _checked_mask(view: KVView | BranchKVView | PagedView, causal: bool, frame: Any) -> int | None:
    """The frame size the mask uses: ``frame``, else the one the view carries.

    Raises:
      PayloadTypeError: ``frame`` is not a positive int (a bool is not one).
      PayloadError: ``frame`` differs from the view's; ``causal=False`` with
        ``frame=``, or on a ring view (where it would give each query its own
        sliding window, not the frame mask).
    """
    if frame is not None and (not isinstance(frame, numbers.Integral) or isinstance(frame, bool) or frame < 1):
        raise PayloadTypeError(f"attend(): frame must be a positive int (tokens per frame) or None; got {frame!r}.")
    head = view.prefix if isinstance(view, BranchKVView) else view
    carried = head.frame if isinstance(head, KVView) else None
    if frame is not None and carried is not None and frame != carried:
        raise PayloadError(f"attend(): frame={frame}, but the view's cache was allocated with frame={carried}; "
                           "pass the same frame or leave it out.")
    if not causal and frame is not None:
        raise PayloadError(f"attend(): frame={frame} is block-causal (each query sees its frame and what came "
                           "before); causal=False contradicts it. Leave causal=True.")
    if not causal and isinstance(head, KVView) and head.window is not None:
        raise PayloadError(
            f"attend(): causal=False on a ring view (window={head.window}, sink={head.sink}) has no single meaning: "
            "each query would keep its own sliding window, which is not the frame mask. For queries in frames of "
            "N tokens pass frame=N (or allocate the cache with frame=N); for token-causal queries leave causal=True."
        )
    return int(frame) if frame is not None else carried


def _eager(q: Array, view: Any, q_positions: Array | None, scale: Any) -> bool:
    """Whether a call runs outside any transformation (no tracers), with a static scale."""
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((q, view, q_positions)))
    return not traced and (scale is None or isinstance(scale, numbers.Real))


def _attend(q: Array, view: KVView | BranchKVView | PagedView, q_positions: Array | None, *, causal: bool,
            scale: Any, implementation: str, frame: int | None = None) -> tuple[Array, Array]:
    """:func:`attend_with_lse` once its arguments are checked.

    A scale that is not a Python number (traced, or an array) is folded into
    the queries, in float32, and the readers take 1.0: the kernels take
    their scale as a constant.  A frame turns each query's position into its
    frame's last, so every reader applies the block-causal mask through its
    causal mask (and a ring's window) unchanged.
    """
    if scale is not None and not isinstance(scale, numbers.Real):
        out, lse = _attend(_scaled_queries(q, scale), view, q_positions, causal=causal, scale=1.0,
                           implementation=implementation, frame=frame)
        return out.astype(q.dtype), lse
    if not math.prod(q.shape[:3]):
        return _no_query_rows(q, view, q_positions)
    if frame is not None:
        lengths = view.window.lengths if isinstance(view, BranchKVView) else view.lengths
        q_positions = _frame_last(default_positions(q, lengths, q_positions), frame)
    if isinstance(view, BranchKVView):
        q_positions = default_positions(q, view.window.lengths, q_positions)
        prefix = _kv_with_lse(q, view.prefix, causal, scale, q_positions, implementation)
        lane = _branch.read_lane(q, view.window, causal, scale, q_positions)
        return merge_attention(*prefix, *lane)
    if isinstance(view, PagedView):
        return _paged.read(q, view, causal, scale, q_positions, implementation)
    return _kv_with_lse(q, view, causal, scale, q_positions, implementation)


def _kv_with_lse(q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array | None,
                 implementation: str) -> tuple[Array, Array]:
    """A :class:`KVView` read by its layout: a ring (``window=``) where it lies, else append-mode."""
    read = _ring.read if view.window is not None else _append.read
    return read(q, view, causal, scale, q_positions, implementation)


def _frame_last(positions: Array, frame: int) -> Array:
    """Each position's frame's last position: ``(p // frame + 1) * frame - 1`` (-1 stays -1: sees nothing)."""
    return positions // frame * frame + (frame - 1)


def _scaled_queries(q: Array, scale: Any) -> Array:
    """``q * scale`` in float32, for a scale that is not a Python number.

    Raises:
      PayloadError: the scale is not a scalar.
    """
    scale = jnp.asarray(scale)
    if scale.ndim:
        raise PayloadError(f"attend(): scale must be a scalar; got shape {list(scale.shape)}.")
    return q.astype(_F32) * scale.astype(_F32)


def _no_query_rows(q: Array, view: KVView | BranchKVView | PagedView, q_positions: Array | None
                   ) -> tuple[Array, Array]:
    """What a call without query rows (batch, ``T`` or ``q_heads`` 0) returns, its operands checked as any call
    checks them: an empty output and log-sum-exp.  No reader runs: there is nothing to read for."""
    if isinstance(view, PagedView):
        checked(q, view.page_table.shape[0], view.k_pages.shape[2], view.k_pages.shape[3], None)
        lengths = view.lengths
    else:
        cache = view.prefix if isinstance(view, BranchKVView) else view
        checked_scale(q, cache.k, None)
        lengths = cache.lengths
    default_positions(q, lengths, q_positions)
    return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, _F32)


def _compiled(q: Array, view: KVView | BranchKVView | PagedView, q_positions: Array | None, *, causal: bool,
              scale: float | None, implementation: str, frame: int | None, native: bool) -> tuple[Array, Array]:
    """:func:`_attend`; ``native`` (whether the native kernels are in use as it is traced,
    :func:`_library.enabled`) only keys the compiled programs, so that a call after ``_library.use(False)``
    does not run a program traced with them."""
    del native
    return _attend(q, view, q_positions, causal=causal, scale=scale, implementation=implementation, frame=frame)


# An eager call's loops would be traced and compiled again on every call: run them as one cached program.
_compiled_attend = jax.jit(_compiled, static_argnames=("causal", "scale", "implementation", "frame", "native"))


def merge_attention(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Exact merge of two attentions over disjoint key sets (cascade attention).

    Args:
      out_a: ``Float[Array, "batch T heads head_dim"]`` one side's output
        (zeros where it saw nothing, as :func:`attend_with_lse` returns).
      lse_a: ``Float32[Array, "batch T heads"]`` its log-sum-exp (-inf: empty).
      out_b: the other side's output.
      lse_b: the other side's log-sum-exp.

    Returns:
      ``(out, lse)`` equal to attention over the union of the keys; zeros and
      ``-inf`` where both sides are empty, never NaN.

    Example:
      Attention over 8 keys is the merge of attention over the first 5 and over the last 3:

      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 8, 2, 4))
      >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 4))
      >>> def cache(rows):
      ...     kv = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=8)
      ...     return kv.append((k[:, rows], v[:, rows])).view()
      >>> merged, _ = jss.merge_attention(*jss.attend_with_lse(q, cache(slice(0, 5)), causal=False),
      ...                                 *jss.attend_with_lse(q, cache(slice(5, 8)), causal=False))
      >>> bool(jnp.allclose(merged, jss.attend(q, cache(slice(0, 8)), causal=False), atol=1e-5))
      True
    """
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = (weight_a[..., None] * out_a.astype(_F32) + weight_b[..., None] * out_b.astype(_F32)) / total[..., None]
    return out.astype(out_a.dtype), jnp.where(seen, top + jnp.log(total), -jnp.inf)
