"""The parts of ``benchmarks/tiers.py`` that need a fresh process: timing on one native path, and demotion's peak.

``time CAPACITY``: ``attend`` of one query token over a float32 cache and
its int8 demotion, both holding ``CAPACITY`` tokens, on the native path
``JSS_NATIVE_ISA`` selected at import; prints the median best-of seconds of
each and which kernel each compiled step calls (its HLO) as JSON.

``memory CAPACITY``: compiles a donated ``demote()`` from shapes alone,
reads the resident memory (the baseline), fills a float32 cache
(batch 1, 8 heads x 128) with random rows, resets the peak
(``/proc/self/clear_refs``), demotes it, and prints the baseline, the
cache's bytes and the peak (``VmHWM``) as JSON.

Run:  sh -c 'exec python -m benchmarks._tiers_child time|memory CAPACITY'
"""

from __future__ import annotations

import json
import sys

import jax

import jax_session_state as jss
from benchmarks._common import interleaved, with_lengths
from benchmarks._rollout_memory import _status_bytes
from jax_session_state import _native

HEADS, TIME_DIM, MEMORY_DIM = 8, 64, 128


def random_cache(key: jax.Array, capacity: int, valid: int, head_dim: int) -> jss.KVCache:
    """A float32 cache (batch 1, 8 heads) of ``capacity`` random normal rows, ``valid`` of them committed."""
    cache = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=head_dim, capacity=capacity, tiers=("int8",))
    k_key, v_key = jax.random.split(key)
    shape = cache.k.shape
    cache = cache.with_storage(k=jax.random.normal(k_key, shape), v=jax.random.normal(v_key, shape))
    return with_lengths(cache, valid)


def timing(capacity: int) -> dict:
    f32 = jax.jit(random_cache, static_argnums=(1, 2, 3))(jax.random.key(0), capacity, capacity, TIME_DIM)
    int8 = jax.jit(lambda cache: cache.demote())(f32)
    q = jax.random.normal(jax.random.key(1), (1, 1, HEADS, TIME_DIM))
    step = jax.jit(lambda q, cache: jss.attend(q, cache.view()))
    runs = {"float32": lambda: step(q, f32).block_until_ready(), "int8": lambda: step(q, int8).block_until_ready()}
    for run in runs.values():
        run()
    seconds = interleaved(runs, rounds=9, repeat=5, best_of=True, pause=0.005)
    targets = {"float32": (f32, _native.TARGET), "int8": (int8, _native.QUANTIZED_TARGET)}
    kernels = {name: "native kernel" if f'"{target}"' in step.lower(q, cache).compile().as_text() else "pure loop"
               for name, (cache, target) in targets.items()}
    return {"seconds": seconds, "kernels": kernels, "status": _native.status()}


def memory(capacity: int) -> dict:
    fill = jax.jit(random_cache, static_argnums=(1, 2, 3))
    demote = jax.jit(lambda cache: cache.demote(), donate_argnums=0)
    shapes = jax.eval_shape(fill, jax.random.key(0), capacity, capacity, MEMORY_DIM)
    compiled = demote.lower(shapes).compile()
    fill.lower(jax.random.key(0), capacity, capacity, MEMORY_DIM).compile()
    baseline = _status_bytes("VmRSS")
    cache = jax.block_until_ready(fill(jax.random.key(0), capacity, capacity, MEMORY_DIM))
    cache_bytes = cache.nbytes
    filled = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak (VmHWM) restarts at the current resident set
    demoted = jax.block_until_ready(compiled(cache))
    peak = _status_bytes("VmHWM")
    return {"baseline": baseline, "cache": cache_bytes, "filled": filled, "peak": peak,
            "demoted": demoted.nbytes, "quantize": demoted.quantize}


if __name__ == "__main__":
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    mode, capacity = sys.argv[1], int(sys.argv[2])
    print(json.dumps({"time": timing, "memory": memory}[mode](capacity)))
