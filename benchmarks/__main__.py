"""Runs every benchmark, prints one table, writes ``benchmarks/results.json`` and regenerates ``BENCHMARKS.md``.

A benchmark is a module ``benchmarks/NAME.py`` with ``run(*, full: bool) ->
list[dict]`` (its rows: ``measure``, ``value``, and ``bar`` / ``holds`` for a
ratio with a bar) that ends with ``cli(NAME, run, __doc__)``, so it also runs
alone as ``python -m benchmarks.NAME``.  Here each one runs in a fresh
process -- its memory peaks, threads and XLA flags never leak into the next
-- and hands its rows back through its JSON output; its own output goes to
``benchmarks/results/NAME.log``.  Adding a benchmark is one line in
``MODULES``.

Run:  python -m benchmarks [--full] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _report
from benchmarks._common import RESULTS, environment, table, vector_isas

MODULES = [
    "append",
    "attention",
    "branches",
    "checkpoint_digest",
    "frames",
    "manager",
    "multihost",
    "paged",
    "pool",
    "reuse",
    "rollout",
    "sharded",
    "tiers",
]

HERE = Path(__file__).parent
RESULTS_JSON = HERE / "results.json"


def run_module(name: str, *, full: bool) -> dict[str, Any]:
    """Runs ``benchmarks.NAME`` in a fresh process; returns its rows, or a failed row."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out, log = RESULTS / f"{name}.json", RESULTS / f"{name}.log"
    command = [sys.executable, "-m", f"benchmarks.{name}", "--out", str(out)] + (["--full"] if full else [])
    start = time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run(command, cwd=HERE.parent, stdout=handle, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        row = {"measure": f"FAILED (exit {done.returncode}); see {log.relative_to(HERE.parent)}", "holds": False}
        return {"rows": [row], "seconds": seconds, "failed": True}
    return {"rows": json.loads(out.read_text())["rows"], "seconds": seconds, "failed": False, "machine": _machine()}


def _machine() -> str:
    """The CPU this run measures on, with the vector ISAs it has (every native path it can run)."""
    env = environment()
    isas = [name for name, present in vector_isas().items() if present]
    return f"{env['cpu']}, {env['cores']} cores" + (f", {' and '.join(isas)}" if isas else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the large sizes (slower)")
    p.add_argument("--only", nargs="+", choices=MODULES, help="run these; keep the others' last results")
    args = p.parse_args()
    names = args.only or MODULES
    previous = json.loads(RESULTS_JSON.read_text())["benchmarks"] if args.only and RESULTS_JSON.exists() else {}
    results = {name: previous[name] for name in MODULES if name in previous}
    for name in names:
        print(f"benchmarks.{name} ...", end=" ", flush=True)
        results[name] = run_module(name, full=args.full)
        print(f"{'FAILED' if results[name]['failed'] else 'done'} in {results[name]['seconds']:.0f} s")
    rows = [{"benchmark": name, **row} for name, result in results.items() for row in result["rows"]]
    print()
    print(table(rows, ["benchmark", "measure", "value", "bar", "holds"]))
    document = {"environment": environment(), "full": args.full, "benchmarks": results}
    RESULTS_JSON.write_text(json.dumps(document, indent=1, default=str) + "\n")
    _report.write(document, HERE.parent / "BENCHMARKS.md", HERE)
    print(f"\nwrote {RESULTS_JSON.relative_to(HERE.parent)} and BENCHMARKS.md")
    if any(result["failed"] for result in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
