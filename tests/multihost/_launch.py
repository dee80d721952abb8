"""Launches N Python processes that form one JAX multi-controller job on this machine."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Job:
    """The processes of one launch; ``outputs()`` is every process's stdout and stderr.

    Each runs ``tests/multihost/_child.py`` in ``role``, or, given ``program``, that script with
    ``--process-id``, ``--num-processes``, ``--coordinator`` and ``arguments``.
    """

    def __init__(self, role, processes, work, *, devices=2, timeout=120, program=None, arguments=()):
        self.role, self.timeout, self.logs = role, timeout, []
        flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
        env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
               "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        port = free_port()
        self.procs = []
        for i in range(processes):
            log = open(Path(work) / f"{role}-{i}.log", "w+")
            self.logs.append(log)
            if program is None:
                command = [sys.executable, "-m", "tests.multihost._child", role]
                command += [str(processes), str(i), str(port), str(work)]
            else:
                command = [sys.executable, str(program), "--process-id", str(i), "--num-processes", str(processes),
                           "--coordinator", f"localhost:{port}", *arguments]
            self.procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.started = time.monotonic()

    def outputs(self) -> str:
        text = []
        for i, log in enumerate(self.logs):
            log.flush()
            log.seek(0)
            lines = [line for line in log.read().splitlines() if not line.startswith(("W0", "I0", "[Gloo]"))]
            text.append(f"----- process {i} (exit {self.procs[i].poll()}) -----\n" + "\n".join(lines[-60:]))
        return "\n".join(text)

    def wait(self, which=None) -> list[int]:
        """Waits for every process (or those in ``which``); kills all and fails on the timeout."""
        procs = self.procs if which is None else [self.procs[i] for i in which]
        for p in procs:
            left = self.timeout - (time.monotonic() - self.started)
            try:
                p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.role}: timed out after {self.timeout}s\n{self.outputs()}") from None
        return [p.returncode for p in procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def run(role, processes, work, *, devices=2, timeout=120) -> str:
    """Runs ``role`` on ``processes`` processes; fails with every output unless all exit 0."""
    job = Job(role, processes, work, devices=devices, timeout=timeout)
    codes = job.wait()
    output = job.outputs()
    assert codes == [0] * processes, f"{role}: exit codes {codes}\n{output}"
    return output
