"""Forks cost what differs: 64 speculative lanes over a 32k-token prefix against 64 deep forks.

Measures, in one run (one K/V cache, 8 kv-heads x 64, float32):

- memory by accounting: ``Session.branch(64, window=256)`` over a 32k-token
  prefix against 64 ``Session.fork()`` deep copies (bar: branch bytes <=
  prefix + 1.1 x 64 x window bytes);
- one jitted, donated step of the 64-lane rollout (stage 16 rows per lane,
  cascade attention via ``Branches.map`` and ``jss.attend`` on
  ``lane.view()["kv"]``) against the same step over 64 deep forks (append 16
  rows + ``jss.attend``), each the mean over a rollout filling the 256-row
  windows (target ratio <= 0.5).  The forks are real deep copies, but only
  a few are held at once (each is 128 MiB): a fork's step reads only its
  own cache, so 64 forks cost 64 x the mean step of the forks held.  Both
  sides do the same arithmetic (64 x 16 queries over 32k keys, about 69
  GFLOP a step): the lanes read the prefix once instead of 64 times, which
  saves memory traffic but no arithmetic, so where both sides run at the
  arithmetic's pace (the native CPU kernel) the ratio stays above 0.5:
  0.41 on an AMD EPYC of family 26 (Zen 5), 0.62 on family 25 (Zen 4),
  whose lanes' step runs at 163 GFLOP/s, the rate of XLA's own float32
  matmul on its two cores (168), the forks' at 100;
- whether, under ``vmap`` over lanes, the prefix is read once for all lanes:
  with the native kernel, one kernel call takes the prefix with every
  lane's queries as its rows; with the pure loop, every dynamic slice of
  the prefix cache must have the unbatched block shape (no per-lane gather);
- paged attention (``jss.attend`` on ``pool.view()``: the pages read where
  they lie, through the page table, never gathered into a dense copy)
  against dense attention on the same 32k tokens (ratio reported), and the
  paged fork at 32k against 1k tokens from ``benchmarks.paged`` (bar <= 1.3).

Run:  python -m benchmarks.branches [--full] [--out PATH]
"""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from benchmarks import paged
from benchmarks._common import cli, interleaved
from jax_session_state._core import _library

HEADS, HEAD_DIM = 8, 64
PREFIX, LANES, WINDOW, CHUNK = 32768, 64, 256, 16
BARS = {"branch_bytes_over_budget": 1.0, "branch_step_over_forks": 0.5, "fork_32k_over_1k": 1.3}
RNG = np.random.default_rng(0)


def _rows(*shape: int) -> jax.Array:
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def prefix_session(extra: int) -> jss.Session:
    """A session whose K/V cache holds PREFIX random tokens, with room for ``extra`` more."""
    cache = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=PREFIX + extra)
    append = jax.jit(lambda c, k, v: c.append((k, v)), donate_argnums=0)
    for _ in range(0, PREFIX, 4096):
        cache = append(cache, _rows(1, 4096, HEADS, HEAD_DIM), _rows(1, 4096, HEADS, HEAD_DIM))
    return jss.Session(objects={"kv": cache})


# ---------------------------------------------------------------------- memory
def memory_rows(session: jss.Session) -> list[dict]:
    branches = session.branch(LANES, window=WINDOW)
    window_bytes = 2 * WINDOW * HEADS * HEAD_DIM * 4  # one lane's K and V rows
    budget = session.nbytes + 1.1 * LANES * window_bytes
    one_fork = session.fork().nbytes  # every deep copy holds the same bytes
    return [
        {"measure": "prefix session (MiB)", "value": session.nbytes / 2**20},
        {"measure": f"{LANES} branches, window {WINDOW} (MiB)", "value": branches.nbytes / 2**20},
        {"measure": f"{LANES} deep forks (MiB)", "value": LANES * one_fork / 2**20},
        {"measure": "ratio branch bytes / (prefix + 1.1 x lanes x window)", "value": branches.nbytes / budget,
         "bar": "≤ 1.0", "holds": branches.nbytes <= budget},
        {"measure": "ratio branch bytes / fork bytes", "value": branches.nbytes / (LANES * one_fork)},
    ]


# ------------------------------------------------------------------------ steps
def lane_step(lane: jss.Lane, q: jax.Array, k: jax.Array, v: jax.Array):
    """One lane's step: stage a chunk, attend over the prefix and the lane's rows."""
    lane = lane.stage(kv=(k, v))
    return lane, jss.attend(q, lane.view()["kv"])


@functools.partial(jax.jit, donate_argnums=0)
def branch_step(branches: jss.Branches, q: jax.Array, k: jax.Array, v: jax.Array):
    """The 64-lane step under vmap (the prefix buffers pass through, aliased)."""
    return branches.map(lane_step, q, k, v)


@functools.partial(jax.jit, donate_argnums=0)
def fork_step(session: jss.Session, q: jax.Array, k: jax.Array, v: jax.Array):
    """One deep fork's step: append a chunk, attend over everything it holds."""
    session = session.append(kv=(k, v))
    return session, jss.attend(q, session.view()["kv"])


def step_rows(session: jss.Session, steps: int, forks_held: int, rounds: int) -> tuple[list[dict], jss.Session]:
    """Mean per step over the first ``steps`` steps of a rollout into the windows: 64 lanes against 64 forks."""
    qs = _rows(steps, LANES, 1, CHUNK, HEADS, HEAD_DIM)
    ks, vs = _rows(steps, LANES, 1, CHUNK, HEADS, HEAD_DIM), _rows(steps, LANES, 1, CHUNK, HEADS, HEAD_DIM)
    box = {"prefix": session}

    def lanes():
        branches = box["prefix"].branch(LANES, window=WINDOW)
        jax.block_until_ready(branches)
        start = time.perf_counter()
        for s in range(steps):
            branches, out = branch_step(branches, qs[s], ks[s], vs[s])
        out.block_until_ready()
        elapsed = time.perf_counter() - start
        box["prefix"] = branches.discard()
        return elapsed

    def forks():
        held = [box["prefix"].fork() for _ in range(forks_held)]
        jax.block_until_ready(held)
        start = time.perf_counter()
        for s in range(steps):
            for i in range(forks_held):
                held[i], out = fork_step(held[i], qs[s, i], ks[s, i], vs[s, i])
        out.block_until_ready()
        return (time.perf_counter() - start) * LANES / forks_held

    _check_lanes_equal_forks(box["prefix"], qs[0], ks[0], vs[0])
    samples = {"lanes": [], "forks": []}
    for _ in range(rounds + 1):  # the first round compiles
        for name, run in (("lanes", lanes), ("forks", forks)):
            time.sleep(0.005)
            samples[name].append(run() / steps)
    t = {name: float(np.median(s[1:])) for name, s in samples.items()}
    ratio = t["lanes"] / t["forks"]
    flops = 4 * LANES * CHUNK * HEADS * (PREFIX + WINDOW // 2) * HEAD_DIM  # Q@K^T and P@V, mid-window
    ceiling = matmul_flops_per_second(rounds)
    rows = [
        {"measure": f"step of {LANES} lanes, cascade attention (ms; mean of steps 1-{steps})",
         "value": t["lanes"] * 1e3, "note": f"{flops / t['lanes'] / 1e9:.0f} GFLOP/s"},
        {"measure": f"step of {LANES} deep forks (ms; {forks_held} held, x {LANES // forks_held})",
         "value": t["forks"] * 1e3, "note": f"{flops / t['forks'] / 1e9:.0f} GFLOP/s"},
        {"measure": "ratio branch step / fork step", "value": ratio, "bar": "≤ 0.5",
         "holds": ratio <= BARS["branch_step_over_forks"]},
        {"measure": "XLA float32 matmul on this CPU (GFLOP/s; the arithmetic's ceiling)", "value": ceiling / 1e9},
        {"measure": "ratio of the lanes' step at that ceiling / fork step (the best the lanes can reach)",
         "value": flops / ceiling / t["forks"]},
    ]
    return rows, box["prefix"]


def matmul_flops_per_second(rounds: int, n: int = 2048) -> float:
    """The rate of XLA's own float32 matmul where it is bound by arithmetic alone (``n`` x ``n`` by ``n`` x ``n``),
    all cores: no step doing the same arithmetic runs faster."""
    a, b = _rows(n, n), _rows(n, n)
    matmul = jax.jit(jnp.matmul)
    seconds = interleaved({"matmul": lambda: matmul(a, b).block_until_ready()}, rounds=rounds + 2, repeat=3,
                          best_of=True)["matmul"]
    return 2 * n**3 / seconds


def _check_lanes_equal_forks(session: jss.Session, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Lane 0's first step equals a deep fork's (the two sides compute the same thing)."""
    branches = session.branch(LANES, window=WINDOW)
    lane = branches.lane(0)
    _, lane_out = jax.jit(lane_step)(lane, q[0], k[0], v[0])
    _, fork_out = fork_step(session.fork(), q[0], k[0], v[0])
    np.testing.assert_allclose(lane_out, fork_out, rtol=1e-4, atol=1e-5)


def prefix_read_once(session: jss.Session) -> dict:
    """The compiled 64-lane step reads the prefix cache once for all lanes.

    With the native kernel: one kernel call takes the prefix, with every
    lane's queries as its query rows.  With the pure loop: every dynamic
    slice of the prefix is one unbatched block.
    """
    branches = session.branch(LANES, window=WINDOW)
    q = k = v = jnp.zeros((LANES, 1, CHUNK, HEADS, HEAD_DIM), jnp.float32)
    hlo = branch_step.lower(branches, q, k, v).compile().as_text()
    cache_shape = f"f32[1,{HEADS},{session['kv'].capacity},{HEAD_DIM}]"
    shapes = dict(re.findall(r"(%[\w.-]+) = (\S+?)\{", hlo))  # instruction -> shape (names are unique)
    calls = [re.findall(r"%[\w.-]+", line.split("custom-call(", 1)[1].split(")", 1)[0])
             for line in hlo.splitlines() if f'custom_call_target="{_library.TARGET}"' in line]
    native_reads = [[shapes.get(name) for name in operands] for operands in calls]
    native_reads = [operands for operands in native_reads if cache_shape in operands]
    if native_reads:
        all_lanes = f"f32[1,{LANES * CHUNK},{HEADS},{HEAD_DIM}]"
        once = len(native_reads) == 1 and native_reads[0][0] == all_lanes
        note = f"native kernel calls reading the {cache_shape} prefix, their operands: {native_reads}"
    else:
        reads = re.findall(r"= (\S+?)\{\S* (dynamic-slice|gather)\((%[\w.-]+)", hlo)
        prefix_reads = sorted({(op, shape) for shape, op, operand in reads if shapes.get(operand) == cache_shape})
        block = re.compile(rf"f32\[1,{HEADS},\d+,{HEAD_DIM}\]")
        once = bool(prefix_reads) and all(op == "dynamic-slice" and block.fullmatch(s) for op, s in prefix_reads)
        note = f"reads of the {cache_shape} prefix: {prefix_reads}"
    return {"measure": "prefix read once for all lanes under vmap (compiled HLO)", "value": once, "holds": once,
            "bar": "once", "note": note}


def paged_rows(session: jss.Session, rounds: int) -> list[dict]:
    """attend() on a paged cache (pages read in place) against the dense cache holding the same tokens."""
    page = paged.PAGE
    dense = session["kv"]
    pool = jss.PagedKVCache.allocate(max_slots=1, kv_heads=HEADS, head_dim=HEAD_DIM, page_size=page,
                                     num_pages=PREFIX // page)
    append = jax.jit(lambda c, k, v: c.append((k, v)), donate_argnums=0)
    view = dense.view()
    for start in range(0, PREFIX, 4096):  # the dense cache's rows, token-major
        rows = [x[:, :, start:start + 4096].transpose(0, 2, 1, 3) for x in (view.k, view.v)]
        pool = append(pool, *rows)
    jss.check(pool)
    q = _rows(1, CHUNK, HEADS, HEAD_DIM)
    attend = jax.jit(jss.attend)
    np.testing.assert_allclose(attend(q, pool.view()), attend(q, view), rtol=1e-5, atol=1e-6)
    paged_view = pool.view()
    t = interleaved({"paged": lambda: attend(q, paged_view).block_until_ready(),
                     "dense": lambda: attend(q, view).block_until_ready()},
                    rounds=rounds, repeat=3, best_of=True, pause=0.005)
    forks = paged.fork_timings(rounds=rounds)
    fork_ratio = forks["long"] / forks["short"]
    return [
        {"measure": f"attend T={CHUNK}, {PREFIX} tokens: paged, read in place (ms)", "value": t["paged"] * 1e3},
        {"measure": f"attend T={CHUNK}, {PREFIX} tokens: dense (ms)", "value": t["dense"] * 1e3},
        {"measure": "ratio paged / dense attention", "value": t["paged"] / t["dense"]},
        {"measure": "ratio paged fork 32k / 1k tokens (benchmarks.paged)", "value": fork_ratio, "bar": "≤ 1.3",
         "holds": fork_ratio <= BARS["fork_32k_over_1k"]},
    ]


def run(*, full: bool) -> list[dict]:
    """Memory, the step against deep forks, the prefix read once, and paged forks."""
    rounds = 7 if full else 3
    session = prefix_session(extra=WINDOW)
    rows = memory_rows(session)
    steps, session = step_rows(session, WINDOW // CHUNK if full else 4, forks_held=16 if full else 8, rounds=rounds)
    rows += steps
    rows.append(prefix_read_once(session))
    return rows + paged_rows(session, rounds)


if __name__ == "__main__":
    cli("branches", run, __doc__, columns=["measure", "value", "bar", "holds", "note"])
