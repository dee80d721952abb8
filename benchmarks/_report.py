"""``BENCHMARKS.md`` and its figures, from the runner's results (see ``benchmarks/__main__.py``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks._common import cell

STEP_SIDES = ["library", "raw JAX", "PyTorch eager", "flax nnx decode"]  # a name starts with its side

FIGURES = {
    "append": (
        "append.png",
        "**Writes cost what they write.** Seconds per jitted `KVCache.append` of one 16-token chunk "
        "(8 K/V heads x 64, float32) against the cache's capacity. Donated, the append writes its 16 rows in "
        "place whatever the capacity; not donated, XLA must copy the whole cache first, so the cost grows "
        "with capacity.",
    ),
    "rollout_step": (
        "rollout_step.png",
        "**Rollout step time of the world model** (`examples/world_model.py`, 4 blocks, one 16-token frame "
        "per step) with K/V caches of capacity 32k tokens, from an empty session and after a prefix: the "
        "library (one jitted, "
        "donated `lax.scan`), the same rollout hand-written on raw JAX arrays, PyTorch eager (preallocated "
        "head-major cache written in place, `scaled_dot_product_attention` over the valid prefix; the faster "
        "of 1 and 2 threads), and flax nnx's `MultiHeadAttention` decode cache (one token per call, so 16 "
        "calls per frame, attending over the whole capacity). Same weights, same frames.",
    ),
    "rollout_memory": (
        "rollout_memory.png",
        "**Peak resident memory of a donated rollout** of the world model with a 1 GiB session (K/V "
        "capacity 1M tokens), in a fresh process: the process's resident memory before allocating the "
        "session (after compiling), the session's logical bytes, and the peak. The bar is 1.25 x (session "
        "+ baseline).",
    ),
}


def _rows(document: dict[str, Any], figure: str) -> list[dict[str, Any]]:
    return [row for result in document["benchmarks"].values() for row in result["rows"] if row.get("figure") == figure]


def plot_append(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for donated, label in ((True, "donated (in place)"), (False, "not donated (copies the cache)")):
        points = sorted((r["capacity"], r["value"]) for r in rows if r["donated"] == donated)
        ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("µs per append of 16 tokens")
    ax.set_title("KVCache.append: cost against capacity")
    ax.legend()
    _save(fig, path)


def plot_rollout_step(rows: list[dict[str, Any]], path: Path) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))  # in measured order
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(STEP_SIDES)
    for i, side in enumerate(STEP_SIDES):
        values = {r["case"]: r["value"] for r in rows if r["implementation"].startswith(side)}
        x = [j + (i - (len(STEP_SIDES) - 1) / 2) * width for j, case in enumerate(cases) if case in values]
        bars = ax.bar(x, [values[case] for case in cases if case in values], width, label=side)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(cases)), [case.replace(" after", "\nafter").replace(": ", ":\n") for case in cases],
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per frame (16 tokens)")
    ax.set_title("world-model rollout, K/V capacity 32k tokens: step time")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_rollout_memory(rows: list[dict[str, Any]], path: Path) -> None:
    parts = {r["part"]: r["value"] for r in rows}
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.bar(["baseline"], [parts["baseline"]], color="tab:gray")
    ax.bar(["session + baseline"], [parts["baseline"]], color="tab:gray")
    ax.bar(["session + baseline"], [parts["session"]], bottom=[parts["baseline"]], color="tab:blue", label="session")
    ax.bar(["peak"], [parts["peak"]], color="tab:orange")
    bar = 1.25 * (parts["session"] + parts["baseline"])
    ax.axhline(bar, color="tab:red", ls="--", label=f"bar: 1.25 x (session + baseline) = {bar:.0f} MiB")
    ax.set_ylabel("MiB resident")
    ax.set_title("donated rollout, 1 GiB session: peak resident memory")
    ax.legend(loc="lower right", fontsize=8)
    _save(fig, path)


PLOTS = {"append": plot_append, "rollout_step": plot_rollout_step, "rollout_memory": plot_rollout_memory}


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _description(module: Path) -> str:
    """The module docstring without its ``Run:`` line."""
    doc = ast.get_docstring(ast.parse(module.read_text())) or ""
    return doc.split("\nRun:")[0].strip()


DEVICE_COLUMNS = ["measure", "us", "GB/s", "of peak", "over dot_product_attention", "over raw", "bar", "holds",
                  "not measured"]


def _markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    columns = columns or ["measure", "value", "bar", "holds"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _device_runs(figures: Path) -> list[str]:
    """A section for the committed runs of ``benchmarks/device.py`` on accelerators (``device_*.json``, in the
    order of their names), which ``python -m benchmarks`` does not run."""
    runs = sorted(figures.glob("device_*.json"))
    if not runs:
        return []
    lines = ["## On accelerators", "", _description(figures / "device.py"), "",
             "Each run was made on an accelerator at hand for minutes and its JSON committed; "
             "`python -m benchmarks` does not run them.", ""]
    for path in runs:
        run = json.loads(path.read_text())
        env = run["environment"]
        lines += [f"### `benchmarks/{path.name}` ({run['seconds']:.0f} s)", "", run["run"], "",
                  f"Measured on {run['device_kind']} (jax {env['jax']}, jaxlib {env['jaxlib']}; host {env['cpu']}).",
                  "", _markdown_table(run["rows"], DEVICE_COLUMNS), ""]
    return lines


def write(document: dict[str, Any], markdown: Path, figures: Path) -> None:
    """Draws the figures whose rows exist and writes the markdown."""
    env = document["environment"]
    size = "full (`--full`)" if document["full"] else "quick (the default)"
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `python -m benchmarks` (add `--full` for the large sizes) from `benchmarks/results.json`."
        " Every comparison is measured within one run, interleaved round by round,"
        " as a ratio of medians (of bests where a benchmark says so);"
        " the machine may be shared and noisy.",
        "",
        f"- sizes: {size}",
        f"- machine of the last run: {env['cpu']}, {env['cores']} cores, {env['memory']}, {env['system']}"
        " (each section names the machine it was measured on)",
        f"- versions: python {env['python']}, jax {env['jax']} ({env['backend']}), jaxlib {env['jaxlib']}, "
        f"flax {env['flax']}, numpy {env['numpy']}, torch {env['torch']}",
        "",
        "## Figures",
        "",
    ]
    for figure, (filename, caption) in FIGURES.items():
        rows = _rows(document, figure)
        if rows:
            PLOTS[figure](rows, figures / filename)
            lines += [f"![{figure}](benchmarks/{filename})", "", caption, ""]
    lines += ["## Every benchmark", ""]
    for name, result in document["benchmarks"].items():
        machine = f"Measured on {result['machine']}." if "machine" in result else ""
        lines += [f"### `benchmarks/{name}.py` ({result['seconds']:.0f} s)", "",
                  _description(figures / f"{name}.py"), "", machine, "", _markdown_table(result["rows"]), ""]
    lines += _device_runs(figures)
    markdown.write_text("\n".join(lines))
