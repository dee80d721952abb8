"""Where a rollout step's time goes, each piece against its ceiling (part d of ``benchmarks.attention``).

The step's ops are profiled per XLA op (``jax.profiler``) and classified
from the compiled HLO: the native kernel's one call, or, for the pure loop,
K/V block copies, the two matmuls, the softmax and state update, the cache
write and the loop itself.  Ceilings are measured in the same run: XLA's
best batched matmul for the block shapes, the copy bandwidth, one fused pass
of the softmax arithmetic, and PyTorch's attention rate.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import jax_session_state as jss
from benchmarks import _attention_parts as parts
from benchmarks._attention_parts import (
    BATCH,
    FLOAT,
    HEAD_DIM,
    HEADS,
    NATIVE_CALL,
    Rollout,
    empty_step,
    pure_kernel,
    pure_step_in_place,
    randn,
    row,
    step_in_place,
    timed,
    torch_candidates,
    torch_reference,
)
from jax_session_state._core import _library


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
            elif op == "custom-call" and _library.TARGET in line:
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
    seconds = timed({"dot": lambda: fn(a, b).block_until_ready()}, rounds)["dot"]
    return flops * reps / seconds / 1e9


def breakdown_rows(T: int, length: int, rounds: int, bandwidth: float, kernel: str) -> list[dict]:
    """Where a step at ``length`` valid tokens spends its time, each piece against its ceiling.

    ``kernel``: "native" (the step as ``jss.attend`` runs it here) or "pure"
    (the pure-JAX loop, traced without the native kernel).
    """
    state = Rollout(length + T)
    state.at(length)
    q, k, v = (jnp.asarray(randn(BATCH, T, HEADS, HEAD_DIM)) for _ in range(3))
    fn = step_in_place if kernel == "native" else pure_kernel(pure_step_in_place)

    def call(fn):
        state.cache, out = fn(state.cache, q, k, v)
        out.block_until_ready()

    with _library.use(kernel == "native"):
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
    t = timed({"step": functools.partial(call, fn), "empty": functools.partial(call, empty_step)}, rounds)
    # Tracing slows every op down; scale the profiled times to the step's untraced wall clock time.
    profiled_total = sum(by_category.values())
    scale = t["step"] * 1e6 / profiled_total
    label = f"T={T} {kernel}"
    rows = [row("d", f"{label} valid {length + T}: whole step (wall clock)", t["step"] * 1e6, None, "us"),
            row("d", f"{label}: an empty jitted step with the same arguments", t["empty"] * 1e6, None, "us",
                 note="dispatch cost, not subtracted"),
            row("d", f"{label}: all ops, profiled (traced)", profiled_total, None, "us",
                 note=f"the rows below are profiled times x {scale:.2f}, to add up to the untraced step")]
    if kernel == "native":
        us = by_category.get(NATIVE_CALL, 0.0) * scale
        flops = 4 * BATCH * HEADS * T * (length + T) * HEAD_DIM
        moved = 2 * BATCH * HEADS * (length + T) * HEAD_DIM * FLOAT
        rows.append(row("d", f"{label}: {NATIVE_CALL}", us, moved / bandwidth * 1e6, "us",
                         note=f"{flops / us / 1e3:.0f} GFLOP/s; ceiling: K/V read once at the copy bandwidth"))
        for category in ("write (append)", "outside the loop (q layout, normalise)"):
            rows.append(row("d", f"{label}: {category}", by_category.get(category, 0.0) * scale, None, "us"))
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
            best = _best_matmul_gflops(equation, jnp.asarray(randn(*a)), jnp.asarray(randn(*b)), flops_per_block,
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
        rows.append(row("d", f"{label}: {category}", us, ceiling, "us", note=note))
    if parts.torch is not None:
        qt, kt, vt = (parts.torch.from_numpy(randn(BATCH, HEADS, n, HEAD_DIM)) for n in (T, length + T, length + T))
        mask = None if T == 1 else parts.torch.ones(T, length + T, dtype=parts.torch.bool).tril(length)

        def sdpa():
            with parts.torch.inference_mode():
                return parts.torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

        seconds, _ = torch_reference(timed(torch_candidates(sdpa), rounds))
        rate = 4 * BATCH * HEADS * T * (length + T) * HEAD_DIM / seconds / 1e9
        rows.append(row("d", f"T={T}: torch SDPA alone (attention, no write)", seconds * 1e6, None, "us",
                         note=f"{rate:.0f} GFLOP/s (the faster of default threads and 1 thread)"))
    return rows


def _softmax_once_us(T: int, keys: int, rounds: int) -> float:
    """One fused masked max / exp / sum over all of a step's scores: the softmax's ceiling."""
    scores = jnp.asarray(randn(BATCH, HEADS, T, keys))
    limit = jnp.asarray(keys - 3)

    @jax.jit
    def softmax(s, limit):
        s = jnp.where(jnp.arange(keys) <= limit, s, -jnp.inf)
        top = s.max(-1, keepdims=True)
        weights = jnp.exp(s - top)
        return weights, weights.sum(-1)

    return timed({"f": lambda: jax.block_until_ready(softmax(scores, limit))}, rounds)["f"] * 1e6
