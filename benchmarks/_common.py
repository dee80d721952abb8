"""Timing and reporting helpers shared by the benchmarks.

The machine may be shared and noisy, so every comparison is measured in one
run, interleaving the candidates round by round, and reported as a ratio of
medians.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jax_session_state as jss
from jax_session_state._core import _library

RESULTS = Path(__file__).parent / "results"


def interleaved(
    candidates: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    repeat: int | Mapping[str, int],
    best_of: bool = False,
    pause: float = 0.0,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured round-robin.

    Args:
      candidates: name -> a callable that runs once and blocks until done.
      rounds: rounds of the round-robin; the median is over rounds.
      repeat: calls per candidate per round, one number for all or one per
        candidate; their mean is one sample.
      best_of: take the fastest of a round's calls as its sample instead of
        the mean, after one untimed warm-up call (on a shared machine the
        mean mostly measures the neighbours).
      pause: seconds to sleep before each candidate's calls, so that the
        worker threads of the previous candidate's runtime go idle first.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, run in candidates.items():
            calls = repeat if isinstance(repeat, int) else repeat[name]
            time.sleep(pause)
            if best_of:
                run()
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                samples[name].append(min(times))
                continue
            start = time.perf_counter()
            for _ in range(calls):
                run()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def timed_rounds(
    candidates: Mapping[str, tuple[Callable[[], Any], Callable[[Any], Any]]], *, rounds: int
) -> dict[str, list[float]]:
    """Seconds of every run of each candidate, round-robin, each run on a fresh input.

    Every other round runs the candidates in reverse order, so that no
    candidate always runs right after another.

    Args:
      candidates: name -> ``(setup, run)``: ``setup()`` makes the input (not
        timed, and waited for: under asynchronous dispatch a copy made there
        would otherwise still be running when the clock starts),
        ``run(input)`` runs once and blocks until done (timed).
      rounds: rounds of the round-robin.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:  # no candidate always runs after another
            setup, run = candidates[name]
            given = jax.block_until_ready(setup())
            start = time.perf_counter()
            run(given)
            samples[name].append(time.perf_counter() - start)
    return samples


def with_lengths(cache: jss.KVCache, lengths: Any) -> jss.KVCache:
    """``cache`` (append mode) holding ``lengths`` committed tokens per row, nothing staged.

    Benchmarks rewind a cache this way so that every timed call writes the
    same rows.  Works under ``jit``; a sharded cache stays sharded.
    """
    cache = cache.discard()
    rows = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), cache.committed.shape)
    return cache.with_storage(bookkeeping=cache.bookkeeping.at[0].set(rows))  # row 0: committed tokens


def environment() -> dict[str, str]:
    """What the numbers were measured on: the machine and the versions."""
    versions = {}
    for package in ("jaxlib", "flax", "numpy", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {
        "jax": jax.__version__,
        **versions,
        "backend": jax.default_backend(),
        "devices": str(jax.devices()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu": cpu_name(),
        "cores": str(os.cpu_count()),
        "memory": _memory(),
        "system": platform.system(),
    }


def cpu_info() -> dict[str, str]:
    """The first processor's ``key: value`` fields of /proc/cpuinfo ({} where there is none)."""
    return _proc_fields("/proc/cpuinfo")


def cpu_name() -> str:
    """The CPU as ``lscpu`` names it: its model name, then its family and model where the kernel reports them.

    Two generations of one vendor can share a model name (a virtual machine
    shows "AMD EPYC" for Zen 4 and Zen 5 alike); family and model tell them apart.
    """
    info = cpu_info()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        name += f", family {info['cpu family']} model {info['model']}"
    return name


def vector_isas() -> dict[str, bool]:
    """Whether the CPU has AVX2 and AVX-512 (``avx512f``), by its /proc/cpuinfo flags."""
    flags = cpu_info().get("flags", "").split()
    return {"AVX2": "avx2" in flags, "AVX-512": "avx512f" in flags}


def _proc_fields(path: str) -> dict[str, str]:
    """The ``key: value`` fields of a /proc file up to its first blank line ({} where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open(path) as lines:
            for line in lines:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _memory() -> str:
    total = _proc_fields("/proc/meminfo").get("MemTotal")  # "24576000 kB"
    return f"{int(total.split()[0]) / 2**20:.0f} GiB RAM" if total else "unknown RAM"


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table of ``rows``."""
    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join([line, rule, *body])


def cell(value: Any) -> str:
    """One table cell: floats to 4 significant digits, booleans as yes / NO."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return str(value)


def parser(description: str) -> argparse.ArgumentParser:
    """The command line every benchmark shares: --full and --out."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--full", action="store_true", help="the large sizes (slower)")
    p.add_argument("--out", type=Path, default=None, help="where to write the JSON results")
    return p


def cli(name: str, run: Callable[..., list[dict[str, Any]]], doc: str, columns: list[str] | None = None) -> None:
    """The command line of benchmark ``name``: ``python -m benchmarks.NAME [--full] [--out PATH]``.

    Args:
      name: the module's name under ``benchmarks``.
      run: ``run(full=...)`` measures and returns the rows: dicts with
        ``measure`` and ``value``, and ``bar`` and ``holds`` where a bar applies.
      doc: the module's docstring; its first line describes the command.
      columns: the columns of the printed table (default: those four).
    """
    args = parser(doc.splitlines()[0]).parse_args()
    rows = run(full=args.full)
    report(name, rows, columns or ["measure", "value", "bar", "holds"], args.out)
    bars = [row for row in rows if isinstance(row.get("holds"), bool)]
    failed = [row["measure"] for row in bars if not row["holds"]]
    print(f"bars: {len(bars) - len(failed)} of {len(bars)} hold" + "".join(f"\n  NOT HELD: {m}" for m in failed))


def report(name: str, rows: list[dict[str, Any]], columns: list[str], out: Path | None, **extra: Any) -> dict:
    """Prints the table and writes ``{name, rows, environment, ...}`` as JSON."""
    print(table(rows, columns))
    result = {"benchmark": name, "rows": rows, "environment": environment(), **extra}
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {path}")
    return result


def native_paths() -> list[str | None]:
    """Every path of the native kernel this CPU runs, or ``[None]`` (the kernel off) where it is not built."""
    return [name for name, ok in _library.ISAS.items() if ok] if _library.AVAILABLE else [None]


def path_env(path: str | None) -> dict[str, str]:
    """This process's environment with the native kernel forced onto ``path`` (None: turned off)."""
    env = dict(os.environ)
    if path is None:
        env[_library.ENV_SWITCH] = "0"
    else:
        env[_library.ENV_ISA] = path
    return env
