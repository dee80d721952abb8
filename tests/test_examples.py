"""Every example runs end to end at a tiny size, in its own process, and produces what it promises."""

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
from flax import nnx

from tests.support.devices import DEVICE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SESSION_OBJECTS = ["kv_0", "kv_1", "kv_2", "kv_3", "cond", "prompt", "carry", "frames"]


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=EXAMPLES, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done


def assert_png(path: Path, min_height: int) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] >= min_height and np.ptp(image) > 0, "an empty image"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The training example at a tiny size: its output folder and stdout."""
    out = tmp_path_factory.mktemp("train")
    done = run_example(
        "train_world_model.py", "--episodes", "8", "--windows", "2", "--window-frames", "4", "--batch", "4",
        "--out", str(out),
    )
    return out, done.stdout


def test_training_lowers_the_loss(trained):
    out, stdout = trained
    metrics = json.loads((out / "metrics.json").read_text())
    losses = np.asarray(metrics["losses"])
    assert len(losses) == 8 * 2 and np.all(np.isfinite(losses))
    assert losses[-4:].mean() < 0.5 * losses[:4].mean(), losses  # the last episodes against the first
    assert "lower" in stdout
    assert_png(out / "loss.png", 200)
    assert (out / "world_model.msgpack").stat().st_size > 10_000


def test_rollout_demo_with_trained_weights(trained, tmp_path):
    params = trained[0] / "world_model.msgpack"
    done = run_example("world_model_rollout.py", "--steps", "40", "--window", "64", "--params", str(params),
                       "--out", str(tmp_path))
    summary = done.stdout[done.stdout.index("name "):]
    rows = {line.split()[0]: line for line in summary.splitlines()[2:] if line.strip()}
    for name in SESSION_OBJECTS:
        assert name in rows, f"the summary misses {name}:\n{summary}"
    kv = re.split(r"\s{2,}", rows["kv_0"])  # name, kind, shapes, dtype, committed, staged, capacity, resident, ...
    assert kv[1:5] == ["KVCache", "[1, 2, 96, 16]", "float32", "[80 of 640 seen]"]
    assert kv[6] == "80 + 16 staging"  # sink 16 + window 64 stay visible, and 16 slots for a chunk
    assert "EncodeOnceKV" in rows["cond"] and "prompt" in rows["cond"].split("EncodeOnceKV")[1]
    assert "LatentBuffer" in rows["frames"] and "FixedState" in rows["carry"]
    assert "40 frames (640 tokens)" in done.stdout
    assert_png(tmp_path / "rollout.png", 400)


@pytest.mark.parametrize("steps", [8, 9])
def test_rollout_demo_times_each_frame_over_its_iteration(monkeypatch, steps):
    """The callbacks of one iteration's steps reach the host together: each frame reads its iteration's mean."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    demo = importlib.import_module("world_model_rollout")
    per_iteration, rng = 2, np.random.default_rng(steps)
    groups = [list(range(i, min(i + per_iteration, steps))) for i in range(0, steps, per_iteration)]
    start, ends, times = 100.0, [], np.zeros(steps)
    for group in groups:  # an iteration's callbacks run one after another once its steps are done
        end = (ends[-1] if ends else start) + rng.uniform(1e-3, 5e-3)
        times[group] = end - 1e-5 * np.arange(len(group))[::-1]
        ends.append(end)
    expected = []
    for group, end, before in zip(groups, ends, [start, *ends]):
        expected += [(end - before) * 1e3 / len(group)] * len(group)
    np.testing.assert_allclose(demo.frame_ms(start, times, per_iteration), expected, rtol=1e-9)


def test_rollout_refuses_more_steps_than_capacity(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "world_model_rollout.py"), "--steps", "20", "--capacity", "256",
         "--out", str(tmp_path)], cwd=EXAMPLES, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "more than --capacity 256" in done.stderr


def test_rollout_in_append_mode(tmp_path):
    done = run_example("world_model_rollout.py", "--steps", "12", "--capacity", "256", "--out", str(tmp_path))
    kv = next(line for line in done.stdout.splitlines() if line.startswith("kv_3"))
    assert "[192]" in kv and " 256 " in kv  # 12 frames of 16 tokens, capacity 256
    assert_png(tmp_path / "rollout.png", 400)


def test_speculative_planning(tmp_path):
    done = run_example(
        "speculative_planning.py", "--candidates", "8", "--elites", "2", "--iterations", "3", "--horizon", "2",
        "--history", "4", "--out", str(tmp_path),
    )
    plan = json.loads((tmp_path / "plan.json").read_text())
    best = [it["best"] for it in plan["iterations"]]
    assert len(best) == 3 and np.all(np.isfinite(best))
    assert all(b >= a for a, b in itertools.pairwise(best)), best  # the best plan competes again: never worse
    assert plan["best_score"] == best[-1] >= max(it["iteration_best"] for it in plan["iterations"])
    assert np.asarray(plan["best_plan"]).shape == (2, 1, 2)
    assert plan["tokens_committed"] == (4 + 2) * 16  # the history, then the adopted lane's two frames
    assert f"session before branching: {DEVICE}:" in done.stdout
    assert "during branching (8 lanes x 2 frames)" in done.stdout
    assert f"best score {plan['best_score']:.4f}" in done.stdout


def test_quickstart():
    done = run_example("quickstart.py")
    assert "cond written once: True" in done.stdout and "bytes per device:" in done.stdout


SHARED_MODULES = {"world_model.py", "fitting.py"}  # imported by the scripts, not run


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in SHARED_MODULES))
def test_help_prints_the_flags_and_runs_nothing(script):
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], cwd=EXAMPLES,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    assert "-h, --help" in done.stdout and done.stdout.rstrip().count("\n") < 40  # the flags, then nothing else


def test_rollout_demo_with_int8_caches_reports_bytes_and_drift(tmp_path):
    done = run_example("world_model_rollout.py", "--steps", "12", "--quantize", "int8", "--out", str(tmp_path))
    bytes_line = next(line for line in done.stdout.splitlines() if line.startswith("K/V caches:"))
    ratio = float(re.search(r"\((\d+\.\d+)x\)", bytes_line).group(1))
    assert ratio <= 0.32  # head_dim 16: a float32 scale per 16 int8 values
    drift = next(line for line in done.stdout.splitlines() if line.startswith("frames against the float32 rollout"))
    assert 0 < float(re.search(r"relative \(L2\) ([0-9.e+-]+)", drift).group(1)) <= 2e-2


def test_shared_scenes_encode_each_scene_once_and_serve_the_same_frames():
    users, scenes = 12, 3
    done = run_example("shared_scenes.py", "--users", str(users), "--scenes", str(scenes), "--prompt-tokens", "256",
                       "--frames", "3", "--encoder-layers", "1")
    found = {m["name"]: m for m in re.finditer(
        r"(?P<name>own copy|shared): conditioning held\s+[\d.]+ MiB \(\s*(?P<copies>[\d.]+) x one copy\),\s+"
        r"(?P<encodes>\d+) encodes", done.stdout)}
    assert set(found) == {"own copy", "shared"}, done.stdout
    assert float(found["own copy"]["copies"]) == users and int(found["own copy"]["encodes"]) == users
    shared = int(found["shared"]["encodes"])
    assert 1 <= shared <= scenes and float(found["shared"]["copies"]) == shared  # one copy per scene in use
    hits, misses = map(int, re.search(r"store: (\d+) hits, (\d+) misses", done.stdout).groups())
    assert (hits, misses) == (users - shared, shared)
    assert "every user's frames equal with and without reuse: yes" in done.stdout


def test_video_diffusion_with_sessions_samples_what_recomputing_samples(tmp_path):
    """At float64, the sessions (rolling caches, two forked streams) give the frames of recomputing every step."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "video_diffusion.py"), "--frames", "5", "--train-steps", "0", "--batch", "2",
         "--layers", "1", "--d-model", "32", "--size", "8", "--dtype", "float64", "--compare", "--out", str(tmp_path)],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_ENABLE_X64": "1"},
    )
    assert done.returncode == 0, f"video_diffusion.py failed:\n{done.stdout}\n{done.stderr}"
    found = re.search(r"largest difference (\S+) \(frames up to (\S+)\)", done.stdout)
    difference, largest = map(float, found.groups())
    assert largest > 0.1 and difference <= 1e-5 * largest, done.stdout  # 5 frames: past the ring of 4 with its sink
    assert "5 frames of 4 tokens" in done.stdout
    assert_png(tmp_path / "video_diffusion.png", 300)


def test_genie_dynamics_decodes_the_same_tokens_with_the_session(tmp_path):
    done = run_example("genie_dynamics.py", "--frames", "3", "--train-steps", "0", "--layers", "1", "--d-model", "32",
                       "--out", str(tmp_path))
    assert "tokens agree: True" in done.stdout, done.stdout
    cached, recomputed = map(float, re.search(r"session median ([\d.]+) ms, recomputing median ([\d.]+) ms",
                                              done.stdout).groups())
    assert cached > 0 and recomputed > 0
    assert_png(tmp_path / "genie_dynamics.png", 300)


def test_genie_dynamics_session_matches_recomputing_on_random_weights(monkeypatch):
    """Greedy MaskGIT over an untrained model: the session's tokens and logits are the recomputed ones."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    genie = importlib.import_module("genie_dynamics")
    config = genie.GenieConfig(side=4, layers=2, d_model=32, max_frames=5, steps=2, batch=2)
    model = nnx.jit(lambda: genie.Dynamics(config, rngs=nnx.Rngs(3)))()
    tokens, actions = genie.sprite_scene(jax.random.key(1), config, config.max_frames)
    cached, _ = genie.rollout_cached(model, tokens[:, :2], actions)
    recomputed, _ = genie.rollout_recomputed(model, tokens[:, :2], actions)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(recomputed))
    assert cached.shape == (2, 5, 16) and len(np.unique(np.asarray(cached)[:, 2:])) > 1  # decoded, not constant
    # the logits of the last frame's first pass, cached against the dense pass over the whole context
    masked = jnp.full((2, config.positions), config.vocab, jnp.int32)

    @jax.jit
    def last_frame_logits(frames):
        session = genie.prompt_session(model, frames[:, :4], actions[:, :4])
        _, logits = model.frame_step(session, masked, actions[:, 4], jnp.asarray(4))
        return logits, model.dense(frames.at[:, 4].set(masked), actions)[:, 4]

    logits, dense = last_frame_logits(cached)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(dense), rtol=1e-4, atol=1e-4)
