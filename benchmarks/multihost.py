"""Checkpoints from 2 JAX processes on this machine against numpy writing the same bytes from one process.

Two processes (4 fake CPU devices each, joined by ``jax.distributed.initialize``
on a localhost coordinator with gloo collectives) hold one K/V session sharded
over kv-heads across all 8 devices, every token valid.  Each round
``jss.checkpoint.save`` writes it from both processes (each its own shards,
the primary the manifest) and ``jss.checkpoint.restore`` reads it back onto
the same sharding.  The baseline, in the same rounds, is process 0 alone
writing the same arrays with ``numpy.save`` into new files plus ``fsync`` (a
checkpoint is durable) while process 1 waits, and reading them with
``numpy.load``.  Every timed operation starts from a quiet disk (``os.sync``
and a barrier) and ends when every process is done, so no operation pays for
another's writeback, and both sides meet the disk in the same state (a
shared disk's speed can vary several-fold from minute to minute); reads start from
files dropped from the page cache (``posix_fadvise``), as after a restart.
Bars, on ``$TMPDIR``'s disk (named in the results, as is the CPU): a save
against numpy (jss time / numpy time, best of the rounds) <= 1.5, and a
restore against Orbax alone restoring the same arrays onto the same sharding
from the same processes, as the library calls it (without the library's
digests, their check, the manifest and the copy into runtime-owned buffers)
<= 1.25: that is the part of a restore the library owns, since Orbax's own
read is what it is.  For information: a restore against numpy, Orbax alone
against numpy, and the same on a memory file system (``/dev/shm``, where
there is one), which shows the library's own cost where storage costs
nothing.  Sizes: 256 MiB (``--full``: 1 GiB).

Where a restore's time goes: numpy reads each file straight into its array,
once.  Orbax reads a shard through TensorStore, which reads the chunk file
into a buffer of its own and copies it into a zero-filled array, and then
one more copy puts it in buffers the runtime owns (``device_put``'s, or the
library's where ``device_put`` wrapped the array): three passes over the
bytes where numpy makes one.  Storage adds to it: each shard is a chunk file
of its own, and on the committed run's machine the disk read 8 files of 16
MiB in 102-112 ms one after another and 80-87 ms all at once (as TensorStore
reads them) where ``numpy.load`` read one file of the same 128 MiB in 55-58
ms.  With every allocation on huge pages
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, so no 4 KiB page faults in fresh
buffers) Orbax's read still took 160-165 ms of each process's restore, on
the CPU for about half of it: the rest is the disk (and this benchmark's
restore stayed at 1.74x numpy).  A tiny checkpoint's restore costs Orbax
8-13 ms (event loops and threads per call) and the library about 5 more.  So
Orbax alone restores at 1.2-1.6x numpy at 256 MiB (its information row), and
the library adds its check of every byte (CRC-32 at about 13 GB/s; it
returns nothing unverified) and the copy into runtime-owned buffers: per
process, Orbax's read took 150-200 ms of a restore, the checks 12-25 and the
copy 7-40, so 0.3-0.6 of numpy's time more.  At 1 GiB (``--full``) Orbax
alone read at 1.76x numpy from disk and 2.03x from memory, the library at
1.84x and 2.17x.  While Orbax reads this way, a restore against numpy says
more about Orbax than about the library, so its bar is set against Orbax
alone.  Tried in one process and
not faster: TensorStore's ``file_io_mode`` (256 MiB from disk onto 4
devices: ``"default"`` 98-106 ms, ``"memmap"`` 108-119, ``"direct"``
113-123; ``numpy.load`` 58-60), OCDBT or zarr3 (128 MiB: 88-102 ms where the
default read 90 and ``numpy.load`` 61-64); and from two processes, chunks of
1 or 4 MiB instead of 16 (within the noise).

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

PROCESSES, DEVICES, HEADS, HEAD_DIM, ROUNDS = 2, 4, 8, 128, 6
BARS = {"save": 1.5, "restore over orbax": 1.25}
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
    from jax_session_state.checkpoint import _orbax_io

    mesh = jax.make_mesh((jax.device_count(),), ("model",), axis_types=(AxisType.Auto,))
    rules = jss.ShardingRules(mesh, {"kv_heads": "model"})
    kv = jss.KVCache.allocate(batch=1, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity, sharding=rules)
    k, v = _arrays(capacity)
    kv = kv.with_storage(**{name: jax.make_array_from_callback(x.shape, getattr(kv, name).sharding, lambda i, x=x: x[i])
                            for name, x in (("k", k), ("v", v))})
    session = jss.Session(objects={"kv": with_lengths(kv, capacity)})
    arrays = {"k": session["kv"].k, "v": session["kv"].v}
    primary = jax.process_index() == 0

    def timed(name: str, what: str, operation: Any) -> None:
        """Times ``operation`` from a quiet disk (earlier writes flushed) and every process at the start, to the end
        of the slowest."""
        os.sync()
        multihost_utils.sync_global_devices(name)
        started = time.perf_counter()
        operation()
        multihost_utils.sync_global_devices(f"{name} done")
        times[what].append(time.perf_counter() - started)

    def in_turn(r: int, operations: dict[str, Any]) -> None:
        """Times each of ``operations``, the one going first changing from round to round."""
        names = list(operations)
        for name in names[r % len(names):] + names[: r % len(names)]:
            timed(f"{name} {r}", name, operations[name])

    def one_round(r: int) -> None:
        """Each write, then each read, the first of each changing from round to round (it meets the freshest disk)."""
        folder, orbax, ours = work / f"numpy-{r}", work / f"orbax-{r}", work / f"jss-{r}"
        layout = {key: (x.shape, x.dtype.name) for key, x in arrays.items()}
        places = {key: x.sharding for key, x in arrays.items()}
        writes = {
            "numpy save": lambda: primary and _numpy_save(folder, (k, v)),
            "orbax save": lambda: _orbax_io.write_arrays(orbax, arrays),
            "save": lambda: jss.checkpoint.save(ours, session),
        }
        reads = {
            "numpy restore": lambda: primary and _numpy_load(folder),
            "orbax restore": lambda: jax.block_until_ready(_orbax_io.read_arrays(orbax, layout, places)),
            "restore": lambda: jax.block_until_ready(jss.checkpoint.restore(ours, shardings=rules)),
        }
        in_turn(r, writes)
        if primary:
            _evict(work)
        in_turn(r, reads)
        if primary:  # the next round starts from a file system as empty as this one's
            for written in (folder, orbax, ours):
                shutil.rmtree(written)

    times: dict[str, list[float]] = {
        key: [] for key in ("save", "restore", "orbax save", "orbax restore", "numpy save", "numpy restore")}
    for r in range(ROUNDS):
        one_round(r)
    if primary:
        (work / "timings.json").write_text(json.dumps({**times, "nbytes": int(k.nbytes + v.nbytes)}))


def _evict(folder: Path) -> None:
    """Drops the files under ``folder`` from the page cache, so reads come from the storage, as after a restart.

    (On a memory file system the pages are the storage and stay.)
    """
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _numpy_save(folder: Path, arrays: tuple[np.ndarray, ...]) -> None:
    """The baseline write: ``numpy.save`` into new files, each flushed to disk (a checkpoint is durable)."""
    folder.mkdir()
    for i, x in enumerate(arrays):
        with open(folder / f"{i}.npy", "wb") as f:
            np.save(f, x)
            f.flush()
            os.fsync(f.fileno())


def _numpy_load(folder: Path) -> list[np.ndarray]:
    """The baseline read: ``numpy.load`` of every file."""
    return [np.load(path) for path in sorted(folder.glob("*.npy"))]


def _places() -> list[tuple[str, str]]:
    """Where the files go: ``$TMPDIR``'s disk, and a memory file system (``/dev/shm``) where there is one."""
    places = [("disk", tempfile.gettempdir())]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        places.append(("memory, /dev/shm", "/dev/shm"))
    return places


def _rows(place: str, times: dict[str, Any]) -> list[dict[str, Any]]:
    """The ratios of one place; the bars are the disk's (a checkpoint is written to storage, read after a restart)."""
    mib = times["nbytes"] / 2**20
    rows = []
    for what in ("save", "restore"):
        ours, theirs = min(times[what]), min(times[f"numpy {what}"])
        row = {
            "measure": f"ratio {what} {mib:.0f} MiB to {place}: {PROCESSES} processes x {DEVICES} devices / numpy, "
                       f"1 process (time; {mib / ours:.0f} vs {mib / theirs:.0f} MiB/s)",
            "value": round(ours / theirs, 3), "seconds": {"jss": times[what], "numpy": times[f"numpy {what}"]},
        }
        if place == "disk" and what in BARS:
            row.update(bar=f"≤ {BARS[what]}", holds=ours / theirs <= BARS[what])
        rows.append(row)
    ours, orbax = min(times["restore"]), min(times["orbax restore"])
    row = {"measure": f"ratio restore {mib:.0f} MiB from {place}: the library / Orbax alone, the same processes and "
                      f"sharding (time; the library's own part: digests, their check, the manifest, one copy)",
           "value": round(ours / orbax, 3)}
    if place == "disk":
        row.update(bar=f"≤ {BARS['restore over orbax']}", holds=ours / orbax <= BARS["restore over orbax"])
    rows.append(row)
    for what in ("save", "restore"):
        orbax = min(times[f"orbax {what}"])
        rows.append({"measure": f"ratio {what} {mib:.0f} MiB to {place}: Orbax alone from the same processes, "
                                f"no digests or manifest / numpy (time; {mib / orbax:.0f} MiB/s; information)",
                     "value": round(orbax / min(times[f"numpy {what}"]), 3), "seconds": times[f"orbax {what}"]})
    return rows


def _disk(folder: str) -> str:
    """The file system ``folder`` is on: its type and device, and whether the device says it rotates."""
    mounts = []
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, point, kind = line.split()[:3]
                if folder == point or folder.startswith(point.rstrip("/") + "/"):
                    mounts.append((len(point), device, point, kind))
    except OSError:
        return f"{folder} (file system unknown)"
    if not mounts:
        return f"{folder} (file system unknown)"
    _, device, point, kind = max(mounts)
    described = f"{kind} on {device} mounted at {point}"
    block = Path("/sys/block") / Path(device).name / "queue" / "rotational"
    if block.exists():
        rotates = block.read_text().strip() == "1"
        described += f", which the kernel reports {'rotational' if rotates else 'not rotational'}"
    return described


def run(*, full: bool) -> list[dict[str, Any]]:
    from benchmarks._attention_parts import cpu_description

    rows = []
    for place, folder in _places():
        work = Path(tempfile.mkdtemp(prefix="jss-multihost-", dir=folder))
        try:
            rows += _rows(place, _launch(work, _capacity(full)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    rows.append({"measure": "cpu", "value": cpu_description()})
    rows.append({"measure": "disk ($TMPDIR)", "value": _disk(os.path.realpath(tempfile.gettempdir()))})
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
    else:
        from benchmarks._common import cli

        cli("multihost", run, __doc__)
