"""MkDocs hook: the benchmark summary, and the figures that BENCHMARKS.md shows.

``docs/benchmarks.md`` sums the last run up, one row per benchmark, made
here from ``benchmarks/results.json`` (one source, so the summary never goes
stale); ``docs/benchmark-results.md`` includes the top-level
``BENCHMARKS.md``, whose images point at ``benchmarks/*.png`` beside it; this
adds those files to the site at the same relative place, so the included
page's images resolve and the strict build checks them like any other link.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    for figure in sorted((ROOT / "benchmarks").glob("*.png")):
        files.append(
            File(
                f"benchmarks/{figure.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


SUMMARY = "<!-- bar summary -->"


def _purpose(benchmark: Path) -> str:
    """The first line of a benchmark module's docstring: what it checks."""
    doc = ast.get_docstring(ast.parse(benchmark.read_text())) or ""
    return doc.strip().splitlines()[0].split(": ``python -m")[0].rstrip(".") if doc.strip() else ""


def bar_summary(results: dict) -> str:
    """One row per benchmark of ``results`` (``benchmarks/results.json``): what it checks, its bars held, the CPU."""
    lines = ["| benchmark | what it checks | bars held | bars missed | CPU |", "|---|---|---|---|---|"]
    for name, result in results["benchmarks"].items():
        bars = [row for row in result["rows"] if row.get("bar") not in (None, "")]
        missed = "; ".join(f"{row['measure']}: {row['value']:.3g} (bar {row['bar']})"
                           for row in bars if not row.get("holds")) or "none"
        purpose = _purpose(ROOT / "benchmarks" / f"{name}.py").replace("|", "\\|")
        lines.append(f"| `{name}` | {purpose} | {sum(bool(row.get('holds')) for row in bars)} of {len(bars)} "
                     f"| {missed.replace('|', chr(92) + '|')} | {result.get('machine', '')} |")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if SUMMARY in markdown:
        return markdown.replace(SUMMARY, bar_summary(json.loads((ROOT / "benchmarks" / "results.json").read_text())))
    return markdown
