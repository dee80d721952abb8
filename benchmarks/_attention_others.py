"""Parts a, c and f of ``benchmarks.attention``: capacity, flax nnx, and peak memory.

(a) ``attend`` over a 32k-capacity cache holding 1k tokens against a
    1k-capacity cache holding the same tokens (bar <= 1.5);
(c) a one-token decode step with projections against
    ``flax.nnx.MultiHeadAttention(decode=True)`` at capacity 8k (bar <= 0.1);
(f) peak resident memory of a donated 32k rollout in a fresh process
    (launched through ``sh -c``) against its logical cache bytes + the
    process's baseline (bar <= 1.25).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jax_session_state as jss
from benchmarks._attention_parts import (
    BARS,
    BATCH,
    CAPACITY,
    HEAD_DIM,
    HEADS,
    NNX_CAPACITY,
    filled_cache,
    randn,
    relative_error,
    rollout_step,
    row,
    scan_rollout,
    step,
    timed,
)
from benchmarks._common import with_lengths


def capacity_rows(rounds: int) -> list[dict]:
    rows = randn(2, 1, 1024, HEADS, HEAD_DIM)
    big, small = filled_cache(CAPACITY, rows).view(), filled_cache(1024, rows).view()
    attend = jax.jit(jss.attend)
    out = []
    for T in (1, 16):
        q = jnp.asarray(randn(BATCH, T, HEADS, HEAD_DIM))
        assert relative_error(attend(q, big), attend(q, small)) < 1e-6
        t = timed({"32k": lambda q=q: attend(q, big).block_until_ready(),
                    "1k": lambda q=q: attend(q, small).block_until_ready()}, rounds)
        out.append(row("a", f"attend T={T}, 1k valid: capacity 32k vs 1k", t["32k"] * 1e6, t["1k"] * 1e6, "us",
                        bar=BARS["capacity"]))
    return out


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
        cache, out = rollout_step(cache, project("query", x), project("key", x), project("value", x))
        kernel, bias = weights["out"]
        return cache, jnp.einsum("bthd,hde->bte", out, kernel) + bias

    ours = jss.KVCache.allocate(batch=BATCH, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=NNX_CAPACITY)
    xs = jnp.asarray(randn(8, BATCH, 1, features))
    for i, x in enumerate(xs):  # the same decode from empty: same outputs
        ours, a = our_step(ours, x, jnp.int32(i))
        nnx_state, b = nnx_step(nnx_state, x, jnp.int32(i))
        assert relative_error(a, b) < 1e-4
    box = {"ours": ours, "nnx": nnx_state}
    rows = []
    for fill in fills:
        fill_ = jnp.int32(fill)

        def call(name, fn, fill_=fill_):
            box[name], y = fn(box[name], xs[0], fill_)
            y.block_until_ready()

        t = timed({"ours": functools.partial(call, "ours", our_step),
                    "nnx": functools.partial(call, "nnx", nnx_step)}, rounds)
        rows.append(row("c", f"decode 1 token at fill {fill}, capacity 8k: ours vs nnx", t["ours"] * 1e6,
                         t["nnx"] * 1e6, "us", bar=BARS["nnx"]))
    return rows


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
        fn = step if mode == "donated" else jax.jit(rollout_step)  # "copied": not donated
        for _ in range(steps):
            cache, out = fn(cache, x, x, x)
        out.block_until_ready()
    print(json.dumps({"baseline": baseline, "cache": cache.nbytes, "inputs": inputs, "peak": _rss("VmHWM:")}))


def memory_rows(cases: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for mode, batch in cases:
        command = f"'{sys.executable}' -m benchmarks._attention_others --memory-child {mode} {batch}"
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
        rows.append(row("f", f"peak RSS, 32k rollout, {mode}, batch {batch}", r["peak"] / mb, logical / mb, "MB",
                         **extra))
    return rows

if __name__ == "__main__" and sys.argv[1:2] == ["--memory-child"]:
    memory_child(sys.argv[2], int(sys.argv[3]))
