"""Checkpoint directories that appear whole or not at all.

A save writes into ``.partial-N``, flushes it, renames it to ``ckpt-N`` (a
rename is atomic) and only then renames older checkpoints to
``.superseded-M`` and deletes them off the caller's path (the interpreter
waits for the deletion at exit).  A crash at any moment leaves the previous
``ckpt-*`` complete; readers only ever open the newest ``ckpt-*``; a save
that fails with an error removes its ``.partial-N``.  A save holds its
``.partial-N`` open while it writes and checks, before publishing, that the
name still leads to that directory: one deleted mid-save (and perhaps made
again by a writer that creates missing folders) is an error, never a
published checkpoint with files missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from jax_session_state.errors import CheckpointError

__all__ = [
    "begin", "held_open", "named", "newest", "publish", "removed_on_failure", "save_number", "write_durably",
]

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
def removed_on_failure(partial: Path, settled: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Removes the partial directory of a save if the block raises, so a failed save leaves nothing behind.

    ``settled`` is called first: with several processes it returns once every
    other process has stopped writing into ``partial`` (or the timeout has
    passed), so that none is still writing when it goes.
    """
    try:
        yield
    except BaseException:
        settled()
        for _ in range(3):  # another process may still be removing it, or have written into it
            shutil.rmtree(partial, ignore_errors=True)
            if not partial.exists():
                break
        raise


@contextlib.contextmanager
def held_open(partial: Path) -> Iterator[Callable[[], None]]:
    """Holds the partial directory open during a save; yields a check that ``partial`` still names it.

    An open directory keeps its inode even when deleted, so a directory made
    again under the same name is never taken for it.

    The check raises:
      CheckpointError: the directory was deleted, or replaced, since the save began.
    """
    descriptor = os.open(partial, os.O_RDONLY)
    made = os.fstat(descriptor)

    def check() -> None:
        try:
            now = os.stat(partial)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):
            raise CheckpointError(
                f"{partial} was deleted during the save{'' if now is None else ' (and made again)'}, so files "
                "written into it are gone; nothing was published and the previous checkpoint is untouched."
            )

    try:
        yield check
    finally:
        os.close(descriptor)


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
