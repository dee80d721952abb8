"""Runs the tests of ``tests/multidevice`` on 8 fake CPU devices, in a subprocess.

XLA makes fake devices only when its flag is set before jax is imported, so
they cannot run in this process (whose jax already has one device).
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import MULTIDEVICE_FLAG

ROOT = Path(__file__).resolve().parent.parent


def test_multidevice_suite_passes_on_8_devices():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {MULTIDEVICE_FLAG}".strip()}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/multidevice", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"the multi-device tests failed:\n{output[-20_000:]}"
    assert " passed" in output and "skipped" not in output, output[-5_000:]
