"""Timing and reporting helpers shared by the benchmarks.

The machine may be shared and noisy, so every comparison is measured in one
run, interleaving the candidates round by round, and reported as a ratio of
medians.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

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


def environment() -> dict[str, str]:
    """What the numbers were measured on."""
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": str(jax.devices()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
    }


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table of ``rows``."""
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join([line, rule, *body])


def _cell(value: Any) -> str:
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


def report(name: str, rows: list[dict[str, Any]], columns: list[str], out: Path | None, **extra: Any) -> dict:
    """Prints the table and writes ``{name, rows, environment, ...}`` as JSON."""
    print(table(rows, columns))
    result = {"benchmark": name, "rows": rows, "environment": environment(), **extra}
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {path}")
    return result
