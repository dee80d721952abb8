"""Writes cost what they write: KVCache.append against capacity, donation, raw arrays.

Measures, in one run:

- a jitted ``KVCache.append`` of a 16-token chunk (8 kv-heads x 64, float32)
  at capacities from 1k to 32k tokens (128k with ``--full``), donated and
  not (bars: donated 32k / 1k <= 1.3; not donated / donated at 32k >= 100);
- the same donated append into a bfloat16 cache, which XLA:CPU would
  convert whole to float32 and back for its in-place update, so the library
  writes the rows with the native row writer (bar: donated 32k / 1k <= 1.3),
  beside XLA's own write (the native kernel off) for comparison;
- a 256-step ``lax.scan`` rollout (append 16 tokens + ``jss.attend``)
  written with the library (``KVCache.append``, ``attend`` on
  ``cache.view()``) against the same rollout on raw arrays
  (``lax.dynamic_update_slice`` into head-major buffers, the same ``attend``
  kernel on a ``KVView`` of them): the difference is only what the library
  adds (bar <= 1.10).

Run:  python -m benchmarks.append [--full] [--out PATH]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from benchmarks._common import cli, interleaved, with_lengths
from jax_session_state._core import _library

HEADS, HEAD_DIM, CHUNK = 8, 64, 16
BARS = {"donated_32k_over_1k": 1.3, "copy_over_donated_32k": 100.0, "bf16_donated_32k_over_1k": 1.3,
        "library_over_raw_rollout": 1.10}


def _chunk(seed: int, dtype: jnp.dtype = jnp.float32) -> jss.KVChunk:
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(1, CHUNK, HEADS, HEAD_DIM)), dtype) for _ in range(2))
    return jss.KVChunk(k, v)


def _append_then_forget(cache: jss.KVCache, chunk: jss.KVChunk) -> jss.KVCache:
    """Appends ``chunk``, then rewinds the length: every call writes the same rows."""
    cache = cache.append(chunk)
    return with_lengths(cache, cache.committed - CHUNK)


PREFIX = 512  # tokens already in the cache when an append is timed, at every capacity


def append_timings(capacities: tuple[int, ...], *, rounds: int) -> dict[tuple[str, int], float]:
    """Seconds per append at each capacity, donated and not, and donated at 32k beside the copies.

    Every timed call appends 16 rows after the same 512-token prefix and then
    rewinds the length (a one-int update), so thousands of calls never fill
    the cache and every capacity writes the same, warm rows: what differs is
    only the capacity around them.  Donated calls are compared with each
    other, interleaved, and separately with the copying calls, whose whole-cache
    copies would otherwise evict the donated calls' rows from the CPU caches.

    Returns:
      ``{(mode, capacity): seconds}`` for mode ``"donated"`` and ``"copied"``
      at every capacity, and ``("donated beside copies", 32768)``.
    """
    chunk = _chunk(0)
    steps = {"donated": jax.jit(_append_then_forget, donate_argnums=0), "copied": jax.jit(_append_then_forget)}
    prefix = jnp.zeros((1, PREFIX, HEADS, HEAD_DIM), jnp.float32)
    state = {}
    for capacity in capacities:
        empty = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity)
        for mode in steps:
            state[mode, capacity] = empty.empty().append((prefix, prefix))
            for _ in range(8):  # warm: first writes into a fresh buffer touch new pages
                state[mode, capacity] = steps[mode](state[mode, capacity], chunk)
    jax.block_until_ready(state)

    def call(mode: str, capacity: int) -> None:
        state[mode, capacity] = steps[mode](state[mode, capacity], chunk)
        state[mode, capacity].committed.block_until_ready()

    donated = interleaved(
        {capacity: functools.partial(call, "donated", capacity) for capacity in capacities}, rounds=rounds, repeat=200
    )
    copies = interleaved(
        {"copied": functools.partial(call, "copied", 32768), "donated": functools.partial(call, "donated", 32768)},
        rounds=rounds,
        repeat={"copied": 3, "donated": 200},
    )
    copied = interleaved(
        {capacity: functools.partial(call, "copied", capacity) for capacity in capacities},
        rounds=rounds,
        repeat={capacity: max(3, 65536 // capacity) for capacity in capacities},
    )
    times = {("donated", capacity): t for capacity, t in donated.items()}
    times.update({("copied", capacity): t for capacity, t in copied.items()})
    times["copied", 32768] = copies["copied"]
    times["donated beside copies", 32768] = copies["donated"]
    return times


def bf16_timings(capacities: tuple[int, ...], *, rounds: int) -> dict[tuple[str, int], float]:
    """Seconds per donated append into a bfloat16 cache: the library's writes at every capacity, XLA's at 1k and 32k.

    Returns:
      ``{("native", capacity): seconds}`` and ``{("xla", capacity): seconds}``.
    """
    chunk = _chunk(0, jnp.bfloat16)
    prefix = jnp.zeros((1, PREFIX, HEADS, HEAD_DIM), jnp.bfloat16)
    steps, state = {}, {}
    for writer, sizes in (("native", capacities), ("xla", (1024, 32768))):
        with _library.use(writer == "native" and _library.AVAILABLE):  # traced now: the writer asked for
            step = jax.jit(lambda cache, chunk: _append_then_forget(cache, chunk), donate_argnums=0)  # its own trace
            for capacity in sizes:
                empty = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity,
                                             dtype=jnp.bfloat16)
                state[writer, capacity] = empty.append((prefix, prefix))
                for _ in range(4):
                    state[writer, capacity] = step(state[writer, capacity], chunk)
                steps[writer, capacity] = step
    jax.block_until_ready(state)

    def call(key: tuple[str, int]) -> None:
        state[key] = steps[key](state[key], chunk)
        state[key].committed.block_until_ready()

    native = interleaved({key: functools.partial(call, key) for key in steps if key[0] == "native"},
                         rounds=rounds, repeat=200)
    xla = interleaved({key: functools.partial(call, key) for key in steps if key[0] == "xla"},
                      rounds=rounds, repeat={("xla", 1024): 20, ("xla", 32768): 3})
    return {**native, **xla}


def rollout_timings(steps: int, *, rounds: int) -> dict[str, float]:
    """Seconds per whole rollout: the library against raw arrays, the same attention kernel."""
    capacity = steps * CHUNK
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(steps, 1, CHUNK, HEADS, HEAD_DIM)), jnp.float32)

    def library(cache: jss.KVCache, xs: jax.Array):
        def step(cache, x):
            cache = cache.append(jss.KVChunk(x, x))
            return cache, jss.attend(x, cache.view()).sum()

        return jax.lax.scan(step, cache, xs)

    def raw(carry, xs: jax.Array):
        def step(carry, x):
            k, v, length = carry
            rows = x.transpose(0, 2, 1, 3)  # head-major rows [1, H, T, D]
            k = jax.lax.dynamic_update_slice(k, rows, (0, 0, length, 0))
            v = jax.lax.dynamic_update_slice(v, rows, (0, 0, length, 0))
            length = length + CHUNK
            view = jss.KVView(k=k, v=v, lengths=length[None], positions=None)  # append mode reads no positions
            return (k, v, length), jss.attend(x, view).sum()

        return jax.lax.scan(step, carry, xs)

    library_fn, raw_fn = jax.jit(library, donate_argnums=0), jax.jit(raw, donate_argnums=0)
    empty = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity)
    zeros = jnp.zeros((1, HEADS, capacity, HEAD_DIM), jnp.float32)
    check_lib = library_fn(empty.empty(), xs)[1]
    check_raw = raw_fn((zeros.copy(), zeros.copy(), jnp.int32(0)), xs)[1]
    np.testing.assert_allclose(check_lib, check_raw, rtol=1e-6)  # the same computation

    def run_library():
        jax.block_until_ready(library_fn(empty.empty(), xs))

    def run_raw():
        jax.block_until_ready(raw_fn((zeros.copy(), zeros.copy(), jnp.int32(0)), xs))

    return interleaved({"library": run_library, "raw": run_raw}, rounds=rounds, repeat=1)


def run(*, full: bool) -> list[dict]:
    """Append cost at each capacity (donated or not), the rollout against raw arrays, and the bars."""
    capacities = (1024, 4096, 16384, 32768, 131072) if full else (1024, 4096, 16384, 32768)
    appends = append_timings(capacities, rounds=15 if full else 7)
    bf16 = bf16_timings(capacities, rounds=15 if full else 7)
    rollout = rollout_timings(256, rounds=15 if full else 9)
    rows = [
        {"measure": f"append 16 tokens, cap {capacity // 1024}k, {mode} (us)", "value": appends[mode, capacity] * 1e6,
         "figure": "append", "capacity": capacity, "donated": mode == "donated"}
        for mode in ("donated", "copied")
        for capacity in capacities
    ]
    native_writer = "native row writer" if _library.AVAILABLE else "XLA (native kernel not built)"
    rows += [{"measure": f"bfloat16 append 16 tokens, cap {capacity // 1024}k, donated, {native_writer} (us)",
              "value": bf16["native", capacity] * 1e6} for capacity in capacities]
    rows += [{"measure": f"bfloat16 append 16 tokens, cap {capacity // 1024}k, donated, XLA writes (us)",
              "value": bf16["xla", capacity] * 1e6} for capacity in (1024, 32768)]
    rows += [
        {"measure": "256-step rollout, library (ms)", "value": rollout["library"] * 1e3},
        {"measure": "256-step rollout, raw arrays (ms)", "value": rollout["raw"] * 1e3},
    ]
    ratios = {
        "donated_32k_over_1k": appends["donated", 32768] / appends["donated", 1024],
        "copy_over_donated_32k": appends["copied", 32768] / appends["donated beside copies", 32768],
        "bf16_donated_32k_over_1k": bf16["native", 32768] / bf16["native", 1024],
        "library_over_raw_rollout": rollout["library"] / rollout["raw"],
    }
    for name, value in ratios.items():
        bar = BARS[name]
        holds = value >= bar if name == "copy_over_donated_32k" else value <= bar
        sign = "≥ " if name.startswith("copy") else "≤ "
        rows.append({"measure": f"ratio {name}", "value": value, "bar": sign + str(bar), "holds": holds})
    return rows


if __name__ == "__main__":
    cli("append", run, __doc__)
