"""The serving example: users join and leave a pool mid-rollout under a byte budget; --help runs nothing."""

import os
import pathlib
import re
import subprocess
import sys

import matplotlib.image
import numpy as np

SERVING = pathlib.Path(__file__).parent.parent / "examples" / "serving.py"


def run(*args: str) -> subprocess.CompletedProcess:
    root = str(SERVING.parent.parent)  # the package, importable however the tests were started
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SERVING), *args], cwd=SERVING.parent, env=env, capture_output=True,
                          text=True, timeout=300)


def test_serving_example_serves_every_user_in_turns_and_checks_one_against_its_rollout_alone(tmp_path):
    plot = tmp_path / "serving.png"
    done = run("--users", "6", "--slots", "2", "--frames", "4", "7", "--turn", "2", "3", "--layers", "1",
               "--room", "1", "--arrivals", "2", "--plot", str(plot))
    assert done.returncode == 0, done.stdout + done.stderr
    served = re.search(r"served (\d+) frames to 6 users in (\d+) pool steps, [\d.]+ s: ([\d,]+) frames/s", done.stdout)
    assert served, done.stdout
    frames, steps = int(served.group(1)), int(served.group(2))
    assert 6 * 4 <= frames <= 6 * 7 and steps >= frames / 2  # two slots: at most two frames a step
    assert "equal its rollout alone: True" in done.stdout
    parks = int(re.search(r"parks (\d+)", done.stdout).group(1))
    assert parks > 0  # a budget of the pool and one session: waiting users were parked in host memory
    assert "serving" in done.stderr and "frame/s" in done.stderr  # the progress bar
    image = matplotlib.image.imread(plot)
    assert image.ndim == 3 and image.shape[0] >= 400 and np.ptp(image) > 0


def test_help_prints_the_flags_and_runs_nothing():
    done = run("--help")
    assert done.returncode == 0
    for flag in ("--users", "--slots", "--frames", "--turn", "--room", "--plot"):
        assert flag in done.stdout
    assert not re.search(r"served \d+ frames", done.stdout) and "frames/s" not in done.stdout
