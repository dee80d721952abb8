"""Sessions sharded over several JAX processes on this machine: steps, bytes, checkpoints across process counts.

Each test launches real processes (``tests/multihost/_child.py``) joined by
``jax.distributed.initialize`` on a localhost coordinator, 2 fake CPU devices
each, and checks what they wrote against a one-process reference computed here.
"""

import json
import shutil
import time

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


def test_two_processes_step_save_and_restore_on_any_process_count(tmp_path):
    _launch.run("roll_and_save", 2, tmp_path)
    check_against_reference(tmp_path, 2)

    job = _launch.Job("save_killed", 2, tmp_path)  # process 1 dies after writing its shards
    assert job.wait([1]) == [-9], job.outputs()
    time.sleep(2)
    assert job.procs[0].poll() is None or job.procs[0].returncode != 0, job.outputs()
    job.kill()  # process 0 waits for a peer that will never come
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*")) == ["ckpt-000001"]

    _launch.run("restore_one", 1, tmp_path, devices=4)  # 2 -> 1 process with 4 devices, then saves from it
    assert any(n.startswith(".partial-") for n in reports(tmp_path, "restore_one", 1)[0]["names"])

    damage(tmp_path, "damaged-0", "0.0.0.0")  # heads 0-1: written by process 0
    damage(tmp_path, "damaged-1", "0.3.0.0")  # heads 6-7: written by process 1
    _launch.run("restore_many", 2, tmp_path)  # 2 -> 2 after the killed save, 1 -> 2, and the damaged copies
    for report in reports(tmp_path, "restore_many", 2):
        assert sorted(report["errors"]) == ["damaged-0", "damaged-1"]
        for message in report["errors"].values():
            assert "kv.['k']" in message and "does not match its digest" in message


def test_four_processes_round_trip(tmp_path):
    _launch.run("roll_and_save", 4, tmp_path, timeout=180)
    check_against_reference(tmp_path, 4)
