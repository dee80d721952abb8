"""The published-model examples decode like the models' own caches (they need the models extra).

``pip install '.[models]'`` installs Google DeepMind's ``gemma`` package; where it is missing the decoding test
is skipped (``--help`` needs no extra and always runs).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}  # the package imports TensorFlow, which logs at start
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=EXAMPLES, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_gemma_decode_help_runs_nothing():
    done = run_example("gemma_decode.py", "--help")
    assert done.stdout.startswith("usage: gemma_decode.py") and "--steps" in done.stdout
    assert "logits" not in done.stdout.split("options:")[0]


def test_gemma_decode_matches_the_package_s_own_cache_path():
    pytest.importorskip("gemma", reason="needs the models extra: pip install '.[models]'")
    done = run_example("gemma_decode.py", "--steps", "40", "--prompt", "8", "--window", "8", "--layers", "6",
                       "--embed-dim", "64", "--hidden-dim", "128", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--vocab", "256", "--batch", "2")
    out = done.stdout
    assert "5 local window 8, 1 global" in out and "4 query / 2 kv heads" in out, out
    assert "layer_0 ring 15 slots" in out and "layer_5 append 48 slots" in out, out  # window 8 + a 7-row prefill
    diff = float(re.search(r"largest difference from gemma's own cache path (\S+)", out).group(1))
    assert diff <= 1e-4, out
    assert "identical to gemma's own path: True; to gemma's SamplerLoop: True" in out, out
    jss_bytes, gemma_bytes = (int(n.replace(",", "")) for n in
                              re.search(r"jss session ([\d,]+), gemma cache ([\d,]+)", out).groups())
    assert jss_bytes <= gemma_bytes, out
