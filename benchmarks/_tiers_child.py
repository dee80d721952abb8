"""The parts of ``benchmarks/tiers.py`` that need a fresh process: timing on one native path, and demotion's peak.

``time CAPACITY KIND``: ``attend`` of one query token over a float32 cache
and its int8 demotion, both holding ``CAPACITY`` tokens, on the native path
``JSS_NATIVE_ISA`` selected at import; prints the median best-of seconds of
each and which kernel each compiled step calls (its HLO) as JSON.

``memory CAPACITY KIND``: compiles a donated ``demote()`` from shapes alone,
reads the resident memory (the baseline), fills a float32 cache
(batch 1, 8 heads x 128) with random rows, resets the peak
(``/proc/self/clear_refs``), demotes it, and prints the baseline, the
cache's bytes and the peak (``VmHWM``) as JSON.

The tiers benchmark runs it with ``MALLOC_ARENA_MAX=1``: glibc's per-thread
arenas otherwise keep up to 32 MiB more resident depending on which XLA
worker thread allocates the outputs (measured on the paged cache: 1.45x
without, 1.26x with; XLA's own figure is 1.26x either way).  And with
``MALLOC_MMAP_THRESHOLD_=1048576``: glibc raises its mmap threshold (up to
32 MiB) after freeing a large block, so in some runs a freed temporary
stays in the heap, resident, while the outputs are written (paged cache,
one arena: 1.32x in 2 of 5 runs and 1.26x in the rest; with the threshold
fixed, 1.25-1.26x in 8 of 8).

``KIND``: ``dense`` (a ``KVCache``) or ``paged`` (a ``PagedKVCache`` of one
slot whose pages lie in a random order in the pool).

Run:  sh -c 'exec python -m benchmarks._tiers_child time|memory CAPACITY dense|paged'
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

import jax_session_state as jss
from benchmarks._common import interleaved, with_lengths
from benchmarks._rollout_memory import _status_bytes
from jax_session_state._core import _library

HEADS, TIME_DIM, MEMORY_DIM, PAGE_SIZE = 8, 64, 128, 16


def random_cache(key: jax.Array, capacity: int, valid: int, head_dim: int) -> jss.KVCache:
    """A float32 cache (batch 1, 8 heads) of ``capacity`` random normal rows, ``valid`` of them committed."""
    cache = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=head_dim, capacity=capacity, tiers=("int8",))
    k_key, v_key = jax.random.split(key)
    shape = cache.k.shape
    cache = cache.with_storage(k=jax.random.normal(k_key, shape), v=jax.random.normal(v_key, shape))
    return with_lengths(cache, valid)


def random_paged(key: jax.Array, capacity: int, valid: int, head_dim: int) -> jss.PagedKVCache:
    """A float32 paged cache of one slot (8 heads), ``capacity`` random normal rows in pages of 16 in a random
    order, ``valid`` of them committed."""
    pages = capacity // PAGE_SIZE
    cache = jss.PagedKVCache.allocate(max_slots=1, kv_heads=HEADS, head_dim=head_dim, page_size=PAGE_SIZE,
                                      num_pages=pages, tiers=("int8",))
    k_key, v_key, order_key = jax.random.split(key, 3)
    shape = cache.k_pages.shape
    return cache.with_storage(
        k_pages=jax.random.normal(k_key, shape), v_pages=jax.random.normal(v_key, shape),
        page_table=jax.random.permutation(order_key, pages).astype(jnp.int32)[None],
        committed=jnp.full((1,), valid, jnp.int32), refcounts=jnp.ones((pages,), jnp.int32),
        free_count=jnp.zeros((), jnp.int32),
    )


MAKERS = {"dense": random_cache, "paged": random_paged}


def timing(capacity: int, kind: str) -> dict:
    f32 = jax.jit(MAKERS[kind], static_argnums=(1, 2, 3))(jax.random.key(0), capacity, capacity, TIME_DIM)
    int8 = jax.jit(lambda cache: cache.demote())(f32)
    q = jax.random.normal(jax.random.key(1), (1, 1, HEADS, TIME_DIM))
    step = jax.jit(lambda q, cache: jss.attend(q, cache.view()))
    runs = {"float32": lambda: step(q, f32).block_until_ready(), "int8": lambda: step(q, int8).block_until_ready()}
    for run in runs.values():
        run()
    seconds = interleaved(runs, rounds=9, repeat=5, best_of=True, pause=0.005)
    float_target, int8_target = {
        "dense": (_library.TARGET, _library.QUANTIZED_TARGET),
        "paged": (_library.PAGED_TARGET, _library.QUANTIZED_PAGED_TARGET),
    }[kind]
    targets = {"float32": (f32, float_target), "int8": (int8, int8_target)}
    kernels = {name: "native kernel" if f'"{target}"' in step.lower(q, cache).compile().as_text() else "pure loop"
               for name, (cache, target) in targets.items()}
    return {"seconds": seconds, "kernels": kernels, "status": _library.status()}


def memory(capacity: int, kind: str) -> dict:
    fill = jax.jit(MAKERS[kind], static_argnums=(1, 2, 3))
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
    analysis = compiled.memory_analysis()  # what XLA holds at once: inputs, outputs not aliased, temporaries
    xla_peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
                - analysis.alias_size_in_bytes)
    return {"baseline": baseline, "cache": cache_bytes, "filled": filled, "peak": peak, "xla_peak": xla_peak,
            "demoted": demoted.nbytes, "quantize": demoted.quantize}


if __name__ == "__main__":
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    mode, capacity, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(json.dumps({"time": timing, "memory": memory}[mode](capacity, kind)))
