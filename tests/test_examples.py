"""The examples run end to end (each checks its own result)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("name", ["quickstart.py", "serving.py"])
def test_example_runs(name):
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    if name == "serving.py":
        assert "equals its unmanaged rollout bit for bit: True" in result.stdout
        assert "rebuild" in result.stdout and "restore" in result.stdout and "park" in result.stdout
