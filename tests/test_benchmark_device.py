"""benchmarks/device.py runs (its --tiny smoke mode, on whatever backend is here) and its rows are right."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_device_benchmark_smoke_run_writes_every_row_with_a_small_error(tmp_path):
    out = tmp_path / "device.json"
    subprocess.run([sys.executable, "-m", "benchmarks.device", "--tiny", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    result = json.loads(out.read_text())
    rows = {row["measure"]: row for row in result["rows"]}
    for T in (1, 16):
        for valid in (300, 1024):
            for implementation in ("loop", "bucketed"):
                row = rows[f"attend T={T} batch 2 valid {valid}: {implementation}"]
                assert row["max abs error"] < 2e-2  # bfloat16 output against dot_product_attention
                assert row["us"] > 0 and row["GB/s"] > 0 and row["over dot_product_attention"] > 0
    ratio = rows["world-model step: library over raw JAX"]
    assert ratio["over raw"] > 0 and isinstance(ratio["holds"], bool)
    assert result["device_kind"] and result["seconds"] > 0
