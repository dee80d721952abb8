"""Saves that cannot or did not succeed, and mistakes in restore's arguments: clear errors, nothing left behind."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state import checkpoint
from jax_session_state.checkpoint import _manifest, _orbax_io


def random_session(seed):
    rng = np.random.default_rng(seed)
    carry = jss.FixedState.allocate(shapes=(4, 8)).commit(jnp.asarray(rng.normal(size=(4, 8)), jnp.float32))
    return jss.Session(objects={"carry": carry}, attrs={"x": jnp.asarray(rng.normal(size=3), jnp.float32)})


def test_a_donated_session_is_refused_naming_the_object_and_nothing_is_written(tmp_path):
    session = random_session(0)
    jax.jit(lambda s: s, donate_argnums=0)(session)
    with pytest.raises(jss.DonatedError, match=r"session object 'carry' \(FixedState\(float32\[4, 8\]\)\) was donated"):
        checkpoint.save(tmp_path, session)
    assert not any(tmp_path.iterdir())


def test_a_donated_attr_is_refused_naming_it_and_nothing_is_written(tmp_path):
    session = random_session(1)
    jax.jit(lambda x: x + 1, donate_argnums=0)(session.attrs["x"])
    with pytest.raises(jss.DonatedError, match=r"the session's attrs\['x'\] was donated"):
        checkpoint.save(tmp_path, session)
    assert not any(tmp_path.iterdir())


def test_a_save_that_fails_midway_leaves_no_partial_directory(tmp_path, monkeypatch):
    first = random_session(2)
    checkpoint.save(tmp_path, first)

    def disk_full(directory, values):
        directory.mkdir()
        (directory / "half-written").write_bytes(b"\0" * 64)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_orbax_io, "write_arrays", disk_full)
    with pytest.raises(jss.CheckpointError, match=rf"into {tmp_path} failed: \[Errno 28\] No space left"):
        checkpoint.save(tmp_path, random_session(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001"]
    restored = checkpoint.restore(tmp_path)
    assert np.asarray(restored["carry"].view()).tobytes() == np.asarray(first["carry"].view()).tobytes()


SAVE_TWICE_AND_EXIT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import jax_session_state as jss
    keys = jax.random.split(jax.random.key(0), 64)
    session = jss.Session(objects={f"h{i}": jss.FixedState.allocate(shapes=(256, 256)).commit(
        jax.random.normal(keys[i], (256, 256))) for i in range(64)})  # 64 arrays: a checkpoint of many files
    jss.checkpoint.save(sys.argv[1], session)
    jss.checkpoint.save(sys.argv[1], session)
    """
)


def test_a_process_that_saves_twice_and_exits_leaves_only_the_newest_checkpoint(tmp_path):
    subprocess.run([sys.executable, "-c", SAVE_TWICE_AND_EXIT, str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000002"]  # the superseded one deleted at exit


def test_a_manager_target_that_is_not_empty_is_refused_as_the_argument_it_is(tmp_path):
    manager = jss.SessionStateManager()
    manager.create("a", random_session(4))
    checkpoint.save(tmp_path, manager)
    with pytest.raises(jss.CheckpointError, match=r"^restore\(target=\.\.\.\): the manager must be empty; it holds 1"):
        checkpoint.restore(tmp_path, target=manager)


def test_a_malformed_manifest_message_ends_with_one_period():
    message = str(_manifest.malformed(Path("ckpt-000001"), ValueError("the piece does not fit.")))
    assert message == "ckpt-000001/manifest.json is malformed: ValueError: the piece does not fit."
