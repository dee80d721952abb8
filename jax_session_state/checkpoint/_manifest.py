"""A checkpoint's ``manifest.json``: what it holds, its arrays, and the digest covering both.

The manifest is one JSON object::

    {"format": FORMAT, "version": VERSION, "content": "session" | "manager",
     "record": {...},                     what is saved, without array bytes
     "arrays": {"0": {"where", "type", "shape", "dtype", ["weak_type"], "digest", ["impl"]}, ...},
     "digest": "..."}                     BLAKE2b of everything above

Reading checks, in order: the file parses, it is a checkpoint of this format
and version, and its digest matches.  After that every entry is exactly what
the save wrote; the arrays' digests are checked once their bytes are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_session_state.checkpoint import _atomic
from jax_session_state.checkpoint._claims import DTYPES
from jax_session_state.checkpoint._digest import array_digests, manifest_digest
from jax_session_state.errors import CheckpointError

__all__ = ["FORMAT", "MANIFEST", "VERSION", "ArrayTable", "read", "write"]

FORMAT = "jax_session_state.checkpoint"
VERSION = 5
"""The checkpoint format version this library writes and reads (CHANGELOG.md lists each)."""

MANIFEST = "manifest.json"


class ArrayTable:
    """The arrays of one checkpoint, keyed ``"0"``, ``"1"``, ..., with their manifest entries.

    Typed PRNG keys are held as their key data, with the implementation in
    the entry; numpy arrays and scalars are marked so they restore as numpy
    (and held in native byte order); a weakly typed jax array (made from a
    Python scalar) is marked ``weak_type`` (an entry without the mark is
    not).
    """

    def __init__(self, *, keep_values: bool = True) -> None:
        self.keep_values = keep_values
        self.values: dict[str, Any] = {}
        self.entries: dict[str, dict[str, Any]] = {}

    def add(self, x: Any, where: str) -> str:
        """Adds array ``x`` (described as ``where`` in errors); returns its key.

        Raises:
          CheckpointError: ``x`` is a numpy array of strings, objects, dates
            or records, or of a dtype outside the table of those a
            checkpoint holds (what Orbax cannot write), naming ``where``.
        """
        key = str(len(self.entries))
        entry: dict[str, Any] = {"where": where}
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            entry.update(type="key", impl=str(jax.random.key_impl(x)))
            x = jax.random.key_data(x)
        elif isinstance(x, jax.Array):
            entry["type"] = "jax"
        else:
            entry["type"] = "numpy_scalar" if isinstance(x, np.generic) else "numpy"
            x = _numbers_in_native_order(np.asarray(x), where)
        if np.dtype(x.dtype).name not in DTYPES:
            raise CheckpointError(
                f"{where}: cannot save an array of dtype {np.dtype(x.dtype).name}; checkpoints hold "
                f"{', '.join(DTYPES)}. Convert it to one of them."
            )
        entry.update(shape=list(x.shape), dtype=np.dtype(x.dtype).name)
        if isinstance(x, jax.Array) and x.weak_type:
            entry["weak_type"] = True
        if self.keep_values:
            self.values[key] = x
        self.entries[key] = entry
        return key

    def digested_entries(self) -> dict[str, dict[str, Any]]:
        """The manifest entries, each with its array's digest."""
        digests = array_digests(self.values)
        return {key: {**entry, "digest": digests[key]} for key, entry in self.entries.items()}


def _numbers_in_native_order(x: np.ndarray, where: str) -> np.ndarray:
    """``x`` in this machine's byte order (a big-endian array's values kept), if it holds booleans or numbers.

    Raises:
      CheckpointError: ``x`` holds strings, objects, dates, durations or records.
    """
    numbers = x.dtype.kind in "biufc" or (x.dtype.kind == "V" and jax.dtypes.issubdtype(x.dtype, np.number))
    if not numbers:  # kind "V" holds bfloat16, float8 and int4 as well as records
        raise CheckpointError(
            f"{where}: cannot save a numpy array of dtype {x.dtype}; checkpoints hold arrays of booleans and "
            "numbers (bfloat16, float8 and int4 among them). Convert it to one, or keep strings as str attrs."
        )
    return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))


def write(directory: Path, content: str, record: dict[str, Any], entries: dict[str, Any]) -> None:
    """Writes the manifest of ``record`` and ``entries`` into ``directory``, durably."""
    manifest = {"format": FORMAT, "version": VERSION, "content": content, "record": record, "arrays": entries}
    manifest["digest"] = manifest_digest(manifest)
    _atomic.write_durably(directory / MANIFEST, json.dumps(manifest, indent=1))


def read(directory: Path) -> dict[str, Any]:
    """The manifest in ``directory``, checked against its digest.

    Raises:
      CheckpointError: naming the file and what is wrong: it cannot be read
        or parsed, is not a checkpoint of this format and version, or does
        not match its digest (damaged).
    """
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} cannot be read (damaged or truncated?): {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a {FORMAT} checkpoint ({path} does not say so).")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{directory} was written in checkpoint format version {manifest.get('version')!r}; this "
            f"library reads version {VERSION}. Restore it with the jax_session_state that wrote it "
            "(CHANGELOG.md says which versions wrote which format)."
        )
    digest = manifest.pop("digest", None)
    if digest != manifest_digest(manifest):
        raise CheckpointError(
            f"{path} does not match its digest: the file is damaged (or was edited). Nothing was restored."
        )
    if not isinstance(manifest.get("arrays"), dict) or "record" not in manifest:
        raise CheckpointError(f"{path} is malformed: it has no record or no table of arrays.")
    return manifest


def malformed(directory: Path, error: BaseException) -> CheckpointError:
    """The error for a manifest whose digest matched but whose record does not decode."""
    return CheckpointError(f"{directory / MANIFEST} is malformed: {type(error).__name__}: {str(error).rstrip('.')}.")
