"""Running a test program on one forced path of the native kernel (``JSS_NATIVE_ISA`` is read at import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jax_session_state._core import _library


def run_on_path(isa: str, program: str) -> list[str]:
    """The lines ``program`` prints, run in a fresh process on path ``isa``; skips where this build and CPU
    do not run that path, fails (with its stderr) where the program fails."""
    if not _library.ISAS.get(isa):
        pytest.skip(f"this build and CPU run the paths {[name for name, ok in _library.ISAS.items() if ok]}")
    env = {**os.environ, _library.ENV_ISA: isa}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()
