"""Decode attention and the world-model step on an accelerator: ``python -m benchmarks.device``.

Written for one GPU (or TPU) and to finish within 4 minutes there; runs
anywhere (``--tiny``: small sizes, for a CPU smoke run).  Measures, bfloat16
caches of 8 kv-heads x 128 and 32 query heads (GQA 4), capacity 128k:

- decode attention at T = 1 and T = 16, batch 1 / 8 / 32, valid 4k / 32k /
  128k tokens (each row's valid length, batch rows alike), for each of
  ``jss.attend``'s implementations that runs on the platform (``"loop"``;
  ``"bucketed"``, one fused pass over a power-of-two bucket of the valid
  prefix; on GPU ``"pallas"``, the split-K Pallas kernel, and ``"auto"``,
  what a user gets: the kernel on CUDA where a GPU is attached, measured
  faster than buckets in every row): the K/V bytes read (valid tokens only)
  per second, against the device's peak HBM bandwidth (a table of device
  kinds; the measured copy bandwidth beside it) and against
  ``jax.nn.dot_product_attention`` (cuDNN where it runs, else XLA; each
  row names which) over exactly the valid tokens, token-major as it wants
  them (sliced outside the timing);
- the world-model step (``examples/world_model.py``, 16 frames after a 4k
  prefix in a 32k cache): the library's jitted rollout against the same
  rollout hand-written on raw arrays (bar: library <= 1.05 x raw).

A row's candidates (its implementations and the reference) are timed
together, round-robin, each round a run of calls queued back to back
(:func:`per_call`), so a call measures the device's work rather than the
host's round trip, and the candidates share the device's clocks.

Bars (GPU, when measured): 32k valid, batch 8, T = 1: >= 50% of peak HBM
bandwidth and <= 1.2 x ``dot_product_attention`` on the valid tokens.

Before anything is timed the device copies for 3 s (``WARM_UP_S``),
so that the first case does not meet a GPU's idle clock.

An accelerator is often at hand for minutes only, so one run must bring
back what it could measure: the bars' case goes first, a case that fails
(out of memory, a kernel that does not lower) is recorded with its error
and the run goes on, cases past ``--budget`` seconds are recorded as not
measured, and the JSON is rewritten after every case, so a run killed
from outside still leaves its finished rows.

``--sweep`` measures only ``"pallas"`` at the bars' case, T = 1 and 16,
for each setting of the kernel's block size, programs, warps and pipeline
stages (``SWEEP``: 24 compiles, about a minute on an H200), so the run
after it can keep the fastest.

Run:  python -m benchmarks.device [--tiny] [--sweep] [--budget SECONDS] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_session_state as jss
from benchmarks._common import RESULTS, interleaved, report
from jax_session_state._core import _library
from jax_session_state.attention import _pallas as kernel

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128
PEAK_HBM = {  # bytes per second, by jax.Device.device_kind (the vendors' figures)
    "NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12, "NVIDIA A100-SXM4-40GB": 1.555e12, "NVIDIA A100 80GB PCIe": 1.935e12,
    "NVIDIA L4": 0.3e12, "TPU v4": 1.2e12, "TPU v5 lite": 0.819e12, "TPU v5": 2.765e12, "TPU v6 lite": 1.64e12,
}
BARS = {"peak_fraction": 0.5, "over_dot_product_attention": 1.2, "library_over_raw": 1.05}
BAR_CASE = (8, 32768, 1)  # (batch, valid, T) the bars are read at
BUDGET_S = 210.0  # seconds of cases, leaving the 4 minutes' rest for start-up and the world-model step


ROUND_S = 0.02
"""Seconds one timed round of a candidate aims for (its calls queued back to back)."""


def _queued(fn: Callable[..., Any], args: tuple, calls: int) -> None:
    """``calls`` calls of ``fn(*args)`` dispatched without waiting, then one wait for the last."""
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)


def per_call(candidates: dict[str, tuple[Callable[..., Any], tuple]], *, rounds: int) -> dict[str, float]:
    """Seconds per call of each candidate ``name -> (fn, args)``, measured together.

    One call compiles, one sizes the candidate's round (enough calls to last
    :data:`ROUND_S`, at most 100); then ``rounds`` rounds, round-robin over the
    candidates, each a round of calls queued back to back; a candidate's time
    is its median round's mean.  Queued, a device runs one call while the
    host dispatches the next, as a rollout's steps do, so a call measures the
    device's work, not the host's round trip; round-robin, the candidates of
    one row share the device's clocks and neighbours.
    """
    runs, calls = {}, {}
    for name, (fn, args) in candidates.items():
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls[name] = max(1, min(100, int(ROUND_S / max(time.perf_counter() - start, 1e-6))))
        runs[name] = functools.partial(_queued, fn, args, calls[name])
    medians = interleaved(runs, rounds=rounds, repeat=1)
    return {name: medians[name] / calls[name] for name in candidates}


WARM_UP_S = 3.0
"""Seconds the device copies before anything is timed: a GPU idles at a low
clock and takes about a second of work to raise it (an H200 read 345 MHz
when a run began), and the bars' case is timed first."""


def _copy(nbytes: int) -> tuple[Callable[[jax.Array], jax.Array], jax.Array]:
    return jax.jit(lambda x: x * jnp.bfloat16(1.0)), jnp.ones((nbytes // 2,), jnp.bfloat16)


def warm_up(seconds: float, nbytes: int) -> int:
    """Keeps the device copying ``nbytes`` for at least ``seconds``; returns how many copies ran."""
    copy, x = _copy(nbytes)
    copies, deadline = 0, time.perf_counter() + seconds
    while copies == 0 or time.perf_counter() < deadline:
        jax.block_until_ready(copy(x))
        copies += 1
    return copies


def copy_bandwidth(nbytes: int) -> float:
    """Device copy bandwidth, bytes read + written per second."""
    copy, x = _copy(nbytes)
    return 2 * x.nbytes / per_call({"copy": (copy, (x,))}, rounds=5)["copy"]


def _view(batch: int, capacity: int, valid: int, key: jax.Array) -> jss.KVView:
    k, v = jax.random.normal(key, (2, batch, KV_HEADS, capacity, HEAD_DIM), jnp.bfloat16)
    lengths = jnp.full((batch,), valid, jnp.int32)
    return jss.KVView(k=k, v=v, lengths=lengths, positions=jnp.zeros((batch, capacity), jnp.int32))


def _reference(q: jax.Array, view: jss.KVView, valid: int) -> tuple[Any, tuple[jax.Array, ...], str]:
    """``jax.nn.dot_product_attention`` over exactly the valid tokens (cuDNN where it runs), its operands and the
    implementation that ran (``"cudnn"`` or ``"xla"``)."""
    k, v = (x[:, :, :valid].transpose(0, 2, 1, 3) for x in (view.k, view.v))  # token-major, outside the timing
    T = q.shape[1]
    # One query row sees every valid token: no mask, which cuDNN would have to read as a bias.
    mask = jnp.tril(jnp.ones((T, valid), bool), valid - T)[None, None] if T > 1 else None
    for implementation in ("cudnn", "xla"):
        fn = jax.jit(functools.partial(jax.nn.dot_product_attention, mask=mask, implementation=implementation))
        try:
            jax.block_until_ready(fn(q, k, v))
        except Exception as error:  # cuDNN refuses some shapes and platforms: fall back to XLA
            print(f"dot_product_attention(implementation={implementation!r}) does not run here: {_failure(error)}")
            continue
        return fn, (q, k, v), implementation
    raise RuntimeError("jax.nn.dot_product_attention runs nowhere here")


def _failure(error: Exception) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def _cases(batches: list[int], valids: list[int]) -> list[tuple[int, int, int]]:
    """Every (batch, valid, T), the bars' case first, then by batch so that a batch's cache is made once."""
    cases = [(batch, valid, T) for batch in batches for valid in valids for T in (1, 16)]
    return sorted(cases, key=lambda case: (case != BAR_CASE, case[0] != BAR_CASE[0]))


def default_implementations(*, tiny: bool) -> list[str]:
    """``jss.attend``'s implementations a run measures here: ``"loop"`` and ``"bucketed"``; ``"pallas"`` on GPU
    (compiled through Triton; in a ``tiny`` run on CPU too, interpreted: a smoke run of its path, not a
    timing) and ``"auto"`` there (what a user gets); ``"native"`` where the native kernel is in use."""
    gpu = jax.default_backend() == "gpu"
    pallas = gpu or (tiny and jax.default_backend() == "cpu")
    native = _library.enabled()
    return (["loop", "bucketed"] + (["pallas"] if pallas else []) + (["auto"] if gpu else [])
            + (["native"] if native else []))


def attention_rows(*, batches: list[int], valids: list[int], capacity: int, rounds: int, peak: float | None,
                   copy: float, deadline: float = float("inf"), implementations: list[str] | None = None,
                   on_rows: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Decode attention rows, one per case and implementation, each case's implementations and reference timed
    together (:func:`per_call`).

    A case started after ``deadline`` (``time.perf_counter()``), or whose
    reference or implementation raises, gets a row saying why it was not
    measured; ``on_rows`` sees the rows so far after every case, measured or not.
    """
    rows: list[dict] = []
    key = jax.random.key(0)
    if implementations is None:
        implementations = default_implementations(tiny=False)
    # One jitted function per implementation: cases of the same batch and T (valid lengths differ only in
    # value) share its compiled step, so a GPU run compiles 6 steps per implementation, not 18.
    fns = {implementation: jax.jit(functools.partial(jss.attend, implementation=implementation))
           for implementation in implementations}
    view = None
    for batch, valid, T in _cases(batches, valids):
        measures = {implementation: f"attend T={T} batch {batch} valid {valid}: {implementation}"
                    for implementation in implementations}
        if time.perf_counter() > deadline:
            rows += [{"measure": measure, "not measured": "past the time budget"} for measure in measures.values()]
            on_rows(rows)
            continue
        try:
            if view is None or view.k.shape[0] != batch:
                view = None  # the last batch's cache is freed before the next one is made
                view = _view(batch, capacity, valid, key)
            else:
                view = view.replace(lengths=jnp.full((batch,), valid, jnp.int32))
            q = jax.random.normal(key, (batch, T, Q_HEADS, HEAD_DIM), jnp.bfloat16)
            reference, args, reference_implementation = _reference(q, view, valid)
            expected = np.asarray(reference(*args), np.float32)
        except Exception as error:  # out of memory on an accelerator: this case goes unmeasured
            rows += [{"measure": measure, "not measured": f"reference: {_failure(error)}"}
                     for measure in measures.values()]
            on_rows(rows)
            continue
        errors, failures = {}, {}
        for implementation in implementations:
            try:
                output = np.asarray(fns[implementation](q, view), np.float32)
                errors[implementation] = float(np.max(np.abs(output - expected)))
            except Exception as failure:  # out of memory, or a kernel that does not lower: recorded, not fatal
                failures[implementation] = _failure(failure)
        try:
            seconds = per_call({"reference": (reference, args),
                                **{name: (fns[name], (q, view)) for name in errors}}, rounds=rounds)
        except Exception as failure:
            failures.update(dict.fromkeys(errors, _failure(failure)))
            errors = {}
        del args
        moved = 2 * batch * KV_HEADS * valid * HEAD_DIM * 2  # K and V bytes of the valid tokens
        for implementation, measure in measures.items():
            if implementation in failures:
                rows.append({"measure": measure, "not measured": failures[implementation]})
                continue
            time_s, ref_s = seconds[implementation], seconds["reference"]
            rate = moved / time_s
            row = {"measure": measure, "us": time_s * 1e6, "GB/s": rate / 1e9,
                   "of peak": rate / peak if peak else None, "of copy": rate / (copy / 2),
                   "over dot_product_attention": time_s / ref_s,
                   "dot_product_attention us": ref_s * 1e6,
                   "dot_product_attention implementation": reference_implementation,
                   "max abs error": errors[implementation]}
            if (batch, valid, T) == BAR_CASE and peak:
                row["holds"] = (rate / peak >= BARS["peak_fraction"]
                                and time_s / ref_s <= BARS["over_dot_product_attention"])
                row["bar"] = f"≥ {BARS['peak_fraction']} of peak, ≤ {BARS['over_dot_product_attention']}x"
            rows.append(row)
        on_rows(rows)
    return rows


SWEEP = {"BLOCK_KEYS": (32, 64, 128), "PROGRAMS": (256, 1024), "WARPS": (4, 8), "STAGES": (2, 3)}
"""The Pallas kernel's settings ``--sweep`` tries (module constants of ``jax_session_state.attention._pallas``)."""


def sweep_rows(*, batch: int, valid: int, capacity: int, rounds: int, peak: float | None,
               deadline: float = float("inf"), on_rows: Callable[[list[dict]], None] = lambda rows: None
               ) -> list[dict]:
    """``"pallas"`` at one case (T = 1 and T = 16) for every combination of :data:`SWEEP`'s settings, a fresh
    compile each; a setting that fails, or comes after ``deadline``, gets a row saying why; ``on_rows`` sees the
    rows so far after each."""
    rows, key = [], jax.random.key(0)
    view = _view(batch, capacity, valid, key)
    moved = 2 * batch * KV_HEADS * valid * HEAD_DIM * 2
    defaults = {name: getattr(kernel, name) for name in SWEEP}
    try:
        for T in (1, 16):
            q = jax.random.normal(key, (batch, T, Q_HEADS, HEAD_DIM), jnp.bfloat16)
            expected = np.asarray(jss.attend(q, view, implementation="bucketed"), np.float32)
            for values in itertools.product(*SWEEP.values()):
                settings = dict(zip(SWEEP, values))
                measure = f"pallas T={T} batch {batch} valid {valid}: " + " ".join(
                    f"{name.lower()} {value}" for name, value in settings.items())
                if time.perf_counter() > deadline:
                    rows.append({"measure": measure, "not measured": "past the time budget"})
                    on_rows(rows)
                    continue
                for name, value in settings.items():
                    setattr(kernel, name, value)
                fn = jax.jit(functools.partial(jss.attend, implementation="pallas"))  # traced with these settings
                try:
                    error = float(np.max(np.abs(np.asarray(fn(q, view), np.float32) - expected)))
                    seconds = per_call({"pallas": (fn, (q, view))}, rounds=rounds)["pallas"]
                except Exception as failure:  # a setting Triton refuses (shared memory): recorded, not fatal
                    rows.append({"measure": measure, "not measured": _failure(failure)})
                    on_rows(rows)
                    continue
                rate = moved / seconds
                rows.append({"measure": measure, "us": seconds * 1e6, "GB/s": rate / 1e9,
                             "of peak": rate / peak if peak else None, "max abs error": error})
                on_rows(rows)
    finally:
        for name, value in defaults.items():
            setattr(kernel, name, value)
    return rows


def world_model_rows(*, prefix: int, frames: int, rounds: int) -> list[dict]:
    """The library's world-model rollout against the same rollout on raw arrays (per frame)."""
    from benchmarks import _rollout_baselines as baselines
    from benchmarks.rollout import CAPACITY, Setup

    s = Setup(prefix, frames)
    cond = baselines.cond_view(s.snapshot)
    raw = jax.jit(functools.partial(baselines.raw_rollout, s.graphdef), donate_argnums=2)

    def library():
        return s.rollout(s.params, s.session.fork(), s.actions)

    def raw_run():
        return raw(s.params, cond, baselines.raw_state(s.snapshot, CAPACITY), s.actions)

    np.testing.assert_allclose(np.asarray(library()[1]), np.asarray(raw_run()[1]), rtol=2e-3, atol=2e-3)
    seconds = per_call({"library": (library, ()), "raw": (raw_run, ())}, rounds=rounds)
    t_library, t_raw = seconds["library"] / frames, seconds["raw"] / frames
    ratio = t_library / t_raw
    return [{"measure": f"world-model step after {prefix} tokens: library (us per frame)", "us": t_library * 1e6},
            {"measure": f"world-model step after {prefix} tokens: raw JAX (us per frame)", "us": t_raw * 1e6},
            {"measure": "world-model step: library over raw JAX", "over raw": ratio,
             "bar": f"≤ {BARS['library_over_raw']}", "holds": ratio <= BARS["library_over_raw"]}]


def partial_writer(out: Path, name: str = "device") -> Callable[[list[dict]], None]:
    """Writes the rows so far to ``out`` as JSON marked ``"partial"``: what a run killed from outside leaves."""
    start, device_kind = time.perf_counter(), jax.devices()[0].device_kind

    def write(rows: list[dict]) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": name, "rows": rows, "partial": True, "device_kind": device_kind,
                                   "seconds": time.perf_counter() - start}, indent=2, default=str))

    return write


def run(*, tiny: bool, budget: float = BUDGET_S, sweep: bool = False,
        on_rows: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every row; attention cases past ``budget`` seconds are recorded as not measured.  With ``sweep`` only
    :func:`sweep_rows`, at the bars' case (``tiny``: batch 2, 1024 valid)."""
    deadline = time.perf_counter() + budget
    device = jax.devices()[0]
    peak = PEAK_HBM.get(device.device_kind)
    warm_up(0.0 if tiny else WARM_UP_S, 1 << 24 if tiny else 1 << 30)
    if sweep:
        batch, valid, _ = (2, 1024, 1) if tiny else BAR_CASE
        return sweep_rows(batch=batch, valid=valid, capacity=1024 if tiny else 131072, rounds=2 if tiny else 5,
                          peak=peak, deadline=deadline, on_rows=on_rows)
    copy = copy_bandwidth(1 << 24 if tiny else 1 << 30)
    print(f"device: {device.device_kind} ({jax.default_backend()}); peak HBM "
          f"{f'{peak / 1e9:.0f} GB/s' if peak else 'unknown'}; copy {copy / 1e9:.0f} GB/s (r+w)")
    if tiny:
        rows = attention_rows(batches=[2], valids=[300, 1024], capacity=1024, rounds=2, peak=peak, copy=copy,
                              deadline=deadline, implementations=default_implementations(tiny=True), on_rows=on_rows)
        return rows + world_model_rows(prefix=256, frames=2, rounds=1)
    rows = attention_rows(batches=[1, 8, 32], valids=[4096, 32768, 131072], capacity=131072, rounds=5, peak=peak,
                          copy=copy, deadline=deadline, on_rows=on_rows)
    try:
        return rows + world_model_rows(prefix=4096, frames=16, rounds=5)
    except Exception as error:  # the attention rows are kept
        return rows + [{"measure": "world-model step: library over raw JAX", "not measured": _failure(error)}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small sizes: a smoke run, on CPU too")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help="seconds after which attention cases are recorded as not measured")
    p.add_argument("--sweep", action="store_true",
                   help="only the Pallas kernel's settings at the bars' case (its own JSON, device_sweep.json)")
    p.add_argument("--out", type=Path, default=None, help="where to write the JSON results")
    args = p.parse_args()
    name = "device_sweep" if args.sweep else "device"
    out = args.out or RESULTS / f"{name}.json"
    start = time.perf_counter()
    rows = run(tiny=args.tiny, budget=args.budget, sweep=args.sweep, on_rows=partial_writer(out, name))
    columns = ["measure", "us", "GB/s", "of peak", "of copy", "over dot_product_attention", "over raw", "bar",
               "holds", "not measured"]
    report(name, rows, columns, out, seconds=time.perf_counter() - start, device_kind=jax.devices()[0].device_kind)


if __name__ == "__main__":
    main()
