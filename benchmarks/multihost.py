"""Checkpoints from 2 JAX processes on this machine against numpy writing the same bytes from one process.

Two processes (4 fake CPU devices each, joined by ``jax.distributed.initialize``
on a localhost coordinator with gloo collectives) hold one K/V session sharded
over kv-heads across all 8 devices, every token valid.  Each round, after a
barrier, ``jss.checkpoint.save`` writes it from both processes (each its own
shards, the primary the manifest) and ``jss.checkpoint.restore`` reads it back
onto the same sharding.  The baseline is one process writing the same arrays
with ``numpy.save`` into new files plus ``fsync`` (a checkpoint is durable),
and reading them with ``numpy.load``.  Bar: each ratio (jss time / numpy
time, best of the rounds) <= 1.5.  For information, Orbax alone saving the
same arrays from the same processes, as the library calls it (plain zarr,
16 MiB chunks), without the library's digests and manifest.  Sizes: 256 MiB (``--full``: 1 GiB).

Run:  python -m benchmarks.multihost [--full] [--out PATH]  (files go under $TMPDIR)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROCESSES, DEVICES, HEADS, HEAD_DIM, ROUNDS = 2, 4, 8, 128, 3
BARS = {"save": 1.5, "restore": 1.5}
ROOT = Path(__file__).resolve().parents[1]


def _capacity(full: bool) -> int:
    return (1 << 30 if full else 256 << 20) // (2 * HEADS * HEAD_DIM * 4)


def _arrays(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V every process and the baseline hold: ``(1, HEADS, capacity, HEAD_DIM)`` float32."""
    rng = np.random.default_rng(0)
    shape = (1, HEADS, capacity, HEAD_DIM)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(work: Path, capacity: int, timeout: float = 600) -> dict[str, Any]:
    """Runs the 2 children; process 0's timings."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip(),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    port, procs = _free_port(), []
    for i in range(PROCESSES):
        command = [sys.executable, "-m", "benchmarks.multihost", "--child", str(i), str(port), str(work), str(capacity)]
        log = open(work / f"child-{i}.log", "w")
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        logs = "\n".join((work / f"child-{i}.log").read_text()[-3000:] for i in range(PROCESSES))
        raise RuntimeError(f"benchmark children failed: {[p.returncode for p in procs]}\n{logs}")
    return json.loads((work / "timings.json").read_text())


def _child(process_id: int, port: int, work: Path, capacity: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=PROCESSES, process_id=process_id)
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType

    import jax_session_state as jss
    from benchmarks._common import with_lengths

    mesh = jax.make_mesh((jax.device_count(),), ("model",), axis_types=(AxisType.Auto,))
    rules = jss.ShardingRules(mesh, {"kv_heads": "model"})
    kv = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity, sharding=rules)
    k, v = _arrays(capacity)
    kv = kv.with_storage(**{name: jax.make_array_from_callback(x.shape, getattr(kv, name).sharding, lambda i, x=x: x[i])
                            for name, x in (("k", k), ("v", v))})
    session = jss.Session(objects={"kv": with_lengths(kv, capacity)})
    import orbax.checkpoint as ocp

    times: dict[str, list[float]] = {"save": [], "restore": [], "orbax save": []}
    arrays = {"k": session["kv"].k, "v": session["kv"].v}
    for r in range(ROUNDS):
        path = work / f"jss-{r}"
        multihost_utils.sync_global_devices(f"orbax-{r}")
        started = time.perf_counter()  # Orbax alone, as the library calls it: plain zarr, 16 MiB chunks, no digests
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False)).save(
            work / f"orbax-{r}", args=ocp.args.PyTreeSave(arrays, save_args={
                key: ocp.SaveArgs(chunk_byte_size=16 << 20) for key in arrays}))
        times["orbax save"].append(time.perf_counter() - started)
        multihost_utils.sync_global_devices(f"save-{r}")
        started = time.perf_counter()
        jss.checkpoint.save(path, session)
        times["save"].append(time.perf_counter() - started)
        multihost_utils.sync_global_devices(f"restore-{r}")
        started = time.perf_counter()
        restored = jss.checkpoint.restore(path, shardings=rules)
        jax.block_until_ready(restored)
        times["restore"].append(time.perf_counter() - started)
        del restored
    if jax.process_index() == 0:
        (work / "timings.json").write_text(json.dumps({**times, "nbytes": int(k.nbytes + v.nbytes)}))


def _numpy_times(work: Path, capacity: int) -> dict[str, list[float]]:
    """One process: ``numpy.save`` into new files + fsync, and ``numpy.load``, of the same arrays."""
    arrays = _arrays(capacity)
    times: dict[str, list[float]] = {"save": [], "restore": []}
    for r in range(ROUNDS):
        folder = work / f"numpy-{r}"
        folder.mkdir()
        started = time.perf_counter()
        for i, x in enumerate(arrays):
            with open(folder / f"{i}.npy", "wb") as f:
                np.save(f, x)
                f.flush()
                os.fsync(f.fileno())
        times["save"].append(time.perf_counter() - started)
        started = time.perf_counter()
        loaded = [np.load(folder / f"{i}.npy") for i in range(len(arrays))]
        times["restore"].append(time.perf_counter() - started)
        del loaded
    return times


def run(*, full: bool) -> list[dict[str, Any]]:
    from benchmarks._attention_parts import cpu_description

    capacity = _capacity(full)
    work = Path(tempfile.mkdtemp(prefix="jss-multihost-"))
    try:
        jss_times = _launch(work, capacity)
        numpy_times = _numpy_times(work, capacity)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = jss_times["nbytes"] / 2**20
    rows = []
    for what in ("save", "restore"):
        ours, theirs = min(jss_times[what]), min(numpy_times[what])
        ratio = ours / theirs
        rows.append({
            "measure": f"ratio {what} {mib:.0f} MiB: {PROCESSES} processes x {DEVICES} devices / numpy, 1 process "
                       f"(time; {mib / ours:.0f} vs {mib / theirs:.0f} MiB/s)",
            "value": round(ratio, 3), "bar": f"≤ {BARS[what]}", "holds": ratio <= BARS[what],
            "seconds": {"jss": jss_times[what], "numpy": numpy_times[what]},
        })
    orbax = min(jss_times["orbax save"])
    rows.append({"measure": f"ratio save {mib:.0f} MiB: Orbax alone from the same processes, no digests or "
                            f"manifest / numpy (time; {mib / orbax:.0f} MiB/s; information)",
                 "value": round(orbax / min(numpy_times["save"]), 3)})
    rows.append({"measure": "cpu", "value": cpu_description()})
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
    else:
        from benchmarks._common import cli

        cli("multihost", run, __doc__)
