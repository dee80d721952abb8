"""A paged fork costs one page, not the sequence; paged reads cost what dense reads cost.

Measures, in one run (8 kv-heads x 64, float32, pages of 16 rows), once per
path of the native kernel the CPU runs (``JSS_NATIVE_ISA``, a fresh process
per path, each row naming its path):

- a jitted, donated ``PagedKVCache.fork`` of a 32k-token slot and of a
  1k-token slot of the same pool, each ending mid-page so the fork copies
  one partial page (bar: 32k / 1k <= 1.3).  Each sample forks one source
  into every spare slot, then frees them again, untimed and waited for, so
  every sample starts from the same pool and no free runs inside a sample;
- ``attend`` over a paged view holding 4k and 32k tokens against a dense
  ``KVCache`` view holding the same rows, T = 1 and T = 16 (bar: paged /
  dense <= 1.2, at vLLM's default page size): the pages are read where they
  lie, through the page table;
  at 32k also with ``implementation="loop"`` (the pure-JAX loop, no bar);
- for scale, once: a deep copy (``Session.fork``) of a dense ``KVCache``
  holding the same 32k tokens.

Run:  python -m benchmarks.paged [--full] [--out PATH]
      python -m benchmarks.paged path [--full]   (one path's rows as JSON, on the path ``JSS_NATIVE_ISA`` selects)
"""

from __future__ import annotations

import functools
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from benchmarks._attention_parts import cpu_description
from benchmarks._common import cli, interleaved, native_paths, path_env
from jax_session_state._core import _library

HEADS, HEAD_DIM, PAGE = 8, 64, 16
LONG, SHORT = 32 * 1024 - 5, 1024 - 5  # tokens; both end mid-page
FORKS = 8  # forks timed per sample, into slots 2..2+FORKS-1
FILL = 1024  # rows appended per call while filling
BARS = {"fork_32k_over_1k": 1.3, "attend_paged_over_dense": 1.2}
ROOT = Path(__file__).parent.parent


def _filled_cache() -> jss.PagedKVCache:
    """Slot 0 holds LONG tokens and slot 1 SHORT tokens of random K/V; the rest are free."""
    slots = 2 + FORKS
    pages = -(-LONG // PAGE) + -(-SHORT // PAGE) + FORKS
    cache = jss.PagedKVCache.allocate(
        max_slots=slots, kv_heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE, num_pages=pages,
        max_pages_per_slot=-(-LONG // PAGE),
    )
    append = jax.jit(lambda c, p: c.append(p), donate_argnums=0)
    rng = np.random.default_rng(0)
    for start in range(0, LONG, FILL):
        counts = np.zeros(slots, np.int32)
        counts[0] = min(FILL, LONG - start)
        counts[1] = min(FILL, max(SHORT - start, 0))
        k, v = (jnp.asarray(rng.normal(size=(slots, FILL, HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
        cache = append(cache, jss.KVChunk(k, v, jnp.asarray(counts)))
    jss.check(cache)
    return cache


def fork_timings(*, rounds: int) -> dict[str, float]:
    """Median seconds per fork of the long and the short slot, interleaved round by round.

    Each sample forks one source into every spare slot (timed), then frees
    them again (not timed), so every sample starts from the same pool.
    """
    fork = jax.jit(lambda c, src, dst: c.fork(src, dst), donate_argnums=0)
    free = jax.jit(lambda c, slot: c.free(slot), donate_argnums=0)
    cache = _filled_cache()
    samples: dict[int, list[float]] = {0: [], 1: []}
    for round_ in range(rounds + 1):  # the first round compiles and warms
        for src in (0, 1) if round_ % 2 else (1, 0):
            start = time.perf_counter()
            for dst in range(2, 2 + FORKS):
                cache = fork(cache, src, dst)
                jax.block_until_ready(cache)
            elapsed = (time.perf_counter() - start) / FORKS
            assert int(cache.free_count) == 0 and not bool(cache.overflowed)  # one page per fork, no more
            if round_:
                samples[src].append(elapsed)
            for dst in range(2, 2 + FORKS):
                cache = free(cache, dst)
            jax.block_until_ready(cache)  # the frees are not part of the next sample
    jss.check(cache)
    return {"long": statistics.median(samples[0]), "short": statistics.median(samples[1])}


def dense_fork_timing(*, rounds: int) -> float:
    """Median seconds to deep-copy a session holding a dense 32k-token KVCache."""
    kv = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=LONG)
    rows = jnp.zeros((1, LONG, HEADS, HEAD_DIM), jnp.float32)
    session = jss.Session(objects={"kv": kv.append((rows, rows))})
    copy = {"dense": lambda: jax.block_until_ready(session.fork())}
    return interleaved(copy, rounds=rounds, repeat=3)["dense"]


def attend_timings(*, tokens: int, implementations: tuple[str, ...], rounds: int) -> list[dict]:
    """``attend`` over ``tokens`` tokens in pages of PAGE rows against the same rows in a dense cache."""
    paged = jss.PagedKVCache.allocate(max_slots=1, kv_heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                                      num_pages=tokens // PAGE)
    dense = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=tokens)
    append = jax.jit(lambda c, chunk: c.append(chunk), donate_argnums=0)
    rng = np.random.default_rng(1)
    for _ in range(tokens // FILL):
        k, v = (jnp.asarray(rng.normal(size=(1, FILL, HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
        paged, dense = append(paged, jss.KVChunk(k, v)), append(dense, jss.KVChunk(k, v))
    rows = []
    for implementation in implementations:
        attend = jax.jit(functools.partial(jss.attend, implementation=implementation))
        for T in (1, 16):
            q = jnp.asarray(rng.normal(size=(1, T, HEADS, HEAD_DIM)), jnp.float32)
            out_paged, out_dense = attend(q, paged.view()), attend(q, dense.view())
            assert float(jnp.max(jnp.abs(out_paged - out_dense))) < 1e-5
            t = interleaved({"paged": lambda q=q, attend=attend: attend(q, paged.view()).block_until_ready(),
                             "dense": lambda q=q, attend=attend: attend(q, dense.view()).block_until_ready()},
                            rounds=rounds, repeat=3, best_of=True)
            ratio = t["paged"] / t["dense"]
            case = f"attend T={T}, {tokens // 1024}k tokens, implementation={implementation!r}"
            rows.append({"measure": f"{case}: paged (us)", "value": t["paged"] * 1e6})
            rows.append({"measure": f"{case}: dense (us)", "value": t["dense"] * 1e6})
            bar = {"bar": f"≤ {BARS['attend_paged_over_dense']}", "holds": ratio <= BARS["attend_paged_over_dense"]}
            rows.append({"measure": f"ratio {case}: paged over dense", "value": ratio,
                         **(bar if implementation == "auto" else {})})
    return rows


def path_rows(*, full: bool) -> list[dict]:
    """The forks and reads of one process, on the native path its environment selects."""
    rounds = 31 if full else 11
    forks = fork_timings(rounds=rounds)
    ratio = forks["long"] / forks["short"]
    return [
        {"measure": f"paged fork, {SHORT + 5} tokens (us)", "value": forks["short"] * 1e6},
        {"measure": f"paged fork, {LONG + 5} tokens (us)", "value": forks["long"] * 1e6},
        {"measure": "ratio fork_32k_over_1k", "value": ratio, "bar": f"≤ {BARS['fork_32k_over_1k']}",
         "holds": ratio <= BARS["fork_32k_over_1k"]},
        *attend_timings(tokens=4 * 1024, implementations=("auto",), rounds=rounds),
        *attend_timings(tokens=32 * 1024, implementations=("auto", "loop"), rounds=rounds),
    ]


def _path_child(path: str | None, *, full: bool) -> list[dict]:
    """``path_rows`` in a fresh process on native path ``path`` (None: the kernel off)."""
    command = f"exec {shlex.quote(sys.executable)} -m benchmarks.paged path" + (" --full" if full else "")
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, cwd=ROOT,
                          env=path_env(path))
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(*, full: bool) -> list[dict]:
    """Every native path's forks and reads, a dense deep copy for scale, and the bars."""
    rows: list[dict] = [{"measure": f"CPU: {cpu_description()}", "value": ""}]
    long_fork = []
    for path in native_paths():
        for row in _path_child(path, full=full):
            rows.append({**row, "measure": f"[{path or 'no native'}] {row['measure']}", "path": path})
            if row["measure"].startswith(f"paged fork, {LONG + 5}"):
                long_fork.append(row["value"])
    dense = dense_fork_timing(rounds=5 if full else 3)
    rows.append({"measure": f"dense deep copy, {LONG + 5} tokens (us)", "value": dense * 1e6})
    rows.append({"measure": "ratio dense_copy_over_paged_fork_32k (slowest path)",
                 "value": dense * 1e6 / max(long_fork)})
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["path"]:
        print(f"{_library.status()}", file=sys.stderr)
        print(json.dumps(path_rows(full="--full" in sys.argv[2:])))
    else:
        cli("paged", run, __doc__)
