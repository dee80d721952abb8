"""Reads cost what is valid: ``jss.attend`` against capacity, PyTorch eager and flax nnx.

Measures, in one run (batch 1, 8 query heads over 8 kv-heads x 64, float32):

(a) ``attend`` over a 32k-capacity cache holding 1k tokens against a
    1k-capacity cache holding the same tokens (bar <= 1.5);
(b) a jitted, donated rollout step (``KVCache.append`` of T tokens +
    ``attend`` on ``cache.view()``) at capacity 32k as the valid length grows
    to 4k, T = 16 and T = 1, against PyTorch eager with a preallocated
    head-major cache, an in-place ``copy_`` and ``scaled_dot_product_attention``
    over the valid prefix (bar <= 2.0, goal <= 1.0); PyTorch also on one
    thread, for the same-core comparison; where the native CPU kernel is
    built, the same step with the pure-JAX loop in the same rounds; and whole
    rollouts: the step in a Python loop and as one ``lax.scan``;
(c) a one-token decode step with projections against
    ``flax.nnx.MultiHeadAttention(decode=True)`` at capacity 8k (bar <= 0.1);
(d) where the step's time goes (profiled per XLA op: the native kernel's
    one call; or, for the pure loop, K/V block copies, matmuls, softmax,
    writes, loop overhead), each against its ceiling measured in the same
    run (XLA's best batched matmul for the block shapes, copy bandwidth, one
    fused pass of the softmax arithmetic), and PyTorch's attention rate; the
    cost of an empty jitted step;
(e) the physical limit: bytes that must move per step (valid K/V read once
    + rows written) over the measured copy bandwidth;
(f) peak resident memory of a donated 32k rollout in a fresh process
    (launched through ``sh -c``) against its logical cache bytes + the
    process's baseline (bar <= 1.25).

Steps timed at a fixed valid length append after it and then rewind the
length (one integer, inside the same jitted call), so every call writes the
same rows; PyTorch's step writes the same rows in place.  JAX dispatches
synchronously here (``jax_cpu_enable_async_dispatch=False``, set before the
CPU backend starts), as PyTorch eager runs: a step loop that waits for each
step's output gains nothing from asynchronous dispatch, whose hand-off to the
runtime's thread and back cost 20-40 us per call on 2 cores, as much as
PyTorch's whole step over an empty cache.  Timings interleave
the candidates round by round with a pause between them (so one runtime's
worker threads are idle while the other runs), take the fastest of a few
calls per round and the median over rounds.  PyTorch is optional
(``pip install torch``); without it its rows are skipped with a message.

Run:  python -m benchmarks.attention [--full] [--out PATH]
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_session_state as jss
from benchmarks._common import cli, interleaved, with_lengths
from jax_session_state import _native

torch: Any = None  # PyTorch, an optional benchmark dependency: imported by main(), not by the memory child

BATCH, HEADS, HEAD_DIM = 1, 8, 64
CAPACITY, NNX_CAPACITY = 32768, 8192
FLOAT = 4  # bytes
BARS = {"capacity": 1.5, "step": 2.0, "nnx": 0.1, "memory": 1.25}
NATIVE_CALL = "native kernel (one FFI call)"
NO_TORCH = "skipped: PyTorch is not installed (pip install torch==2.13.0)"
RNG = np.random.default_rng(0)


def _randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _timed(candidates: dict[str, Any], rounds: int, calls: int = 5) -> dict[str, float]:
    return interleaved(candidates, rounds=rounds, repeat=calls, best_of=True, pause=0.005)


def _row(part: str, case: str, measured: float, reference: float | None, unit: str, **extra: Any) -> dict:
    ratio = None if reference in (None, 0) else measured / reference
    row = {"part": part, "case": case, "measured": measured, "reference": reference, "unit": unit, "ratio": ratio}
    # For the runner's table: a row with a bar shows its ratio, any other its measurement.
    row.update({"measure": f"{part}: {case}", "value": ratio} if "bar" in extra else
               {"measure": f"{part}: {case} ({unit})", "value": measured})
    if "bar" in extra:
        row["holds"] = ratio is not None and ratio <= extra["bar"]
        extra["bar"] = f"≤ {extra['bar']}"
    return {**row, **extra}


def _filled_cache(capacity: int, rows: np.ndarray) -> jss.KVCache:
    """A cache of ``capacity`` holding ``rows[0]`` as K and ``rows[1]`` as V (each ``[1, n, H, D]``)."""
    cache = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity)
    if rows.shape[2] == 0:
        return cache
    return cache.append(jss.KVChunk(jnp.asarray(rows[0]), jnp.asarray(rows[1])))


# ------------------------------------------------------------------ the steps
def _step(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jss.KVCache, jax.Array]:
    """One rollout step: append T rows, attend the T queries over the cache."""
    cache = cache.append(jss.KVChunk(k, v))
    return cache, jss.attend(q, cache.view())


def _step_in_place(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array):
    """:func:`_step`, then the length rewound: every call writes the same rows."""
    cache, out = _step(cache, q, k, v)
    return with_lengths(cache, cache.lengths - q.shape[1]), out


step_in_place = jax.jit(_step_in_place, donate_argnums=0)
step = jax.jit(_step, donate_argnums=0)
pure_step_in_place = jax.jit(lambda *args: _step_in_place(*args), donate_argnums=0)  # its own trace cache


def pure_kernel(fn):
    """``fn`` traced (at its first call) without the native kernel: the pure-JAX loop."""

    def run(*args):
        with _native.use(False):
            return fn(*args)

    return run


@functools.partial(jax.jit, donate_argnums=0)
def scan_rollout(cache: jss.KVCache, qs: jax.Array, ks: jax.Array, vs: jax.Array):
    """A whole rollout as one ``lax.scan`` over steps (donated carry)."""
    return lax.scan(lambda c, x: _step(c, *x), cache, (qs, ks, vs))


@functools.partial(jax.jit, donate_argnums=0)
def empty_step(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array):
    """The same arguments and results as a step, no work: the cost of calling a jitted step."""
    return cache, q


def torch_step(k_cache, v_cache, length: int, q, k, v):
    """PyTorch eager: in-place copy of the new rows, SDPA over the valid prefix (head-major)."""
    T = q.shape[1]
    k_cache[:, :, length:length + T].copy_(k.transpose(1, 2))
    v_cache[:, :, length:length + T].copy_(v.transpose(1, 2))
    valid = length + T
    mask = None if T == 1 else torch.ones(T, valid, dtype=torch.bool).tril(length)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache[:, :, :valid], v_cache[:, :, :valid], attn_mask=mask
    )
    return out.transpose(1, 2)


def _one_thread(fn):
    def run():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(threads)

    return run


def _torch_candidates(fn) -> dict[str, Any]:
    """PyTorch on its default threads and on one: on a busy machine its thread team can stall."""
    return {"torch": fn, "torch 1 thread": _one_thread(fn)}


def _torch_reference(t: dict[str, float]) -> tuple[float, str]:
    """The faster PyTorch configuration (seconds), and a note giving both."""
    default, one = t["torch"], t["torch 1 thread"]
    return min(default, one), (f"torch: {torch.get_num_threads()} threads {default * 1e6:.0f} us, "
                               f"1 thread {one * 1e6:.0f} us; reference the faster")


def _relative_error(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------- (a) capacity
def capacity_rows(rounds: int) -> list[dict]:
    rows = _randn(2, 1, 1024, HEADS, HEAD_DIM)
    big, small = _filled_cache(CAPACITY, rows).view(), _filled_cache(1024, rows).view()
    attend = jax.jit(jss.attend)
    out = []
    for T in (1, 16):
        q = jnp.asarray(_randn(BATCH, T, HEADS, HEAD_DIM))
        assert _relative_error(attend(q, big), attend(q, small)) < 1e-6
        t = _timed({"32k": lambda: attend(q, big).block_until_ready(),
                    "1k": lambda: attend(q, small).block_until_ready()}, rounds)
        out.append(_row("a", f"attend T={T}, 1k valid: capacity 32k vs 1k", t["32k"] * 1e6, t["1k"] * 1e6, "us",
                        bar=BARS["capacity"]))
    return out


# ------------------------------------------------------------------- (b) steps
class _Rollout:
    """A donated JAX cache and a PyTorch cache holding the same random rows."""

    def __init__(self, filled: int):
        rows = _randn(2, 1, filled, HEADS, HEAD_DIM)
        self.cache = _filled_cache(CAPACITY, rows)
        if torch is not None:
            self.torch_k, self.torch_v = (torch.zeros(BATCH, HEADS, CAPACITY, HEAD_DIM) for _ in range(2))
            for cache, r in zip((self.torch_k, self.torch_v), rows):
                cache[:, :, :filled] = torch.from_numpy(r).transpose(1, 2)

    def at(self, length: int) -> None:
        self.cache = with_lengths(self.cache, length)


def step_rows(T: int, lengths: list[int], rounds: int) -> list[dict]:
    state = _Rollout(max(lengths) + T)
    q, k, v = (_randn(BATCH, T, HEADS, HEAD_DIM) for _ in range(3))
    qj, kj, vj = map(jnp.asarray, (q, k, v))
    rows = []
    for length in lengths:
        state.at(length)

        def jax_call():
            state.cache, out = step_in_place(state.cache, qj, kj, vj)
            return out.block_until_ready()

        candidates = {"jax": jax_call}
        if _native.enabled():

            def pure_call():
                state.cache, out = pure_kernel(pure_step_in_place)(state.cache, qj, kj, vj)
                return out.block_until_ready()

            candidates["jax pure"] = pure_call
            assert _relative_error(pure_call(), jax_call()) < 1e-5
        if torch is not None:
            qt, kt, vt = map(torch.from_numpy, (q, k, v))

            def torch_call():
                with torch.inference_mode():
                    return torch_step(state.torch_k, state.torch_v, length, qt, kt, vt)

            candidates |= _torch_candidates(torch_call)
            error = _relative_error(jax_call(), torch_call().numpy())
            assert error < 1e-4, error
        t = _timed(candidates, rounds)
        case = f"step T={T}, valid {length} -> {length + T}"
        if "jax pure" in t:
            rows.append(_row("b", f"{case}: native kernel vs pure-JAX loop", t["jax"] * 1e6, t["jax pure"] * 1e6,
                             "us"))
        if torch is None:
            rows.append(_row("b", case, t["jax"] * 1e6, None, "us", note=NO_TORCH))
            continue
        reference, note = _torch_reference(t)
        rows.append(_row("b", case, t["jax"] * 1e6, reference * 1e6, "us", bar=BARS["step"], T=T, valid=length + T,
                         note=note, torch_default_us=t["torch"] * 1e6,
                         torch_one_thread_us=t["torch 1 thread"] * 1e6))
    return rows


def rollout_rows(T: int, tokens: int, rounds: int) -> list[dict]:
    """Whole rollouts 0 -> tokens: the jitted step in a Python loop, one lax.scan, PyTorch eager."""
    steps = tokens // T
    qs, ks, vs = (_randn(steps, BATCH, T, HEADS, HEAD_DIM) for _ in range(3))
    qsj, ksj, vsj = map(jnp.asarray, (qs, ks, vs))
    listed = [list(x) for x in (qsj, ksj, vsj)]
    state = _Rollout(0)
    start = time.perf_counter()
    scan_rollout.lower(state.cache, qsj, ksj, vsj).compile()
    compile_s = time.perf_counter() - start

    def loop():
        state.at(0)
        for i in range(steps):
            state.cache, out = step(state.cache, listed[0][i], listed[1][i], listed[2][i])
        out.block_until_ready()

    def scan():
        state.at(0)
        state.cache, outs = scan_rollout(state.cache, qsj, ksj, vsj)
        return outs.block_until_ready()

    candidates = {"loop": loop, "scan": scan}
    if torch is not None:
        qst, kst, vst = map(torch.from_numpy, (qs, ks, vs))

        def torch_rollout():
            with torch.inference_mode():
                return [torch_step(state.torch_k, state.torch_v, i * T, qst[i], kst[i], vst[i])
                        for i in range(steps)]

        candidates |= _torch_candidates(torch_rollout)
        assert _relative_error(scan(), np.stack([o.numpy() for o in torch_rollout()])) < 1e-4
    loop()  # compiles the step
    t = interleaved(candidates, rounds=rounds, repeat=1, pause=0.005)
    note = f"scan compiles in {compile_s:.1f} s; "
    reference = None
    if torch is None:
        note += NO_TORCH
    else:
        reference, torch_note = _torch_reference(t)
        reference, note = reference / steps * 1e6, note + torch_note + " (whole rollouts)"
    return [
        _row("b", f"rollout T={T}, 0 -> {tokens}: step loop, per step", t["loop"] / steps * 1e6, reference, "us",
             note=note),
        _row("b", f"rollout T={T}, 0 -> {tokens}: lax.scan, per step", t["scan"] / steps * 1e6, reference, "us",
             note=note),
    ]


# -------------------------------------------------------------------- (c) nnx
def nnx_rows(fills: list[int], rounds: int) -> list[dict]:
    """Per-token decode incl. projections against nnx.MultiHeadAttention(decode=True).

    Both sides run the same q/k/v/out projections (ours use the nnx module's
    weights), so the comparison isolates the cache write and the attention.
    """
    from flax import nnx

    features = HEADS * HEAD_DIM
    mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=features, qkv_features=features,
                                 out_features=features, decode=True, rngs=nnx.Rngs(0))
    mha.init_cache((BATCH, NNX_CAPACITY, features))
    graphdef, nnx_state = nnx.split(mha)
    weights = {name: (getattr(mha, name).kernel[...], getattr(mha, name).bias[...])
               for name in ("query", "key", "value", "out")}

    @functools.partial(jax.jit, donate_argnums=0)
    def nnx_step(state, x, fill):
        module = nnx.merge(graphdef, state)
        module.cache_index[...] = fill  # decode at this fill level
        return nnx.state(module), module(x)

    def project(name, x):
        kernel, bias = weights[name]
        return jnp.einsum("bte,ehd->bthd", x, kernel) + bias

    @functools.partial(jax.jit, donate_argnums=0)
    def our_step(cache, x, fill):
        cache = with_lengths(cache, fill)
        cache, out = _step(cache, project("query", x), project("key", x), project("value", x))
        kernel, bias = weights["out"]
        return cache, jnp.einsum("bthd,hde->bte", out, kernel) + bias

    ours = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=NNX_CAPACITY)
    xs = jnp.asarray(_randn(8, BATCH, 1, features))
    for i, x in enumerate(xs):  # the same decode from empty: same outputs
        ours, a = our_step(ours, x, jnp.int32(i))
        nnx_state, b = nnx_step(nnx_state, x, jnp.int32(i))
        assert _relative_error(a, b) < 1e-4
    box = {"ours": ours, "nnx": nnx_state}
    rows = []
    for fill in fills:
        fill_ = jnp.int32(fill)

        def call(name, fn):
            box[name], y = fn(box[name], xs[0], fill_)
            y.block_until_ready()

        t = _timed({"ours": functools.partial(call, "ours", our_step),
                    "nnx": functools.partial(call, "nnx", nnx_step)}, rounds)
        rows.append(_row("c", f"decode 1 token at fill {fill}, capacity 8k: ours vs nnx", t["ours"] * 1e6,
                         t["nnx"] * 1e6, "us", bar=BARS["nnx"]))
    return rows


# -------------------------------------------------------------- (d) breakdown
def _hlo_categories(hlo: str) -> dict[str, str]:
    """HLO instruction name -> what it does, for the ops of a compiled step.

    Inside the while body: a fusion that dynamic-slices the cache is a K/V
    block copy; the body's first dot is Q @ K^T and its second P @ V (data
    order); anything else in the body is the softmax and state update; the
    loop condition is loop overhead.  Outside: a fusion that updates the
    cache is the write; the rest prepares q and normalises the output.
    """
    computations, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            current = head.group(1)
            computations[current] = []
        elif line.startswith("}"):
            current = None
        elif current:
            computations[current].append(line)
    body_name = cond_name = None
    for line in hlo.splitlines():
        loop = re.search(r"while\(.*condition=%(\S+?), body=%(\S+?)[,\s]", line)
        if loop:
            cond_name, body_name = loop.groups()
    categories, dots = {}, 0
    for name, lines in computations.items():
        if name.startswith(("fused_", "wrapped_", "region_")) and name not in (body_name, cond_name):
            continue
        for line in lines:
            match = re.match(r"\s+(?:ROOT )?%(\S+) = (.*)$", line)
            op = match and re.search(r"([\w-]+)\((?:%|\)|\d)", match.group(2))
            if not op:
                continue
            op_name, op = match.group(1), op.group(1)
            callee = re.search(r"calls=%(\S+?)[,\s]", line)
            inner = "\n".join(computations.get(callee.group(1), [])) if callee else ""
            if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                continue
            if name == cond_name:
                categories[op_name] = "loop overhead"
            elif name == body_name:
                if op == "dot" or " dot(" in inner:  # a library dot, or a YNNPACK fusion around one
                    categories[op_name] = ("matmul Q@K^T", "matmul P@V")[min(dots, 1)]
                    dots += 1
                elif "dynamic-slice(" in inner:
                    categories[op_name] = "K/V block copy"
                else:
                    categories[op_name] = "softmax and state update"
            elif op == "while":
                categories[op_name] = "while"
            elif op == "custom-call" and _native.TARGET in line:
                categories[op_name] = NATIVE_CALL
            elif any(write in inner or op == write for write in ("dynamic-update-slice", "scatter")):
                categories[op_name] = "write (append)"
            else:
                categories[op_name] = "outside the loop (q layout, normalise)"
    return categories


def _profile(run, calls: int = 20) -> dict[str, float]:
    """Device time per call (us) of each XLA op name, from a jax.profiler trace."""
    run()
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                run()
        trace_file = next(Path(directory).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    times: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("ph") == "X":
            times[event["name"]] += event["dur"] / calls
    return times


def _best_matmul_gflops(equation: str, a: jax.Array, b: jax.Array, flops: int, rounds: int,
                        reps: int = 64) -> float:
    """XLA's rate for one batched matmul shape (``flops`` per product), operands in cache, no dispatch."""

    def loop(a, b):
        def body(i, acc):  # perturb the smaller operand so the dot is not hoisted out of the loop
            scale = 1 + i.astype(jnp.float32) * 1e-7
            x, y = (a * scale, b) if a.size <= b.size else (a, b * scale)
            return acc + jnp.einsum(equation, x, y)

        return lax.fori_loop(0, reps, body, jnp.zeros(jnp.einsum(equation, a, b).shape)).sum()

    fn = jax.jit(loop)
    seconds = _timed({"dot": lambda: fn(a, b).block_until_ready()}, rounds)["dot"]
    return flops * reps / seconds / 1e9


def copy_bandwidth(nbytes: int) -> float:
    """numpy copy bandwidth, bytes read + written per second (fastest of 7)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / min(times)


def breakdown_rows(T: int, length: int, rounds: int, bandwidth: float, kernel: str) -> list[dict]:
    """Where a step at ``length`` valid tokens spends its time, each piece against its ceiling.

    ``kernel``: "native" (the step as ``jss.attend`` runs it here) or "pure"
    (the pure-JAX loop, traced without the native kernel).
    """
    state = _Rollout(length + T)
    state.at(length)
    q, k, v = (jnp.asarray(_randn(BATCH, T, HEADS, HEAD_DIM)) for _ in range(3))
    fn = step_in_place if kernel == "native" else pure_kernel(pure_step_in_place)

    def call(fn):
        state.cache, out = fn(state.cache, q, k, v)
        out.block_until_ready()

    with _native.use(kernel == "native"):
        hlo = (step_in_place if kernel == "native" else pure_step_in_place).lower(state.cache, q, k, v)
        categories = _hlo_categories(hlo.compile().as_text())
    profiled = _profile(functools.partial(call, fn))
    by_category: dict[str, float] = defaultdict(float)
    for name, us in profiled.items():
        if name in categories:
            by_category[categories[name]] += us
    inside = sum(us for c, us in by_category.items() if c not in ("while", "write (append)", NATIVE_CALL)
                 and not c.startswith("outside"))
    if "while" in by_category:
        by_category["loop overhead"] += by_category.pop("while") - inside  # the while's time between its ops
    t = _timed({"step": functools.partial(call, fn), "empty": functools.partial(call, empty_step)}, rounds)
    # Tracing slows every op down; scale the profiled times to the step's untraced wall clock time.
    profiled_total = sum(by_category.values())
    scale = t["step"] * 1e6 / profiled_total
    label = f"T={T} {kernel}"
    rows = [_row("d", f"{label} valid {length + T}: whole step (wall clock)", t["step"] * 1e6, None, "us"),
            _row("d", f"{label}: an empty jitted step with the same arguments", t["empty"] * 1e6, None, "us",
                 note="dispatch cost, not subtracted"),
            _row("d", f"{label}: all ops, profiled (traced)", profiled_total, None, "us",
                 note=f"the rows below are profiled times x {scale:.2f}, to add up to the untraced step")]
    if kernel == "native":
        us = by_category.get(NATIVE_CALL, 0.0) * scale
        flops = 4 * BATCH * HEADS * T * (length + T) * HEAD_DIM
        moved = 2 * BATCH * HEADS * (length + T) * HEAD_DIM * FLOAT
        rows.append(_row("d", f"{label}: {NATIVE_CALL}", us, moved / bandwidth * 1e6, "us",
                         note=f"{flops / us / 1e3:.0f} GFLOP/s; ceiling: K/V read once at the copy bandwidth"))
        for category in ("write (append)", "outside the loop (q layout, normalise)"):
            rows.append(_row("d", f"{label}: {category}", by_category.get(category, 0.0) * scale, None, "us"))
        return rows

    block = jss.attention.BLOCK_SIZE
    blocks = -(-(length + T) // block)
    M = T  # query rows per kv head (no GQA here)
    flops_per_block = 2 * BATCH * HEADS * M * block * HEAD_DIM  # each of Q@K^T and P@V
    flops = flops_per_block * blocks
    shapes = {
        "matmul Q@K^T": ("bhmd,bhnd->bhmn", (BATCH, HEADS, M, HEAD_DIM), (BATCH, HEADS, block, HEAD_DIM)),
        "matmul P@V": ("bhmn,bhnd->bhmd", (BATCH, HEADS, M, block), (BATCH, HEADS, block, HEAD_DIM)),
    }
    for category in ("K/V block copy", "matmul Q@K^T", "matmul P@V", "softmax and state update", "loop overhead",
                     "write (append)", "outside the loop (q layout, normalise)"):
        us = by_category.get(category, 0.0) * scale
        ceiling, note = None, ""
        if category in shapes:
            equation, a, b = shapes[category]
            best = _best_matmul_gflops(equation, jnp.asarray(_randn(*a)), jnp.asarray(_randn(*b)), flops_per_block,
                                       rounds)
            ceiling = flops / best / 1e3
            note = f"{flops / us / 1e3:.0f} GFLOP/s of XLA's best {best:.0f} for this shape"
        elif category == "K/V block copy":
            copied = 2 * 2 * BATCH * HEADS * block * HEAD_DIM * FLOAT * blocks  # K and V, read + written
            ceiling = copied / bandwidth * 1e6
            note = f"{copied / us / 1e3:.1f} GB/s (r+w) of {bandwidth / 1e9:.1f} copy bandwidth"
        elif category == "softmax and state update":
            ceiling = _softmax_once_us(T, blocks * block, rounds)
            note = "ceiling: one fused pass over all the scores"
        elif category == "loop overhead":
            note = f"{us / blocks:.1f} us per iteration, {blocks} iterations"
        rows.append(_row("d", f"{label}: {category}", us, ceiling, "us", note=note))
    if torch is not None:
        qt, kt, vt = (torch.from_numpy(_randn(BATCH, HEADS, n, HEAD_DIM)) for n in (T, length + T, length + T))
        mask = None if T == 1 else torch.ones(T, length + T, dtype=torch.bool).tril(length)

        def sdpa():
            with torch.inference_mode():
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

        seconds, _ = _torch_reference(_timed(_torch_candidates(sdpa), rounds))
        rate = 4 * BATCH * HEADS * T * (length + T) * HEAD_DIM / seconds / 1e9
        rows.append(_row("d", f"T={T}: torch SDPA alone (attention, no write)", seconds * 1e6, None, "us",
                         note=f"{rate:.0f} GFLOP/s (the faster of default threads and 1 thread)"))
    return rows


def _softmax_once_us(T: int, keys: int, rounds: int) -> float:
    """One fused masked max / exp / sum over all of a step's scores: the softmax's ceiling."""
    scores = jnp.asarray(_randn(BATCH, HEADS, T, keys))
    limit = jnp.asarray(keys - 3)

    @jax.jit
    def softmax(s, limit):
        s = jnp.where(jnp.arange(keys) <= limit, s, -jnp.inf)
        top = s.max(-1, keepdims=True)
        weights = jnp.exp(s - top)
        return weights, weights.sum(-1)

    return _timed({"f": lambda: jax.block_until_ready(softmax(scores, limit))}, rounds)["f"] * 1e6


# ------------------------------------------------------------------ (e) limit
def limit_rows(step_rows_: list[dict], bandwidth: float) -> list[dict]:
    rows = []
    for r in step_rows_:
        if r.get("valid", 0) < 4000:
            continue
        moved = 2 * BATCH * HEADS * r["valid"] * HEAD_DIM * FLOAT + 2 * BATCH * HEADS * r["T"] * HEAD_DIM * FLOAT
        limit = moved / bandwidth * 1e6
        case = f"T={r['T']} valid {r['valid']}: {moved / 1e6:.1f} MB moved"
        rows.append(_row("e", f"{case}, JAX step / limit", r["measured"], limit, "us"))
        if r["reference"] is not None:
            rows.append(_row("e", f"{case}, torch step / limit", r["reference"], limit, "us"))
    return rows


# ----------------------------------------------------------------- (f) memory
def _rss(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def memory_child(mode: str, batch: int, steps: int = 64, T: int = 16) -> None:
    """Runs in a fresh process: a 32k rollout, then prints its peak RSS as JSON."""
    jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()  # the runtime's own baseline
    baseline = _rss("VmRSS:")
    cache = jss.KVCache.allocate(batch=batch, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=CAPACITY)
    x = jnp.ones((batch, T, HEADS, HEAD_DIM), jnp.float32)
    inputs = x.nbytes
    if mode == "scan":
        xs = jnp.ones((steps, *x.shape), jnp.float32)
        cache, outs = scan_rollout(cache, xs, xs, xs)
        outs.block_until_ready()
        inputs = 2 * xs.nbytes  # stacked inputs + stacked outputs
    else:
        fn = step if mode == "donated" else jax.jit(_step)  # "copied": not donated
        for _ in range(steps):
            cache, out = fn(cache, x, x, x)
        out.block_until_ready()
    print(json.dumps({"baseline": baseline, "cache": cache.nbytes, "inputs": inputs, "peak": _rss("VmHWM:")}))


def memory_rows(cases: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for mode, batch in cases:
        command = f"'{sys.executable}' -m benchmarks.attention --memory-child {mode} {batch}"
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent.parent)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        logical = r["cache"] + r["inputs"] + r["baseline"]
        mb = 2**20
        note = (f"baseline {r['baseline'] / mb:.0f} MB + cache {r['cache'] / mb:.0f} MB + inputs "
                f"{r['inputs'] / mb:.0f} MB")
        if mode == "copied":
            extra = {"note": note + " (not donated: contrast, no bar)"}
        else:
            extra = {"bar": BARS["memory"], "note": note}
        rows.append(_row("f", f"peak RSS, 32k rollout, {mode}, batch {batch}", r["peak"] / mb, logical / mb, "MB",
                         **extra))
    return rows


# ------------------------------------------------------------------------ main
def _load_torch() -> None:
    global torch
    try:
        import torch as torch_module
    except ImportError:
        return
    torch = torch_module


def run(*, full: bool) -> list[dict]:
    """Every part at the quick sizes, or the large ones."""
    _load_torch()
    rounds = 15 if full else 7
    lengths = [0, 256, 1024, 2048, 4080] if full else [0, 1024, 4080]
    if torch is None:
        print(NO_TORCH)
    rows = capacity_rows(rounds)
    step_rounds = 40 if full else 25  # one step is short: more rounds, a steadier median
    steps = step_rows(16, lengths, step_rounds) + step_rows(1, [n if n < 4000 else 4095 for n in lengths], step_rounds)
    rows += steps
    rows += rollout_rows(16, 4096, 5 if full else 3) + rollout_rows(1, 4096 if full else 1024, 3)
    rows += nnx_rows([256, 1024, 4096], rounds)
    dram = copy_bandwidth(1 << 30 if full else 256 << 20)
    cached = copy_bandwidth(16 << 20)
    kernels = ["native", "pure"] if _native.enabled() else ["pure"]
    for T in (16, 1):
        for kernel in kernels:
            rows += breakdown_rows(T, 4096 - T, rounds, cached, kernel)
    rows += limit_rows(steps, dram)
    cases = [("donated", 1), ("scan", 1), ("copied", 1)] + ([("donated", 4)] if full else [])
    return rows + memory_rows(cases)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory-child"]:
        memory_child(sys.argv[2], int(sys.argv[3]))
    else:
        jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the CPU backend starts (see above)
        cli("attention", run, __doc__,
            columns=["part", "case", "measured", "reference", "unit", "ratio", "bar", "holds", "note"])
