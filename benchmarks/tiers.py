"""Retention tiers: what an int8 (or fp8) K/V cache saves, what it costs in accuracy and time, and demotion's peak.

Measures, in one run:

(a) the bytes of an int8 cache (values plus one float32 scale per row and
    head) against the float32 cache, 8 kv-heads x 64 and x 128 (bar <= 0.3);
(b) the relative L2 error of ``attend`` over the int8 cache against the
    float32 cache holding the same random normal K/V, over 100 draws (one
    jitted function, new data each draw), for T = 1 and 16 query tokens at
    1k and 32k valid tokens of a 32k cache: median, p95 and max (bar: max
    <= 2e-2); fp8 (``float8_e4m3fn``) rows for information;
(c) ``attend`` of one token at 32k valid, int8 time over float32 time
    (bar <= 0.5), once per path of the native kernel the CPU runs
    (``JSS_NATIVE_ISA``, a fresh process per path); each row says which
    kernel each cache's compiled step calls (both take the native kernel,
    which reads the int8 values in place and applies their row scales);
    on the SSE2 path int8 costs many integer instructions per byte, so
    its read neither streams at memory speed nor stays in cache: 0.43
    dense and 0.49 paged on an AMD EPYC of family 26 (Zen 5),
    0.65-0.83 and 0.52-0.73 in four runs on family 25 (Zen 4), where that
    bar misses (``benchmarks/NOTES.md``); there the AVX2 and AVX-512 paged
    rows missed once each in those runs (0.56 and 0.52), with the int8
    rows, which just fill its 32 MiB of shared L3, read at up to twice
    their time in another process;
(d) the peak resident memory of a jitted, donated ``demote()`` of a 32k
    float32 cache (batch 1, 8 heads x 128), in a fresh process (one malloc
    arena, a fixed mmap threshold), resident set minus the baseline before
    the cache existed, over the float32 cache's bytes (bar <= 1.3); XLA's
    own figure beside it.

Each part measures a ``KVCache`` ("dense") and a ``PagedKVCache`` of one
slot whose 16-row pages lie in a random order in the pool ("paged"; int8
only in (b)); both kinds' float32 and int8 reads take the native kernel
(its dense and paged handlers).

The first row names the CPU (model, AVX2 and AVX-512 yes/no).

Run:  python -m benchmarks.tiers [--full] [--out PATH]
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from benchmarks._attention_parts import cpu_description
from benchmarks._common import cli, native_paths, path_env
from benchmarks._tiers_child import HEADS, MAKERS
from jax_session_state._core import _library

CAPACITY = 32768
BARS = {"bytes": 0.3, "error": 2e-2, "time": 0.5, "memory": 1.3}
ROOT = Path(__file__).parent.parent
# One malloc arena and a fixed mmap threshold for the peak's child (benchmarks._tiers_child says why).
MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}


def _bar(measure: str, value: float, bar: float, **extra: Any) -> dict[str, Any]:
    return {"measure": measure, "value": value, "bar": f"≤ {bar:g}", "holds": bool(value <= bar), **extra}


def byte_rows() -> list[dict[str, Any]]:
    rows = []
    for kind, make in MAKERS.items():
        for head_dim in (64, 128):
            shape = jax.eval_shape(lambda d=head_dim, make=make: make(jax.random.key(0), CAPACITY, 0, d))
            f32 = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shape))
            demoted = jax.eval_shape(lambda c: c.demote(), shape)
            int8 = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(demoted))
            rows.append(_bar(f"bytes: [{kind}] int8 / float32 cache, {HEADS} heads x {head_dim} (scales and "
                             "bookkeeping included)", int8 / f32, BARS["bytes"], part="bytes", kind=kind))
    return rows


def error_rows(draws: int, capacity: int, valids: tuple[int, ...]) -> list[dict[str, Any]]:
    """The relative error's distribution over ``draws`` random caches, per (format, T, valid)."""
    rows = []
    for kind, fmt in (("dense", "int8"), ("dense", "fp8"), ("paged", "int8")):
        for T in (1, 16):
            for valid in valids:
                @jax.jit
                def error(key: jax.Array, fmt: str = fmt, T: int = T, valid: int = valid,
                          make: Any = MAKERS[kind]) -> jax.Array:
                    cache_key, q_key = jax.random.split(key)
                    f32 = make(cache_key, capacity, valid, 64)
                    low = f32.replace(tiers=(fmt,)).demote()
                    q = jax.random.normal(q_key, (1, T, HEADS, 64))
                    exact, approx = jss.attend(q, f32.view()), jss.attend(q, low.view())
                    return jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact)

                errors = np.array([float(error(jax.random.key(i))) for i in range(draws)])
                assert error._cache_size() == 1, "the error function compiled more than once"
                median, p95, worst = np.median(errors), np.percentile(errors, 95), errors.max()
                measure = (f"error: {fmt} vs float32 attend [{kind}], T={T}, valid {valid} of {capacity}, "
                           f"{draws} draws: max (median {median:.2e}, p95 {p95:.2e})")
                extra = {"part": "error", "kind": kind, "format": fmt, "T": T, "valid": valid,
                         "median": float(median), "p95": float(p95), "max": float(worst)}
                if fmt == "int8":
                    rows.append(_bar(measure, float(worst), BARS["error"], **extra))
                else:
                    rows.append({"measure": measure + " (information)", "value": float(worst), **extra})
    return rows


def _child(mode: str, capacity: int, kind: str, env: dict[str, str]) -> dict[str, Any]:
    command = f"exec {shlex.quote(sys.executable)} -m benchmarks._tiers_child {mode} {capacity} {kind}"
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, cwd=ROOT,
                          env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_rows(capacity: int, cpu: str) -> list[dict[str, Any]]:
    rows = []
    for path in native_paths():
        env = path_env(path)
        for kind in MAKERS:
            result = _child("time", capacity, kind, env)
            seconds, kernels = result["seconds"], result["kernels"]
            rows.append(_bar(
                f"time: [{path or 'no native'}, {kind}] attend T=1 at {capacity} valid, int8 ({kernels['int8']}) / "
                f"float32 ({kernels['float32']}); {seconds['int8'] * 1e3:.2f} ms / {seconds['float32'] * 1e3:.2f} ms "
                f"on {cpu}",
                seconds["int8"] / seconds["float32"], BARS["time"], part="time", path=path, kind=kind, kernels=kernels,
                int8_ms=seconds["int8"] * 1e3, float32_ms=seconds["float32"] * 1e3, native_status=result["status"]))
    return rows


def memory_rows(capacity: int) -> list[dict[str, Any]]:
    rows, mib = [], 2**20
    for kind in MAKERS:
        memory = _child("memory", capacity, kind, {**os.environ, **MALLOC_ENV})
        rows += [
            {"measure": f"memory: [{kind}] baseline resident before the cache (MiB)",
             "value": memory["baseline"] / mib},
            {"measure": f"memory: [{kind}] float32 cache, {capacity} tokens, 1 x {HEADS} heads x 128 (MiB)",
             "value": memory["cache"] / mib},
            {"measure": f"memory: [{kind}] its int8 demotion (MiB)", "value": memory["demoted"] / mib},
            _bar(f"memory: [{kind}] (peak resident during a donated demote() - baseline) / float32 cache bytes",
                 (memory["peak"] - memory["baseline"]) / memory["cache"], BARS["memory"], part="memory", kind=kind,
                 **memory),
            {"measure": f"memory: [{kind}] XLA's peak of the compiled demote (arguments + outputs + temporaries - "
                        "aliased) / float32 cache bytes (information)", "value": memory["xla_peak"] / memory["cache"]},
        ]
    return rows


def run(*, full: bool, smoke: bool = False) -> list[dict[str, Any]]:
    """Every part; ``smoke``: tiny sizes that only check the benchmark runs."""
    cpu = cpu_description()
    capacity = 1024 if smoke else CAPACITY
    rows = [{"measure": f"CPU: {cpu}", "value": "; ".join(f"{name}: {'runs' if ok else 'lacks'}"
                                                          for name, ok in _library.ISAS.items())}]
    rows += byte_rows()
    rows += error_rows(3 if smoke else 100, capacity, (256, capacity) if smoke else (1024, capacity))
    rows += time_rows(capacity, cpu)
    rows += memory_rows(capacity)
    for r in rows:
        r["cpu"] = cpu
    return rows


if __name__ == "__main__":
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the CPU backend starts
    cli("tiers", run, __doc__)
