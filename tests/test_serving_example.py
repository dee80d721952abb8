"""The serving example runs end to end and checks its own result."""

import pathlib
import subprocess
import sys

SERVING = pathlib.Path(__file__).parent.parent / "examples" / "serving.py"


def test_serving_example_runs():
    result = subprocess.run([sys.executable, str(SERVING)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "equals its unmanaged rollout bit for bit: True" in result.stdout
    for kind in ("evict", "park", "restore", "rebuild"):
        assert f"{kind} " in result.stdout
