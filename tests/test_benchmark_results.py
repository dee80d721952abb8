"""The committed ``benchmarks/results.json``: every benchmark in it ran, so every bar it records was measured."""

from __future__ import annotations

import json

import pytest

from benchmarks.__main__ import MODULES, RESULTS_JSON

RECORDED = json.loads(RESULTS_JSON.read_text())["benchmarks"]


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_has_a_committed_result_that_ran(name: str) -> None:
    # A benchmark that fails (an import moved, an API renamed) records one FAILED row and no bars,
    # which reads like a table with nothing to hold; the committed results must come from a run.
    assert name in RECORDED, f"benchmarks/{name}.py has no result in {RESULTS_JSON.name}"
    result = RECORDED[name]
    assert not result.get("failed"), f"benchmarks/{name}.py failed when last run: {result['rows'][0]['measure']}"
    assert any("bar" in row for row in result["rows"]), f"benchmarks/{name}.py recorded no bar"
