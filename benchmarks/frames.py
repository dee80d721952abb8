"""Video world-model frames: a denoising step over append and ring caches: ``python -m benchmarks.frames``.

A video world model (Self-Forcing, CausVid) generates a frame of N tokens in a
few denoising steps; each step writes the frame's K/V tentatively, attends
block-causally (every query sees its whole frame and everything before it)
and drops them.  Measured here, batch 1, 8 heads x 64, one jitted, donated
step per denoising step (``stage`` the frame, replacing the last step's, and
``attend(..., frame=N)``), contenders alternating in one run:

- N in {64, 256} x past in {2k, 8k}, float32 and bfloat16, each over an
  append-mode cache (``past`` committed tokens) and over a ring that has
  wrapped (``sink=N``: one sink frame, ``window=past``), which read the same
  number of keys (N + past), against PyTorch eager over as many keys: a
  preallocated head-major tensor, an in-place ``copy_`` of the frame and
  ``scaled_dot_product_attention`` over the valid slice (bar <= 1.25);
- ring step / append step over the same number of keys (bar <= 1.15);
- T = 1 decode on a ring of a 4k window against the same keys in append mode
  (bar <= 1.15);
- a MaskGIT rollout (``examples/genie_dynamics.py``: axial blocks, 8 x 8
  positions, 4 passes per frame, random weights), its temporal K/V in a
  session: a frame decoded at frame 16 against one at frame 4 (flat: bar
  <= 1.2), and against the same model recomputing its 16 frames of context
  at every pass (bar <= 0.2);
- an axial temporal step (16 x 16 positions, 16 frames of past): stage one
  frame's K/V per position and attend, with the batch shape ``(1, 256)``
  (``[B, P, T, heads, dim]`` payloads and queries) against the same cache
  allocated flat (``batch=256``, ``[B*P, T, ...]``) (bar <= 1.05).

Every native path this CPU runs is measured in a process of its own (as
``benchmarks.attention`` does), PyTorch held to the same instruction set.

Run:  python -m benchmarks.frames [--full]
      python -m benchmarks.frames --one-path [--full]   (this process's path; JSS_NATIVE_ISA picks it)
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_session_state as jss
from benchmarks import _attention_parts as parts
from benchmarks._attention_parts import (
    NO_TORCH,
    cpu_description,
    load_torch,
    randn,
    relative_error,
    row,
    rows_on_path,
    timed,
    torch_candidates,
    torch_reference,
)
from benchmarks._common import cli, native_paths, with_lengths
from examples import genie_dynamics as genie
from jax_session_state._core import _library

BATCH, HEADS, HEAD_DIM = 1, 8, 64
FRAMES = (64, 256)
PASTS = (2048, 8192)
DECODE_WINDOW = 4096
BARS = {"torch": 1.25, "ring_vs_append": 1.15, "decode": 1.15, "maskgit_flat": 1.2, "maskgit_vs_recompute": 0.2,
        "axial": 1.05}
MASKGIT_FRAMES = (4, 16)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@functools.partial(jax.jit, donate_argnums=0)
def denoising_step(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jss.KVCache, jax.Array]:
    """Stage the frame (replacing the last step's), attend with the frame mask: the documented pattern."""
    staged = cache.stage((k, v))
    return staged, jss.attend(q, staged.view(), frame=q.shape[1])


@functools.partial(jax.jit, donate_argnums=0)
def _filled(cache: jss.KVCache, k: jax.Array, v: jax.Array) -> jss.KVCache:
    return cache.append((k, v))


def append_cache(past: int, n: int, dtype: Any) -> jss.KVCache:
    """An append-mode cache holding ``past`` random committed tokens, room for one frame more."""
    cache = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=past + n, dtype=dtype)
    rows = jnp.asarray(randn(2, BATCH, past, HEADS, HEAD_DIM), dtype)
    return _filled(cache, rows[0], rows[1])


def ring_cache(past: int, n: int, dtype: Any) -> jss.KVCache:
    """A ring of one sink frame and a window of ``past`` tokens that has wrapped (2 x past + n tokens seen)."""
    cache = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, window=past, sink=n,
                                 max_staged=n, dtype=dtype)
    rows = jnp.asarray(randn(2, BATCH, n, HEADS, HEAD_DIM), dtype)
    for _ in range(2 * past // n + 1):
        cache = _filled(cache, rows[0], rows[1])
    return cache


def torch_frame(k_cache: Any, v_cache: Any, past: int, q: Any, k: Any, v: Any) -> Any:
    """PyTorch eager: the frame copied in place after ``past`` keys, SDPA over them all (no mask needed)."""
    n = q.shape[1]
    k_cache[:, :, past:past + n].copy_(k.transpose(1, 2))
    v_cache[:, :, past:past + n].copy_(v.transpose(1, 2))
    out = parts.torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache[:, :, :past + n], v_cache[:, :, :past + n]
    )
    return out.transpose(1, 2)


def _torch_call(past: int, n: int, dtype_name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray):
    torch = parts.torch
    dtype = getattr(torch, dtype_name)
    k_cache, v_cache = (torch.from_numpy(randn(BATCH, HEADS, past + n, HEAD_DIM)).to(dtype) for _ in range(2))
    qt, kt, vt = (torch.from_numpy(x).to(dtype) for x in (q, k, v))

    def call():
        with torch.inference_mode():
            return torch_frame(k_cache, v_cache, past, qt, kt, vt)

    return call


def frame_rows(n: int, past: int, dtype_name: str, rounds: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    q, k, v = (randn(BATCH, n, HEADS, HEAD_DIM) for _ in range(3))
    qj, kj, vj = (jnp.asarray(x, dtype) for x in (q, k, v))
    caches = {"append": append_cache(past, n, dtype), "ring": ring_cache(past, n, dtype)}

    def stepping(mode: str):
        def call():
            caches[mode], out = denoising_step(caches[mode], qj, kj, vj)
            return out.block_until_ready()

        return call

    candidates = {mode: stepping(mode) for mode in caches}
    if parts.torch is not None:
        candidates |= torch_candidates(_torch_call(past, n, dtype_name, q, k, v))
    t = timed(candidates, rounds)
    case = f"N={n}, past {past}, {dtype_name}"
    rows = [row("frames", f"ring / append step, {case}", t["ring"] * 1e6, t["append"] * 1e6, "us",
                bar=BARS["ring_vs_append"])]
    if parts.torch is None:
        return rows + [row("frames", f"{mode} step, {case}", t[mode] * 1e6, None, "us", note=NO_TORCH)
                       for mode in caches]
    reference, note = torch_reference(t)
    return rows + [row("frames", f"{mode} / torch, {case}", t[mode] * 1e6, reference * 1e6, "us",
                       bar=BARS["torch"], note=note) for mode in caches]


def decode_rows(rounds: int) -> list[dict]:
    """T = 1 on a ring of a 4k window (one sink token) against the same keys in append mode."""
    q, k, v = (jnp.asarray(randn(BATCH, 1, HEADS, HEAD_DIM)) for _ in range(3))
    ring = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, window=DECODE_WINDOW, sink=1,
                                max_staged=64)
    chunk = jnp.asarray(randn(2, BATCH, 64, HEADS, HEAD_DIM))
    for _ in range(2 * DECODE_WINDOW // 64):
        ring = _filled(ring, chunk[0], chunk[1])
    caches = {"ring": ring, "append": append_cache(DECODE_WINDOW, 1, jnp.float32)}

    def stepping(mode: str):
        def call():
            caches[mode], out = denoising_step(caches[mode], q, k, v)
            return out.block_until_ready()

        return call

    t = timed({mode: stepping(mode) for mode in caches}, rounds)
    return [row("decode", f"T=1, ring of a {DECODE_WINDOW} window / append, same keys", t["ring"] * 1e6,
                t["append"] * 1e6, "us", bar=BARS["decode"])]


def maskgit_rows(rounds: int) -> list[dict]:
    """Per-frame time of a MaskGIT rollout with its temporal K/V in a session, at frames 4 and 16, and recomputing.

    Each timed call decodes frame ``f`` from a session rewound to ``f``
    committed frames (every call writes the same rows), or from the
    recomputing sampler's buffer holding ``f`` frames.
    """
    early, late = MASKGIT_FRAMES
    config = genie.GenieConfig(max_frames=late + 1)
    model = genie.Dynamics(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens, actions = genie.sprite_scene(jax.random.key(0), config, config.max_frames)
    session = jax.jit(lambda p: genie.prompt_session(nnx.merge(graphdef, p), tokens[:, :late], actions[:, :late]))(
        params)
    buffer, actions_buffer = genie.recompute_buffers(config, tokens[:, :late], actions)

    @functools.partial(jax.jit, donate_argnums=1)
    def cached(params, session, index):
        session = jss.Session(objects={name: with_lengths(session[name], index) for name in session.objects})
        return genie.decode_frame(nnx.merge(graphdef, params), session, actions[:, index], index)

    @jax.jit
    def recomputed(params, buffer, index):
        return genie.recompute_frame(nnx.merge(graphdef, params), buffer, actions_buffer, index)

    state = {"session": session, "buffer": buffer}

    def with_session(frame: int):
        def call():
            state["session"], out = cached(params, state["session"], jnp.asarray(frame))
            return out.block_until_ready()

        return call

    def recomputing():
        _, out = recomputed(params, state["buffer"], jnp.asarray(late))  # not donated: the buffer is kept
        return out.block_until_ready()

    first = with_session(late)()
    assert np.array_equal(first, recomputing()), "the session and recomputing decoded different tokens"
    t = timed({"early": with_session(early), "late": with_session(late), "recompute": recomputing}, rounds)
    case = f"{config.positions} positions, {config.steps} passes, {config.layers} blocks"
    return [
        row("maskgit", f"frame {late} / frame {early} with the session, {case}", t["late"] * 1e6, t["early"] * 1e6,
            "us", bar=BARS["maskgit_flat"]),
        row("maskgit", f"session / recomputing at frame {late}, {case}", t["late"] * 1e6, t["recompute"] * 1e6,
            "us", bar=BARS["maskgit_vs_recompute"]),
    ]


AXIAL_POSITIONS, AXIAL_PAST = 256, 16


@functools.partial(jax.jit, donate_argnums=0)
def temporal_step(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jss.KVCache, jax.Array]:
    """Stage one frame's K/V per position (replacing the last pass's) and attend causally across frames."""
    staged = cache.stage((k, v))
    return staged, jss.attend(q, staged.view())


def axial_rows(rounds: int) -> list[dict]:
    """The temporal step with leading batch axes ``(1, P)`` against the same cache allocated flat (``P`` rows)."""
    batches = {"axes": (1, AXIAL_POSITIONS), "flat": (AXIAL_POSITIONS,)}
    past = jnp.asarray(randn(2, AXIAL_POSITIONS, AXIAL_PAST, HEADS, HEAD_DIM))
    frame = jnp.asarray(randn(3, AXIAL_POSITIONS, 1, HEADS, HEAD_DIM))
    state, outputs = {}, {}
    for name, batch in batches.items():
        cache = jss.KVCache.allocate(batch=batch if len(batch) > 1 else batch[0], kv_heads=HEADS,
                                     head_dim=HEAD_DIM, capacity=AXIAL_PAST + 1)
        shape = lambda x, batch=batch: x.reshape(*batch, *x.shape[1:])  # noqa: E731 - the layout under test
        state[name] = (_filled(cache, shape(past[0]), shape(past[1])), *(shape(x) for x in frame))

    def stepping(name: str):
        def call():
            cache, q, k, v = state[name]
            cache, out = temporal_step(cache, q, k, v)
            state[name] = (cache, q, k, v)
            outputs[name] = out
            return out.block_until_ready()

        return call

    candidates = {name: stepping(name) for name in batches}
    for call in candidates.values():
        call()
    np.testing.assert_array_equal(np.asarray(outputs["axes"]).reshape(outputs["flat"].shape), outputs["flat"])
    t = timed(candidates, rounds)
    case = f"{AXIAL_POSITIONS} positions, {AXIAL_PAST} frames past, stage + attend"
    return [row("axial", f"batch shape (1, {AXIAL_POSITIONS}) / flat batch {AXIAL_POSITIONS}, {case}",
                t["axes"] * 1e6, t["flat"] * 1e6, "us", bar=BARS["axial"])]


def check_against_reference() -> None:
    """The step's output over a wrapped ring equals float64 attention over the keys it should see."""
    n, past = 64, 256
    cache = ring_cache(past, n, jnp.float32)
    q, k, v = (jnp.asarray(randn(BATCH, n, HEADS, HEAD_DIM)) for _ in range(3))
    view = cache.stage((k, v)).view()
    keys, values, positions = (np.asarray(x, np.float64) for x in (view.k, view.v, view.positions))
    end = int(view.lengths[0]) - 1
    seen = (positions[0] >= 0) & (positions[0] < view.lengths[0]) & (
        (positions[0] < n) | (end - positions[0] < past))
    assert seen.sum() == n + past, seen.sum()
    scores = np.einsum("thd,hkd->thk", np.asarray(q[0], np.float64), keys[0][:, seen]) / np.sqrt(HEAD_DIM)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    reference = np.einsum("thk,hkd->thd", weights / weights.sum(-1, keepdims=True), values[0][:, seen])
    _, out = denoising_step(cache, q, k, v)
    assert relative_error(out[0], reference) < 1e-5


def one_path(*, full: bool) -> list[dict]:
    """Every row on this process's native path."""
    load_torch()
    check_against_reference()
    rounds = 15 if full else 7
    rows = [r for dtype in DTYPES for n in FRAMES for past in PASTS for r in frame_rows(n, past, dtype, rounds)]
    return rows + decode_rows(rounds) + maskgit_rows(rounds) + axial_rows(rounds)


def run(*, full: bool) -> list[dict]:
    """Every row on every native path this CPU runs, each in a fresh process."""
    print(f"CPU: {cpu_description()}")
    return [r for path in native_paths() for r in rows_on_path("benchmarks.frames", path, full=full, one_path=True)]


if __name__ == "__main__":
    if "--one-path" in sys.argv[1:]:
        jax.config.update("jax_cpu_enable_async_dispatch", False)  # as in benchmarks.attention
        results = one_path(full="--full" in sys.argv[1:])
        for r in results:
            r["path"] = _library.ISA if _library.enabled() else "pure JAX"
        print(json.dumps(results, default=float))
    else:
        cli("frames", run, __doc__)
