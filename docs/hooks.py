"""MkDocs hook: publishes the benchmark figures that BENCHMARKS.md shows.

``docs/benchmarks.md`` includes the top-level ``BENCHMARKS.md`` (one source),
whose images point at ``benchmarks/*.png`` beside it; this adds those files
to the site at the same relative place, so the included page's images
resolve and the strict build checks them like any other link.
"""

from __future__ import annotations

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
