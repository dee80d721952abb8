"""What the disk does to a save or restore: full, read-only, a folder deleted mid-save, files vanishing mid-restore.

Each fault is real where the test can make it: a full file system is a small
tmpfs the test mounts (and, everywhere, a file-size limit set with
``resource.setrlimit``); a read-only target is a read-only bind mount (as
root, ``chmod`` does not stop writes).  Tests that need a mount are skipped,
with the reason, where mounts are refused.  Every fault must raise
CheckpointError naming the path, leave no partial directory, and leave the
previous checkpoint restorable bit for bit.
"""

from __future__ import annotations

import contextlib
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state import checkpoint
from jax_session_state.checkpoint import _orbax_io


def session_of(nbytes: int, seed: int) -> jss.Session:
    """A session holding about ``nbytes`` of random float32 values."""
    rng = np.random.default_rng(seed)
    rows = max(nbytes // (4 * 256), 1)
    carry = jss.FixedState.allocate(shapes=(rows, 256)).commit(jnp.asarray(rng.normal(size=(rows, 256)), jnp.float32))
    return jss.Session(objects={"carry": carry}, attrs={"x": jnp.asarray(rng.normal(size=3), jnp.float32)})


def assert_restores(path: Path, session: jss.Session) -> None:
    restored = checkpoint.restore(path)
    for name in ("carry",):
        assert np.asarray(restored[name].view()).tobytes() == np.asarray(session[name].view()).tobytes()
    assert np.asarray(restored.attrs["x"]).tobytes() == np.asarray(session.attrs["x"]).tobytes()


def names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _mount(*arguments: str) -> None:
    """Runs ``mount``; skips the test where this machine refuses mounts (no privilege), fails on other errors."""
    try:
        done = subprocess.run(["mount", *arguments], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("this machine has no mount command")
    refused = ("permission denied", "not permitted", "must be superuser", "only root")
    if done.returncode and any(words in done.stderr.lower() for words in refused):
        pytest.skip(f"this machine refuses mounts (mount {' '.join(arguments)}: {done.stderr.strip()})")
    assert done.returncode == 0, f"mount {' '.join(arguments)}: {done.stderr}"


@contextlib.contextmanager
def mounted(target: Path, *arguments: str) -> Iterator[Path]:
    """``mount *arguments target`` for the block (skipping the test where mounts are refused), unmounted after."""
    target.mkdir(exist_ok=True)
    _mount(*arguments, str(target))
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_full_file_system_raises_naming_the_path_and_keeps_the_previous_checkpoint(tmp_path):
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=512k", "tmpfs") as small:
        first = session_of(64 << 10, 0)
        checkpoint.save(small, first)
        with pytest.raises(jss.CheckpointError, match="No space left on device") as raised:
            checkpoint.save(small, session_of(1 << 20, 1))  # twice the file system
        assert str(small) in str(raised.value)
        assert names(small) == ["ckpt-000001"]  # no partial directory: its space is free again
        assert_restores(small, first)


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past ``nbytes`` of a file fail with EFBIG (SIGXFSZ ignored) for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_file_size_limit_raises_naming_the_path_and_keeps_the_previous_checkpoint(tmp_path):
    first = session_of(16 << 10, 2)
    checkpoint.save(tmp_path, first)
    with file_size_limit(256 << 10), pytest.raises(jss.CheckpointError, match="File too large") as raised:
        checkpoint.save(tmp_path, session_of(1 << 20, 3))
    assert str(tmp_path) in str(raised.value)
    assert names(tmp_path) == ["ckpt-000001"]
    assert_restores(tmp_path, first)


def test_a_read_only_target_raises_naming_the_path_and_restores_as_before(tmp_path):
    source, first = tmp_path / "source", session_of(16 << 10, 4)
    checkpoint.save(source, first)
    with mounted(tmp_path / "target", "--bind", str(source)) as target:
        _mount("-o", "remount,ro,bind", str(target))
        with pytest.raises(jss.CheckpointError, match="Read-only file system") as raised:
            checkpoint.save(target, session_of(16 << 10, 5))
        assert str(target) in str(raised.value)
        assert names(target) == ["ckpt-000001"]
        assert_restores(target, first)


@pytest.mark.parametrize("made_again", [False, True], ids=["deleted", "deleted and made again"])
def test_a_partial_directory_deleted_mid_save_raises_and_nothing_is_published(tmp_path, monkeypatch, made_again):
    first = session_of(16 << 10, 6)
    checkpoint.save(tmp_path, first)
    write = _orbax_io.write_arrays

    def deleted_after_writing(directory: Path, values) -> None:
        write(directory, values)
        shutil.rmtree(directory.parent)
        if made_again:  # as TensorStore does when it writes into a folder that is gone
            (directory / "0").mkdir(parents=True)

    monkeypatch.setattr(_orbax_io, "write_arrays", deleted_after_writing)
    with pytest.raises(jss.CheckpointError, match="was deleted during the save") as raised:
        checkpoint.save(tmp_path, session_of(16 << 10, 7))
    assert str(tmp_path / ".partial-000002") in str(raised.value)
    assert ("made again" in str(raised.value)) == made_again
    assert names(tmp_path) == ["ckpt-000001"]
    assert_restores(tmp_path, first)


def test_files_that_vanish_mid_restore_raise_naming_the_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, session_of(64 << 10, 8))
    read = _orbax_io.read_arrays

    def vanishing(directory: Path, layout, destinations):
        largest = max(layout, key=lambda key: np.prod(layout[key][0]))
        shutil.rmtree(directory / largest)  # the carry's files go as the read begins
        return read(directory, layout, destinations)

    monkeypatch.setattr(_orbax_io, "read_arrays", vanishing)
    with pytest.raises(jss.CheckpointError, match="the arrays cannot be read") as raised:
        checkpoint.restore(tmp_path)
    assert str(tmp_path / "ckpt-000001") in str(raised.value)
