"""Checkpoint directories that appear whole or not at all.

A save writes into ``.partial-N``, flushes it, renames it to ``ckpt-N`` (a
rename is atomic) and only then renames older checkpoints to
``.superseded-M`` and deletes them off the caller's path (the interpreter
waits for the deletion at exit).  A crash at any moment leaves the previous
``ckpt-*`` complete; readers only ever open the newest ``ckpt-*``; a save
that fails with an error removes its ``.partial-N``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from jax_session_state.errors import CheckpointError

__all__ = ["begin", "named", "newest", "publish", "removed_on_failure", "save_number", "write_durably"]

_COMPLETE = re.compile(r"ckpt-(\d+)")
_PARTIAL = ".partial-"
_SUPERSEDED = ".superseded-"


def _complete(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``root``, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _COMPLETE.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def begin(root: Path) -> tuple[Path, Path]:
    """A new, empty partial directory in ``root`` and the name it will be published as.

    Clears what crashed saves left behind.  One writer per ``root`` at a time.
    """
    root.mkdir(parents=True, exist_ok=True)
    for leftover in (*root.glob(f"{_PARTIAL}*"), *root.glob(f"{_SUPERSEDED}*")):
        shutil.rmtree(leftover, ignore_errors=True)
    number = max((n for n, _ in _complete(root)), default=0) + 1
    partial, final = named(root, number)
    partial.mkdir()
    return partial, final


def named(root: Path, number: int) -> tuple[Path, Path]:
    """The partial directory of save ``number`` in ``root`` and the name it will be published as.

    Processes other than the primary take the number the primary's
    :func:`begin` chose (they must not clear or create anything themselves).
    """
    return root / f"{_PARTIAL}{number:06d}", root / f"ckpt-{number:06d}"


def save_number(directory: Path) -> int:
    """The number of the save a partial or complete checkpoint directory holds (``ckpt-000007``: 7)."""
    return int(directory.name.rpartition("-")[2])


@contextlib.contextmanager
def removed_on_failure(partial: Path) -> Iterator[None]:
    """Removes the partial directory of a save if the block raises, so a failed save leaves nothing behind."""
    try:
        yield
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def publish(partial: Path, final: Path) -> Path:
    """Makes ``partial`` the newest checkpoint, durably, then removes the older ones."""
    root = final.parent
    _fsync_directory(partial)
    os.rename(partial, final)
    _fsync_directory(root)
    # Older checkpoints leave by an atomic rename; their files are deleted off the caller's path, by a
    # thread that is not a daemon: the interpreter waits for it at exit, so none is left half deleted.
    trash = [older.rename(root / f"{_SUPERSEDED}{n:06d}") for n, older in _complete(root)[:-1]]
    if trash:
        threading.Thread(target=lambda: [shutil.rmtree(t, ignore_errors=True) for t in trash]).start()
    return final


def newest(root: Path) -> Path:
    """The newest complete checkpoint in ``root``.

    Raises:
      CheckpointError: ``root`` is not a directory or holds no complete checkpoint.
    """
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {root}: it is not a directory.")
    complete = _complete(root)
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {root} (a save that crashed leaves none).")
    return complete[-1][1]


def write_durably(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` and flushes it to disk."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
