"""A ring view (a ``KVCache`` with ``window=W, sink=S``) read where it lies.

Position ``p < S`` lies in slot ``p``, a later one in slot
``S + (p - S) % R`` (``R = slots - S``).  A row shows its sinks below
``lengths`` and a window ``window_start .. lengths - 1`` of consecutive
positions, so its visible keys are at most three contiguous runs of the
storage: the sinks, the window up to the ring's end, and (once the window
wraps) the rest of it from slot ``S``.  ``window_start`` is ``lengths``
less the window positions ``positions`` shows: a count over that small
integer array, no key or value read.

- ``"native"`` (``"auto"`` on CPU): the native kernel reads the sinks and
  the window by position where they lie, in one call (its chunks merged
  by log-sum-exp, split over XLA's threads for a large step).
- ``"loop"``: each run block by block from its first slot, one online
  softmax across the three (a dynamic slice per block; of each batch row's
  own slot where rows differ).
- ``"bucketed"`` (and ``"pallas"``, which has no ring kernel yet; ``"auto"``
  off CPU): each run in one pass over a static power-of-two bucket of
  slots from its first, picked by ``lax.switch``, in chunks where its
  scores would pass ``BUCKET_SCORE_BYTES``.

Masks are by position, as for every view: a query at ``qp`` sees ``p`` when
``p < lengths``, ``p <= qp`` if causal, and ``p < S or qp - p < W``.  A
float ring's attention has a ``jax.custom_vjp``: its backward is the VJP of
the bucketed reader, recomputed (no reader keeps its scores), so
``jax.grad`` works under ``jit`` and ``vmap`` whichever reader ran forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from jax_session_state.attention import _native
from jax_session_state.attention._bucketed import buckets, chunk_units
from jax_session_state.attention._choice import by_platform, native_or
from jax_session_state.attention._key_blocks import append_block, block_f32, block_scales
from jax_session_state.attention._operands import checked_scale, query_positions
from jax_session_state.attention._softmax import F32, empty_state, finish, online_update, scores, to_rows
from jax_session_state.objects.kv import KVView

Run = tuple[Array, Array, Array, bool]
"""``(first slot, first position, keys, windowed)``, each ``Int[Array, "batch"]``: keys of a run lie in order
from its first slot; ``windowed``: the window's mask applies (not the sinks')."""


def read(q: Array, view: KVView, causal: bool, scale: float | None, q_positions: Array | None,
         implementation: str) -> tuple[Array, Array]:
    """A ring view read where it lies by the reader ``implementation`` picks here (``_choice``).

    ``q_positions`` None means the last ``T`` positions.  Returns
    ``(out, lse)`` as ``attend_with_lse``.
    """
    _, scale = checked_scale(q, view.k, scale)
    scale = float(scale)
    implementation = native_or(q, view.k, view.v, implementation, quantized=view.quantized)
    starts = window_start(view)
    relative = implementation == "native" and q_positions is None
    positions = query_positions(q, view.lengths, q_positions, relative)
    ring = {"k": view.k, "v": view.v, "lengths": view.lengths, "starts": starts}
    if view.quantized:
        ring.update(k_scale=view.k_scale, v_scale=view.v_scale)
    options = dict(causal=causal, scale=scale, sink=view.sink, window=view.window)

    def absolute(positions: Array, ring: dict[str, Array]) -> Array:  # the pure readers take absolute positions
        return ring["lengths"][:, None] + positions if relative else positions

    def native(q: Array, positions: Array, ring: dict[str, Array]) -> tuple[Array, Array]:
        return _native.ring_kernel(q, ring["k"], ring["v"], ring.get("k_scale"), ring.get("v_scale"), ring["starts"],
                                   ring["lengths"], positions, relative=relative, **options)

    def loop(q: Array, positions: Array, ring: dict[str, Array]) -> tuple[Array, Array]:
        return _read_runs(q, absolute(positions, ring), ring, **options, bucketed=False)

    def bucketed(q: Array, positions: Array, ring: dict[str, Array]) -> tuple[Array, Array]:
        return _read_runs(q, absolute(positions, ring), ring, **options, bucketed=True)

    def forward(q: Array, positions: Array, ring: dict[str, Array]) -> tuple[Array, Array]:
        return by_platform(implementation, loop, bucketed, q, positions, ring,
                           native=native if implementation == "native" else None)

    if view.quantized:
        return forward(q, positions, ring)
    return _with_bucketed_vjp(forward, bucketed)(q, positions, ring)


def window_start(view: KVView) -> Array:
    """``Int[Array, "batch"]`` the first window position each row of a ring view shows (``lengths`` if none)."""
    return (view.lengths - jnp.sum(view.positions >= view.sink, axis=-1)).astype(jnp.int32)


def _runs(lengths: Array, starts: Array, *, sink: int, slots: int) -> list[Run]:
    """The sinks and the window of each row as runs of slots: the window up to the ring's end, then from its start.

    The window starts no lower than the sinks' end and holds no more than
    the ring's ``slots - sink`` positions (as the native kernel clips it).
    """
    ring = slots - sink
    end = jnp.maximum(lengths, 0).astype(jnp.int32)
    held = jnp.minimum(end, jnp.maximum(jnp.maximum(starts, sink), end - ring))
    slot = sink + (held - sink) % ring
    keys = end - held
    first_part = jnp.minimum(keys, slots - slot)
    zeros = jnp.zeros_like(end)
    return [(zeros, zeros, jnp.minimum(end, sink), False), (slot, held, first_part, True),
            (zeros + sink, held + first_part, keys - first_part, True)]


def _read_runs(q: Array, q_positions: Array, ring: dict[str, Array], *, causal: bool, scale: float, sink: int,
               window: int, bucketed: bool) -> tuple[Array, Array]:
    """The runs of a ring read block by block (``bucketed``: in one static bucket each), one online softmax."""
    k, v = ring["k"], ring["v"]
    kv_heads, slots = k.shape[1], k.shape[2]
    qh = to_rows(q, kv_heads)
    query_position = jnp.repeat(q_positions, q.shape[2] // kv_heads, axis=1)[:, None, :, None]  # [B, 1, M, 1]
    one = lax.optimization_barrier(jnp.ones((), F32))  # fuses V's copy into a vectorised multiply (NOTES.md)

    def read(state: Any, run: Run, i: Array | int, n: int) -> Any:
        """Keys ``[i * n, (i + 1) * n)`` of ``run`` (the block moved back to end inside the storage; the keys it
        repeats, and those past the run, masked)."""
        first_slot, first_position, count, windowed = run
        offset = i * n
        start = jnp.clip(first_slot + offset, 0, slots - n)
        key = (start - first_slot)[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, n]: keys into the run
        key_position = (first_position[:, None] + key)[:, None, None, :]
        visible = ((key >= offset) & (key < count[:, None]))[:, None, None, :]
        if causal:
            visible &= key_position <= query_position
        if windowed:
            visible &= query_position - key_position < window
        block_scores = scores(_rows_from(k, start, n, block_f32) * scale, qh)
        values = _rows_from(v, start, n, block_f32) * one
        if "k_scale" not in ring:
            return online_update(state, block_scores, visible, values)
        block_scores = block_scores * _rows_from(ring["k_scale"], start, n, block_scales)
        return online_update(state, block_scores, visible, values,
                             _rows_from(ring["v_scale"], start, n, block_scales))

    state = empty_state(qh)
    n = append_block(k, ring.get("k_scale"))
    for run in _runs(ring["lengths"], ring["starts"], sink=sink, slots=slots):
        if bucketed:
            state = _bucket(state, run, read, slots=slots, score_rows=qh.shape[0] * qh.shape[1] * qh.shape[2])
        else:
            state = lax.fori_loop(0, jnp.max(-(-run[2] // n)), lambda i, state, run=run: read(state, run, i, n),
                                  state)
    return finish(q, state)


def _bucket(state: Any, run: Run, read: Callable[..., Any], *, slots: int, score_rows: int) -> Any:
    """``run`` read in one pass over the smallest static bucket of slots holding every row's keys (``lax.switch``),
    in chunks of a static loop where its scores would pass ``BUCKET_SCORE_BYTES``."""
    sizes = buckets(slots)
    chunk = chunk_units(score_rows, 1)

    def branch(n: int) -> Callable[[Any], Any]:
        if n <= chunk:
            return lambda state: read(state, run, 0, n)

        @jax.checkpoint  # a VJP keeps each chunk's state, not its scores
        def step(i: Array, state: Any) -> Any:
            return read(state, run, i, chunk)

        return lambda state: lax.fori_loop(0, -(-n // chunk), step, state)

    index = jnp.sum(jnp.max(run[2]) > jnp.asarray(sizes[:-1], jnp.int32))
    return lax.switch(index, [branch(n) for n in sizes], state)


def _rows_from(cache: Array, start: Array, n: int, block: Callable[..., Array]) -> Array:
    """``block(cache, start, n)`` with ``start`` per batch row (one slice where there is one row)."""
    if cache.shape[0] == 1:
        return block(cache, start[0], n)
    return jax.vmap(lambda rows, first: block(rows[None], first, n)[0])(cache, start)


def _with_bucketed_vjp(forward: Callable[..., tuple[Array, Array]], bucketed: Callable[..., tuple[Array, Array]]
                       ) -> Callable[..., tuple[Array, Array]]:
    """``forward(q, q_positions, ring)`` with the VJP of ``bucketed`` (the same arguments; recomputed) for ``q``,
    ``k`` and ``v``."""

    @jax.custom_vjp
    def attend(q: Array, q_positions: Array, ring: dict[str, Array]) -> tuple[Array, Array]:
        return forward(q, q_positions, ring)

    def attend_forward(q: Array, q_positions: Array, ring: dict[str, Array]) -> Any:
        return forward(q, q_positions, ring), (q, q_positions, ring)

    def attend_backward(residuals: Any, cotangents: tuple[Array, Array]) -> Any:
        q, q_positions, ring = residuals
        k, v = ring["k"], ring["v"]

        def differentiable(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
            return bucketed(q, q_positions, {**ring, "k": k, "v": v})

        _, vjp = jax.vjp(differentiable, q, k, v)
        dq, dk, dv = vjp(cotangents)
        return dq, None, {**jax.tree_util.tree_map(lambda _: None, ring), "k": dk, "v": dv}

    attend.defvjp(attend_forward, attend_backward)
    return attend
