"""Reads cost what is valid, on every instruction-set path: ``jss.attend`` against capacity, PyTorch and flax nnx.

Measures, in one run (batch 1, 8 query heads over 8 kv-heads x 64, float32):

(a) ``attend`` over a 32k-capacity cache holding 1k tokens against a
    1k-capacity cache holding the same tokens (bar <= 1.5);
(b) the rollout step, rollouts, bfloat16 caches (one read again and
    again, and eight layers' read in turn) and (e) the byte bound,
    once per path of the native kernel the CPU runs (``baseline``,
    ``avx2``, ``avx512``; ``benchmarks.attention_steps`` in a process per
    path, ``JSS_NATIVE_ISA`` set, and PyTorch limited to the same vector
    width through ``ATEN_CPU_CAPABILITY``); every row names its path;
(c) a one-token decode step with projections against
    ``flax.nnx.MultiHeadAttention(decode=True)`` at capacity 8k (bar <= 0.1);
(d) where the step's time goes, on the path in use and for the pure loop
    (``benchmarks._attention_breakdown``);
(f) peak resident memory of a donated 32k rollout in a fresh process
    against its logical bytes (bar <= 1.25).

The table names the CPU (model, AVX2 and AVX-512 yes/no) in its first row.
GPU rows come from ``benchmarks/device.py``, run on a GPU (its JSON
committed; "On accelerators" below): there ``attend`` reads the split-K
Pallas kernel by default where a CUDA GPU is attached, faster than the
bucketed pass in every row measured; TPU reads buckets, unmeasured.  Nor
are aarch64 rows: the kernel's aarch64
build passes its tests under emulation (``benchmarks/NOTES.md``), which
says nothing of its speed.  XLA's own dots in the pure loop dispatch to
the widest vectors the CPU has whatever path is forced, so on an AVX-512
CPU the pure loop of the ``avx2`` and ``baseline`` rows is faster than it
would be on a CPU of that kind.  On the ``baseline`` (SSE2) path a
bfloat16 cache is bound by its instructions (no FMA, no one-instruction
widening) while float32 reads near memory speed, so its bar (<= 0.7 of
float32) holds only while float32 waits on memory for more than half its
time: about 0.86 with float32's rows in L2 and 0.5-0.6 with them in main
memory, as a model's layers are (the eight-layer row);
``benchmarks/NOTES.md`` has the measurements.

Steps timed at a fixed valid length append after it and then rewind the
length (one integer, inside the same jitted call), so every call writes the
same rows.  JAX dispatches synchronously here
(``jax_cpu_enable_async_dispatch=False``, set before the CPU backend
starts), as PyTorch eager runs.  Timings interleave the candidates round by
round with a pause between them, take the fastest of a few calls per round
and the median over rounds.

Run:  python -m benchmarks.attention [--full] [--out PATH]
"""

from __future__ import annotations

import jax

from benchmarks import _attention_parts as parts
from benchmarks._attention_breakdown import breakdown_rows
from benchmarks._attention_others import capacity_rows, memory_rows, nnx_rows
from benchmarks._attention_parts import rows_on_path
from benchmarks._common import cli, native_paths
from jax_session_state._core import _library


def run(*, full: bool) -> list[dict]:
    """Every part at the quick sizes, or the large ones."""
    parts.load_torch()
    rounds = 15 if full else 7
    if parts.torch is None:
        print(parts.NO_TORCH)
    cpu = parts.cpu_description()
    print(f"CPU: {cpu}; native kernel paths this CPU runs: "
          f"{[name for name, ok in _library.ISAS.items() if ok] or 'none (not built)'}")
    rows = [{"measure": f"CPU: {cpu}", "value": "; ".join(f"{name}: {'runs' if ok else 'lacks'}"
                                                          for name, ok in _library.ISAS.items())}]
    rows += capacity_rows(rounds)
    for path in native_paths():
        rows += rows_on_path("benchmarks.attention_steps", path, full=full)
    rows += nnx_rows([256, 1024, 4096], rounds)
    cached = parts.copy_bandwidth(16 << 20)
    kernels = ["native", "pure"] if _library.enabled() else ["pure"]
    for T in (16, 1):
        for kernel in kernels:
            rows += breakdown_rows(T, 4096 - T, rounds, cached, kernel)
    cases = [("donated", 1), ("scan", 1), ("copied", 1)] + ([("donated", 4)] if full else [])
    rows += memory_rows(cases)
    for r in rows:
        r["cpu"] = cpu
    return rows


if __name__ == "__main__":
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the CPU backend starts (see above)
    cli("attention", run, __doc__,
        columns=["part", "case", "measured", "reference", "unit", "ratio", "bar", "holds", "note"])
