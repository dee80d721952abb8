"""The rollout step on one instruction-set path of the native kernel: ``python -m benchmarks.attention_steps``.

Run by ``benchmarks.attention`` once per path the CPU runs, in a process of
its own (``JSS_NATIVE_ISA`` is read when the kernel loads); prints its rows
as JSON on the last line.  Measures, batch 1, 8 query heads over 8 kv-heads
x 64, float32, capacity 32k:

- a jitted, donated step (``KVCache.append`` of T tokens + ``attend``) at a
  valid length, T = 16 and T = 1: the native kernel against the pure-JAX
  loop in the same rounds (bar <= 1.0) and against PyTorch eager with a
  preallocated head-major cache, an in-place ``copy_`` and
  ``scaled_dot_product_attention`` over the valid prefix (bar <= 1.5);
- whole rollouts 0 -> 4096: the step in a Python loop and as one
  ``lax.scan`` (T = 16: bar <= 1.5 x PyTorch);
- a bfloat16 cache against float32 at T = 1, 4k valid (bar <= 0.7): one
  cache read again and again, and eight layers' caches read in turn, as a
  model's step reads them;
- the byte bound: valid K/V bytes over the measured copy bandwidth (T = 1,
  4k: bar <= 1.5).

Run:  python -m benchmarks.attention_steps [--full]   (JSS_NATIVE_ISA picks the path)
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from benchmarks import _attention_parts as parts
from benchmarks._attention_parts import (
    BARS,
    BATCH,
    CAPACITY,
    FLOAT,
    HEAD_DIM,
    HEADS,
    NO_TORCH,
    Rollout,
    copy_bandwidth,
    filled_cache,
    pure_kernel,
    pure_step_in_place,
    randn,
    relative_error,
    row,
    scan_rollout,
    step,
    step_in_place,
    timed,
    torch_candidates,
    torch_reference,
    torch_step,
)
from benchmarks._common import interleaved
from jax_session_state._core import _library
from jax_session_state.attention import _native


def step_rows(T: int, lengths: list[int], rounds: int) -> list[dict]:
    state = Rollout(max(lengths) + T)
    q, k, v = (randn(BATCH, T, HEADS, HEAD_DIM) for _ in range(3))
    qj, kj, vj = map(jnp.asarray, (q, k, v))
    rows = []
    for length in lengths:
        state.at(length)

        def jax_call():
            state.cache, out = step_in_place(state.cache, qj, kj, vj)
            return out.block_until_ready()

        candidates = {"jax": jax_call}
        takes = _library.enabled() and _native.supports(qj, state.cache.k, state.cache.v)
        if takes:

            def pure_call():
                state.cache, out = pure_kernel(pure_step_in_place)(state.cache, qj, kj, vj)
                return out.block_until_ready()

            candidates["jax pure"] = pure_call
            assert relative_error(pure_call(), jax_call()) < 1e-5
        if parts.torch is not None:
            qt, kt, vt = map(parts.torch.from_numpy, (q, k, v))

            def torch_call(length=length, qt=qt, kt=kt, vt=vt):
                with parts.torch.inference_mode():
                    return torch_step(state.torch_k, state.torch_v, length, qt, kt, vt)

            candidates |= torch_candidates(torch_call)
            error = relative_error(jax_call(), torch_call().numpy())
            assert error < 1e-4, error
        t = timed(candidates, rounds)
        case = f"step T={T}, valid {length} -> {length + T}"
        if "jax pure" in t:
            rows.append(row("b", f"{case}: native kernel vs pure-JAX loop", t["jax"] * 1e6, t["jax pure"] * 1e6,
                            "us", bar=BARS["native_vs_pure"]))
        elif _library.enabled():
            rows.append(row("b", f"{case}: the kernel declines, the pure loop runs", t["jax"] * 1e6, None, "us",
                            note=f"{_library.ISA}: slower than the loop from {_native.DECLINED_ROWS[_library.ISA]} "
                                 "query rows per kv head"))
        if parts.torch is None:
            rows.append(row("b", case, t["jax"] * 1e6, None, "us", note=NO_TORCH))
            continue
        reference, note = torch_reference(t)
        bar = {"bar": BARS["step"]} if length >= 1000 else {}  # the bar: valid 1k and 4k
        rows.append(row("b", case, t["jax"] * 1e6, reference * 1e6, "us", **bar, T=T, valid=length + T,
                         note=note, torch_default_us=t["torch"] * 1e6,
                         torch_one_thread_us=t["torch 1 thread"] * 1e6))
    return rows


def rollout_rows(T: int, tokens: int, rounds: int) -> list[dict]:
    """Whole rollouts 0 -> tokens: the jitted step in a Python loop, one lax.scan, PyTorch eager."""
    steps = tokens // T
    qs, ks, vs = (randn(steps, BATCH, T, HEADS, HEAD_DIM) for _ in range(3))
    qsj, ksj, vsj = map(jnp.asarray, (qs, ks, vs))
    listed = [list(x) for x in (qsj, ksj, vsj)]
    state = Rollout(0)
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
    if parts.torch is not None:
        qst, kst, vst = map(parts.torch.from_numpy, (qs, ks, vs))

        def torch_rollout():
            with parts.torch.inference_mode():
                return [torch_step(state.torch_k, state.torch_v, i * T, qst[i], kst[i], vst[i])
                        for i in range(steps)]

        candidates |= torch_candidates(torch_rollout)
        assert relative_error(scan(), np.stack([o.numpy() for o in torch_rollout()])) < 1e-4
    loop()  # compiles the step
    t = interleaved(candidates, rounds=rounds, repeat=1, pause=0.005)
    note = f"scan compiles in {compile_s:.1f} s; "
    reference = None
    if parts.torch is None:
        note += NO_TORCH
    else:
        reference, torch_note = torch_reference(t)
        reference, note = reference / steps * 1e6, note + torch_note + " (whole rollouts)"
    return [
        row("b", f"rollout T={T}, 0 -> {tokens}: step loop, per step", t["loop"] / steps * 1e6, reference, "us",
            note=note),
        row("b", f"rollout T={T}, 0 -> {tokens}: lax.scan, per step", t["scan"] / steps * 1e6, reference, "us",
            note=note, **({"bar": BARS["rollout"]} if T == 16 else {})),
    ]

# A model's step reads each layer's cache once: eight layers of 4k valid
# tokens are 134 MB of float32, past the last-level cache of most CPUs.
LAYERS = 8


def bf16_rows(length: int, rounds: int) -> list[dict]:
    """``attend`` at T = 1 over a bfloat16 cache against the same rows in float32, in the same rounds.

    Twice: one cache read again and again, whose rows stay in the CPU's
    caches where they fit, and ``LAYERS`` caches read in turn by one jitted
    call, as a model's step reads its layers (per layer).  The read alone: a
    bfloat16 cache's append is timed by ``benchmarks.append``.
    """
    rows = randn(2, 1, length, HEADS, HEAD_DIM)
    dtypes = (("f32", jnp.float32), ("bf16", jnp.bfloat16))
    q = jnp.asarray(randn(BATCH, 1, HEADS, HEAD_DIM))
    views = {name: filled_cache(CAPACITY, rows, dtype).view() for name, dtype in dtypes}
    stacks = {f"{name} layers": [filled_cache(length, rows, dtype).view() for _ in range(LAYERS)]
              for name, dtype in dtypes}
    attend = jax.jit(jss.attend)
    attend_layers = jax.jit(lambda q, views: [jss.attend(q, view) for view in views])
    calls = {name: (lambda view=view: attend(q, view).block_until_ready()) for name, view in views.items()}
    calls.update({name: (lambda views=views: jax.block_until_ready(attend_layers(q, views)))
                  for name, views in stacks.items()})
    reference = calls["f32"]()
    assert relative_error(calls["bf16"](), reference) < 2e-2  # bf16 rounding of the rows
    assert relative_error(calls["bf16 layers"]()[-1], reference) < 2e-2
    t = timed(calls, rounds)
    float_bytes = LAYERS * 2 * BATCH * HEADS * length * HEAD_DIM * FLOAT
    return [row("b", f"attend T=1, {length} valid: bfloat16 cache vs float32", t["bf16"] * 1e6, t["f32"] * 1e6,
                "us", bar=BARS["bf16"]),
            row("b", f"attend T=1, {length} valid, {LAYERS} layers read in turn ({float_bytes / 1e6:.0f} MB of "
                     "float32): bfloat16 caches vs float32, per layer",
                t["bf16 layers"] / LAYERS * 1e6, t["f32 layers"] / LAYERS * 1e6, "us", bar=BARS["bf16"])]


def limit_rows(step_rows_: list[dict], bandwidth: float) -> list[dict]:
    rows = []
    for r in step_rows_:
        if r.get("valid", 0) < 4000:
            continue
        moved = 2 * BATCH * HEADS * r["valid"] * HEAD_DIM * FLOAT + 2 * BATCH * HEADS * r["T"] * HEAD_DIM * FLOAT
        limit = moved / bandwidth * 1e6
        case = f"T={r['T']} valid {r['valid']}: {moved / 1e6:.1f} MB moved"
        bar = {"bar": BARS["byte_bound"]} if r["T"] == 1 else {}
        rows.append(row("e", f"{case}, JAX step / limit", r["measured"], limit, "us", **bar))
        if r["reference"] is not None:
            rows.append(row("e", f"{case}, torch step / limit", r["reference"], limit, "us"))
    return rows

def run(*, full: bool) -> list[dict]:
    """Every row of this path at the quick sizes, or the large ones."""
    parts.load_torch()
    lengths = [0, 256, 1024, 2048, 4080] if full else [0, 1024, 4080]
    rounds = 40 if full else 25  # one step is short: more rounds, a steadier median
    steps = step_rows(16, lengths, rounds) + step_rows(1, [n if n < 4000 else 4095 for n in lengths], rounds)
    rows = steps + rollout_rows(16, 4096, 5 if full else 3) + rollout_rows(1, 4096 if full else 1024, 3)
    rows += bf16_rows(4096, rounds)
    return rows + limit_rows(steps, copy_bandwidth(1 << 30 if full else 256 << 20))


if __name__ == "__main__":
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # as in benchmarks.attention
    results = run(full="--full" in sys.argv[1:])
    for r in results:
        r["path"] = _library.ISA or "pure JAX"
    print(json.dumps(results, default=float))
