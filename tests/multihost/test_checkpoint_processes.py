"""Sessions sharded over several JAX processes on this machine: steps, bytes, host-side reads, checkpoints across
process counts, and faults on one process that every process must see.

Each test launches real processes (``tests/multihost/_child.py``) joined by
``jax.distributed.initialize`` on a localhost coordinator, 2 fake CPU devices
each, and checks what they wrote against a one-process reference computed here.
Every launch has its own deadline: a process that hangs fails the test.
"""

import json
import shutil

import numpy as np

from tests.multihost import _launch, _scenario as sc


def reports(work, role, processes):
    return [json.loads((work / f"{role}-{i}.json").read_text()) for i in range(processes)]


def check_against_reference(work, processes):
    """Steps and attention equal one process's; every device holds an even share of the session's bytes."""
    reference, outs = sc.rolled_out(None)
    got = np.load(work / "roll_and_save.npz")
    for i, out in enumerate(outs):
        np.testing.assert_allclose(got[f"out{i}"], np.asarray(out), atol=1e-5, rtol=0)
    for i, leaf in enumerate(sc.host_leaves(reference)):
        np.testing.assert_allclose(got[f"leaf{i}"], leaf, atol=1e-5, rtol=0)
    found = reports(work, "roll_and_save", processes)
    devices = [key for report in found for key in report["by_device"]]
    assert len(devices) == len(set(devices)) == 2 * processes  # each process counts its own shards only
    for name in ("kv", "carry"):
        per_device = [n for report in found for n in report["objects"][name].values()]
        assert len(set(per_device)) == 1, (name, per_device)
        obj = reference[name]  # its small bookkeeping arrays are replicated, so counted on every device
        replicated = sum(getattr(obj, f).nbytes for f in ("bookkeeping", "has_staged") if hasattr(obj, f))
        expected = obj.nbytes + (len(per_device) - 1) * replicated
        assert sum(per_device) == expected, (name, per_device, expected)


def damage(work, name, chunk):
    """A copy of the checkpoint with one byte of ``chunk`` of the K array flipped."""
    copy = work / name
    shutil.copytree(work / "ckpt", copy)
    manifest = json.loads((copy / "ckpt-000001" / "manifest.json").read_text())
    (key,) = [k for k, e in manifest["arrays"].items() if e["where"] == "kv.['k']"]
    path = copy / "ckpt-000001" / "arrays" / key / chunk
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def check_host_side_reads(work, processes):
    """Each process read fill, summary, describe and its manager's stats and events alone, of what it holds."""
    found = reports(work, "roll_and_save", processes)
    devices = 2 * processes
    counts = sc.row_counts(devices)
    for me, report in enumerate(found):
        mine = range(2 * me, 2 * me + 2)  # one row per device: this process holds its 2 devices' rows
        expected = [counts[row] if row in mine else None for row in range(devices)]
        staged = [0 if row in mine else None for row in range(devices)]
        wanted = {"committed": expected, "staged": staged, "capacity": 8, "margin": 0}
        assert report["rows_fill"] == wanted, report["rows_fill"]
        for table in ("rows_summary", "summary", "manager_summary"):
            lines = report[table].splitlines()
            assert lines[0].startswith("process") and all(line.startswith(f"{me} of {processes}") for line in lines[2:])
            assert [c for c in lines[0].split() if ":" in c] == sorted(report["by_device"]), lines[0]  # its own
        assert str(expected) in report["rows_summary"], report["rows_summary"]
        kv_row = next(line for line in report["summary"].splitlines() if " kv " in f" {line} ")
        assert f"[{sc.STEPS * sc.T}, {sc.STEPS * sc.T}]" in kv_row, kv_row  # batch is not split: every count held
        assert report["describe"]["kv"].startswith("KVCache(") and "capacity=32" in report["describe"]["kv"]
        assert [[kind, sid] for kind, sid, _ in report["events"]] == [["preempt", "a"]], report["events"]
        assert sorted(report["events"][0][2]) == sorted(report["by_device"]), report["events"]
        assert report["stats"]["sessions"] == 1 and report["stats"]["preemptions"] == 1, report["stats"]


def check_faults(work, processes):
    """What the primary cannot do (start, write the manifest) and errors in the last process's write, digests and
    restore check raise on every process at once; the last one's death mid-save raises on every other within the
    timeout; the previous checkpoint stays, with no partial directory."""
    victim = processes - 1
    found = reports(work, "save_faults", processes)
    for me, report in enumerate(found):
        for fault, step in (("begin", "start"), ("manifest", "publish")):  # the primary ran out of disk space
            message = report[fault]
            assert message.startswith("CheckpointError: checkpoint.save"), message
            assert "[Errno 28] No space left on device" in message, message
            assert me == 0 or f"at step {step!r}, process 0 raised CheckpointError" in message, message
        for fault in ("write", "digests", "check"):
            message = report[fault]
            if me == victim:
                assert message.startswith("_Injected: injected"), message
            else:
                step = "check" if fault == "check" else "write"
                assert message.startswith("CheckpointError: checkpoint."), message
                assert f"at step {step!r}, process {victim} raised _Injected: injected" in message, message
        for fault in ("begin", "manifest", "write", "digests", "check"):
            assert report[f"{fault}_s"] < sc.FAULT_TIMEOUT_S, (fault, report[f"{fault}_s"])  # told, not timed out
    for fault in ("begin", "manifest", "write", "digests"):  # listed by the primary before it starts the next save
        assert found[0][f"{fault}_left"] == ["ckpt-000001"], found[0]  # the previous one, no partial directory
    for report in found[:victim]:
        message = report["killed"]
        assert message.startswith("CheckpointError: checkpoint.save(") and f"process {victim}" in message, message
        assert sc.FAULT_TIMEOUT_S - 1 < report["killed_s"] < sc.FAULT_TIMEOUT_S + 15, report["killed_s"]
    assert found[0]["killed_left"] == ["ckpt-000001"], found[0]["killed_left"]


def run_faults(work, processes):
    """Runs save_faults: the last process is killed; the others exit once they have raised."""
    job = _launch.Job("save_faults", processes, work, timeout=120 + 30 * processes)
    codes = job.wait()
    assert codes == [0] * (processes - 1) + [-9], f"exit codes {codes}\n{job.outputs()}"
    check_faults(work, processes)


def test_two_processes_step_save_and_restore_on_any_process_count(tmp_path):
    _launch.run("roll_and_save", 2, tmp_path)
    check_against_reference(tmp_path, 2)
    check_host_side_reads(tmp_path, 2)
    run_faults(tmp_path, 2)

    _launch.run("restore_one", 1, tmp_path, devices=4)  # 2 -> 1 process with 4 devices, then saves from it
    assert reports(tmp_path, "restore_one", 1)[0]["names"] == ["ckpt-000001"]

    damage(tmp_path, "damaged-0", "0.0.0.0")  # heads 0-1: written by process 0
    damage(tmp_path, "damaged-1", "0.3.0.0")  # heads 6-7: written by process 1
    shutil.copytree(tmp_path / "ckpt", tmp_path / "vanishing")  # its K files vanish as process 1 reads
    _launch.run("restore_many", 2, tmp_path)  # 2 -> 2 after the failed saves, 1 -> 2, and the damaged copies
    for report in reports(tmp_path, "restore_many", 2):
        assert sorted(report["errors"]) == ["damaged-0", "damaged-1", "vanishing"]
        for name in ("damaged-0", "damaged-1"):
            message = report["errors"][name]
            assert "kv.['k']" in message and "does not match its digest" in message
        message = report["errors"]["vanishing"]  # process 1's own read failed; process 0's failed or was told
        assert f"{tmp_path / 'vanishing'}" in message, message
        # Which process notices first depends on timing: a read that fails, or a size check that finds the
        # files already gone; either way nothing was read.
        assert ("the arrays cannot be read" in message or "at step 'read', process 1 raised" in message
                or ("the manifest does not describe these files" in message and "Nothing was read" in message)), message


def test_four_processes_round_trip(tmp_path):
    _launch.run("roll_and_save", 4, tmp_path, timeout=180)
    check_against_reference(tmp_path, 4)
    check_host_side_reads(tmp_path, 4)
    run_faults(tmp_path, 4)
