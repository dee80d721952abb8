"""``benchmarks/tiers.py`` at tiny sizes: it runs end to end and its accuracy and byte bars hold there too."""

from __future__ import annotations

from benchmarks import tiers


def test_tiers_benchmark_runs_at_smoke_sizes() -> None:
    rows = tiers.run(full=False, smoke=True)
    parts = {row.get("part") for row in rows}
    assert {"error", "time", "memory"} <= parts
    assert rows[0]["measure"].startswith("CPU: ")
    for row in rows:
        if row["measure"].startswith(("bytes:", "error: int8")):
            assert row["holds"], row
    for kind in ("dense", "paged"):
        int8 = [row for row in rows if row.get("part") == "error" and row["format"] == "int8" and row["kind"] == kind]
        assert {(row["T"], row["valid"]) for row in int8} == {(1, 256), (1, 1024), (16, 256), (16, 1024)}
        for row in int8:
            assert 0 < row["median"] <= row["p95"] <= row["max"]
        demote = next(row for row in rows if row.get("part") == "memory" and row["kind"] == kind)
        assert demote["quantize"] == "int8" and demote["demoted"] < 0.3 * demote["cache"]
        times = [row for row in rows if row.get("part") == "time" and row["kind"] == kind]
        assert len(times) >= 1
        for row in times:  # each path's int8 step reads the quantized cache in the native kernel, as float32 does
            expected = "native kernel" if row["path"] is not None else "pure loop"
            assert row["kernels"] == {"float32": expected, "int8": expected}, row
        assert len([row for row in rows if row.get("part") == "bytes" and row["kind"] == kind]) == 2
