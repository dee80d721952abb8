"""What the attention benchmarks share: sizes, the rollout step, PyTorch's step, timing and rows.

PyTorch is optional (``pip install torch``): :func:`load_torch` imports it
into :data:`torch` where installed; without it the rows that compare with it
are skipped with :data:`NO_TORCH`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_session_state as jss
from benchmarks._common import cpu_name, interleaved, path_env, vector_isas, with_lengths
from jax_session_state._core import _library

torch: Any = None  # imported by load_torch(), not by the memory child

BATCH, HEADS, HEAD_DIM = 1, 8, 64
CAPACITY, NNX_CAPACITY = 32768, 8192
FLOAT = 4  # bytes
BARS = {"capacity": 1.5, "step": 1.5, "native_vs_pure": 1.0, "rollout": 1.5, "byte_bound": 1.5, "bf16": 0.7,
        "nnx": 0.1, "memory": 1.25}
NATIVE_CALL = "native kernel (one FFI call)"
NO_TORCH = "skipped: PyTorch is not installed (pip install torch==2.13.0)"
RNG = np.random.default_rng(0)


TORCH_CAPABILITY = {"baseline": "default", "avx2": "avx2"}  # ATEN_CPU_CAPABILITY per path; avx512: its own


def rows_on_path(module: str, path: str | None, *, full: bool, one_path: bool = False) -> list[dict]:
    """The rows ``python -m MODULE`` prints as JSON on its last line, run in a fresh process on one native path.

    ``path`` None turns the native kernel off; PyTorch is held to the same
    instruction set.  ``one_path`` passes ``--one-path`` (a module that
    is also the runner of its paths).
    """
    env = path_env(path)
    if path in TORCH_CAPABILITY:
        env["ATEN_CPU_CAPABILITY"] = TORCH_CAPABILITY[path]
    command = [sys.executable, "-m", module, *(["--full"] if full else []), *(["--one-path"] if one_path else [])]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True,
                          cwd=Path(__file__).parent.parent)
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    for r in rows:
        r["case"] = f"[{r['path']}] {r['case']}"
        r["measure"] = f"{r['part']}: {r['case']}" + ("" if "bar" in r else f" ({r['unit']})")
    return rows


def load_torch() -> None:
    global torch
    try:
        import torch as torch_module
    except ImportError:
        return
    torch = torch_module


def cpu_description() -> str:
    """The CPU as ``lscpu`` names it (model name, family, model) and whether it has AVX2 and AVX-512."""
    isas = ", ".join(f"{name}: {'yes' if present else 'no'}" for name, present in vector_isas().items())
    return f"{cpu_name()} ({os.cpu_count()} cores; {isas})"


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def timed(candidates: dict[str, Any], rounds: int, calls: int = 5) -> dict[str, float]:
    return interleaved(candidates, rounds=rounds, repeat=calls, best_of=True, pause=0.005)


def row(part: str, case: str, measured: float, reference: float | None, unit: str, **extra: Any) -> dict:
    ratio = None if reference in (None, 0) else measured / reference
    row = {"part": part, "case": case, "measured": measured, "reference": reference, "unit": unit, "ratio": ratio}
    # For the runner's table: a row with a bar shows its ratio, any other its measurement.
    row.update({"measure": f"{part}: {case}", "value": ratio} if "bar" in extra else
               {"measure": f"{part}: {case} ({unit})", "value": measured})
    if "bar" in extra:
        row["holds"] = ratio is not None and ratio <= extra["bar"]
        extra["bar"] = f"≤ {extra['bar']}"
    return {**row, **extra}


def filled_cache(capacity: int, rows: np.ndarray, dtype: Any = jnp.float32) -> jss.KVCache:
    """A cache of ``capacity`` holding ``rows[0]`` as K and ``rows[1]`` as V (each ``[1, n, H, D]``)."""
    cache = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity, dtype=dtype)
    if rows.shape[2] == 0:
        return cache
    return cache.append(jss.KVChunk(jnp.asarray(rows[0], dtype), jnp.asarray(rows[1], dtype)))


# ------------------------------------------------------------------ the steps
def rollout_step(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jss.KVCache, jax.Array]:
    """One rollout step: append T rows, attend the T queries over the cache."""
    cache = cache.append(jss.KVChunk(k, v))
    return cache, jss.attend(q, cache.view())


def step_in_place_fn(cache: jss.KVCache, q: jax.Array, k: jax.Array, v: jax.Array):
    """:func:`rollout_step`, then the length rewound: every call writes the same rows."""
    cache, out = rollout_step(cache, q, k, v)
    return with_lengths(cache, cache.committed - q.shape[1]), out


step_in_place = jax.jit(step_in_place_fn, donate_argnums=0)
step = jax.jit(rollout_step, donate_argnums=0)
pure_step_in_place = jax.jit(lambda *args: step_in_place_fn(*args), donate_argnums=0)  # its own trace cache


def pure_kernel(fn):
    """``fn`` traced (at its first call) without the native kernel: the pure-JAX loop."""

    def run(*args):
        with _library.use(False):
            return fn(*args)

    return run


@functools.partial(jax.jit, donate_argnums=0)
def scan_rollout(cache: jss.KVCache, qs: jax.Array, ks: jax.Array, vs: jax.Array):
    """A whole rollout as one ``lax.scan`` over steps (donated carry)."""
    return lax.scan(lambda c, x: rollout_step(c, *x), cache, (qs, ks, vs))


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


def torch_candidates(fn) -> dict[str, Any]:
    """PyTorch on its default threads and on one: on a busy machine its thread team can stall."""
    return {"torch": fn, "torch 1 thread": _one_thread(fn)}


def torch_reference(t: dict[str, float]) -> tuple[float, str]:
    """The faster PyTorch configuration (seconds), and a note giving both."""
    default, one = t["torch"], t["torch 1 thread"]
    return min(default, one), (f"torch: {torch.get_num_threads()} threads {default * 1e6:.0f} us, "
                               f"1 thread {one * 1e6:.0f} us; reference the faster")


def relative_error(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


class Rollout:
    """A donated JAX cache and a PyTorch cache holding the same random rows."""

    def __init__(self, filled: int, dtype: Any = jnp.float32):
        rows = randn(2, 1, filled, HEADS, HEAD_DIM)
        self.cache = filled_cache(CAPACITY, rows, dtype)
        if torch is not None:
            self.torch_k, self.torch_v = (torch.zeros(BATCH, HEADS, CAPACITY, HEAD_DIM) for _ in range(2))
            for cache, r in zip((self.torch_k, self.torch_v), rows):
                cache[:, :, :filled] = torch.from_numpy(r).transpose(1, 2)

    def at(self, length: int) -> None:
        self.cache = with_lengths(self.cache, length)


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


