"""benchmarks/device.py runs (its --tiny smoke mode, on whatever backend is here) and its rows are right."""

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import device

ROOT = Path(__file__).parent.parent


def test_device_benchmark_smoke_run_writes_every_row_with_a_small_error(tmp_path):
    out = tmp_path / "device.json"
    subprocess.run([sys.executable, "-m", "benchmarks.device", "--tiny", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    result = json.loads(out.read_text())
    rows = {row["measure"]: row for row in result["rows"]}
    for T in (1, 16):
        for valid in (300, 1024):
            for implementation in ("loop", "bucketed", "pallas"):  # pallas interpreted on CPU, compiled on GPU
                row = rows[f"attend T={T} batch 2 valid {valid}: {implementation}"]
                assert row["max abs error"] < 2e-2  # bfloat16 output against dot_product_attention
                assert row["us"] > 0 and row["GB/s"] > 0 and row["over dot_product_attention"] > 0
    ratio = rows["world-model step: library over raw JAX"]
    assert ratio["over raw"] > 0 and isinstance(ratio["holds"], bool)
    assert result["device_kind"] and result["seconds"] > 0 and "partial" not in result


def _attention_rows(**kwargs):
    return device.attention_rows(batches=[1], valids=[200], capacity=256, rounds=1, peak=None, copy=1e9, **kwargs)


def test_a_failing_implementation_is_recorded_and_the_run_goes_on(tmp_path):
    seen, write = [], device.partial_writer(tmp_path / "device.json")

    def on_rows(rows):
        seen.append(len(rows))
        write(rows)

    rows = _attention_rows(implementations=["loop", "no-such"], on_rows=on_rows)
    by_measure = {row["measure"]: row for row in rows}
    for T in (1, 16):
        assert by_measure[f"attend T={T} batch 1 valid 200: loop"]["max abs error"] < 2e-2
        failed = by_measure[f"attend T={T} batch 1 valid 200: no-such"]
        assert failed["not measured"].startswith("PayloadError: attend(): implementation must be one of")
        assert "us" not in failed
    assert seen == [2, 4]  # the rows so far, after each case
    written = json.loads((tmp_path / "device.json").read_text())  # what a run killed now would leave
    assert written["partial"] and written["rows"] == json.loads(json.dumps(rows))


def test_cases_past_the_budget_are_recorded_as_not_measured():
    rows = _attention_rows(deadline=time.perf_counter(), implementations=["loop", "bucketed"])
    assert [row["measure"] for row in rows] == [f"attend T={T} batch 1 valid 200: {implementation}"
                                                for T in (1, 16) for implementation in ("loop", "bucketed")]
    assert all(row["not measured"] == "past the time budget" and "us" not in row for row in rows)


def test_the_bars_case_is_measured_first_and_each_batch_together():
    cases = device._cases([1, 8, 32], [4096, 32768, 131072])
    assert cases[0] == device.BAR_CASE and sorted(cases) == sorted(set(cases)) and len(cases) == 18
    batches = [batch for batch, _, _ in cases]
    assert batches == sorted(batches, key=lambda b: (b != 8, b))  # a batch's cache is made once


def test_the_pallas_sweep_measures_every_setting_and_restores_the_kernels():
    from jax_session_state.attention import _pallas as kernel

    before = {name: getattr(kernel, name) for name in device.SWEEP}
    rows = device.sweep_rows(batch=1, valid=200, capacity=256, rounds=1, peak=None)
    assert len(rows) == 2 * 24 and len({row["measure"] for row in rows}) == 48
    for row in rows:  # interpreted here: every setting reads what the buckets read
        assert row["max abs error"] < 2e-2 and row["us"] > 0, row
    assert {name: getattr(kernel, name) for name in device.SWEEP} == before


def test_the_warm_up_keeps_the_device_busy_for_its_seconds():
    start = time.perf_counter()
    copies = device.warm_up(0.2, 1 << 16)
    assert time.perf_counter() - start >= 0.2 and copies > 1
    assert device.warm_up(0.0, 1 << 16) == 1  # a tiny run: one copy, no waiting
