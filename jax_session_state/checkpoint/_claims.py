"""What a restore trusts of a manifest: names looked up in fixed tables, sizes bounded by the files.

A manifest's digest detects damage, not edits: whoever can write the files
can write a matching digest.  So nothing a manifest names is imported or
evaluated, and nothing it claims is allocated before it is checked:

- classes (the kind of each object, namedtuples in recorded structures)
  resolve only among classes this process already defined: the registry of
  :class:`~jax_session_state.StateObject` subclasses, namedtuples of modules
  already imported, and the classes the caller passes to ``restore``;
- dtypes resolve in :data:`DTYPES`, typed PRNG key implementations in
  :data:`KEY_IMPLS`;
- every array entry is checked for its form, and the bytes the entries
  claim must be on disk (arrays are written uncompressed, every chunk of
  them) before anything is read.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_session_state.base import StateObject, state_object_classes
from jax_session_state.errors import CheckpointError, PayloadTypeError

__all__ = ["DTYPES", "KEY_IMPLS", "Classes", "check_entries", "dtype_named", "key_impl_named"]

_DTYPE_NAMES = (
    "bool", "int2", "int4", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "float4_e2m1fn", "float8_e3m4",
    "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)

DTYPES: Mapping[str, np.dtype] = {
    np.dtype(getattr(jnp, name)).name: np.dtype(getattr(jnp, name)) for name in _DTYPE_NAMES if hasattr(jnp, name)
}
"""The dtypes a checkpoint holds, by name: booleans and numbers that Orbax's files can store (``ml_dtypes``'
among them; not ``uint2``, ``uint4`` nor ``float8_e4m3``, which TensorStore does not write)."""

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
"""The typed PRNG key implementations a checkpoint may name: JAX's own."""

_ENTRY_TYPES = ("jax", "numpy", "numpy_scalar", "key")


def dtype_named(name: Any) -> np.dtype:
    """The dtype called ``name`` in :data:`DTYPES`.

    Raises:
      CheckpointError: any other name.
    """
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointError(
            f"the checkpoint names dtype {name!r}, which is not one a checkpoint holds ({', '.join(DTYPES)})."
        )
    return DTYPES[name]


def key_impl_named(name: Any) -> str:
    """``name`` if it is one of :data:`KEY_IMPLS`.

    Raises:
      CheckpointError: any other name.
    """
    if not isinstance(name, str) or name not in KEY_IMPLS:
        raise CheckpointError(
            f"the checkpoint names PRNG key implementation {name!r}, which is not one of JAX's {KEY_IMPLS}."
        )
    return name


class Classes:
    """Resolves the ``"module:QualName"`` names a checkpoint records, importing nothing.

    Args:
      given: classes the caller passes to ``restore`` (state-object kinds
        and namedtuples).  Each resolves its own ``"module:QualName"``, and
        also any name with its qualified name when no other given class has
        that one (a kind saved from a script's ``__main__`` restores where
        the class lives in a module).

    Raises:
      PayloadTypeError: an entry of ``given`` is neither a StateObject
        subclass nor a namedtuple class.
    """

    def __init__(self, given: Iterable[type] = ()) -> None:
        given = tuple(given)
        for cls in given:
            if not (isinstance(cls, type) and (issubclass(cls, StateObject) or _is_namedtuple(cls))):
                raise PayloadTypeError(
                    f"restore(classes=...) takes StateObject subclasses and namedtuple classes; got {cls!r}."
                )
        self._given = {f"{cls.__module__}:{cls.__qualname__}": cls for cls in given}
        qualnames = [cls.__qualname__ for cls in given]
        self._given_by_qualname = {cls.__qualname__: cls for cls in given if qualnames.count(cls.__qualname__) == 1}

    def _lookup(self, name: Any, defined: Mapping[str, type]) -> type | None:
        """A given class of this name, else one ``defined`` here, else a given class of its qualified name."""
        if not isinstance(name, str):
            return None
        found = self._given.get(name) or defined.get(name)
        return found or self._given_by_qualname.get(name.partition(":")[2])

    def kind(self, name: Any) -> type[StateObject]:
        """The StateObject class called ``name``: given to ``restore``, or defined in this process.

        Raises:
          CheckpointError: no such class is defined here, saying how to make it known.
        """
        found = self._lookup(name, state_object_classes())
        if found is None or not issubclass(found, StateObject):
            module = name.partition(":")[0] if isinstance(name, str) else "?"
            raise CheckpointError(
                f"the checkpoint names the state-object kind {name!r}, which is not defined in this process; a "
                f"restore imports no code a checkpoint names. Import the module that defines it ({module!r}) "
                "before restoring, or pass the class: restore(path, classes=[TheKind])."
            )
        return found

    def namedtuple(self, name: Any) -> type[tuple]:
        """The namedtuple class called ``name``: given to ``restore``, or in a module already imported.

        Raises:
          CheckpointError: no such class here, saying how to make it known.
        """
        found = self._lookup(name, {name: _already_imported(name)} if isinstance(name, str) else {})
        if not (isinstance(found, type) and _is_namedtuple(found)):
            raise CheckpointError(
                f"the checkpoint names the namedtuple {name!r}, which is not defined in this process; a restore "
                "imports no code a checkpoint names. Import its module before restoring, or pass the class: "
                "restore(path, classes=[TheTuple])."
            )
        return found


def _already_imported(name: str) -> Any:
    """What ``"module:QualName"`` names in a module this process already imported (None if nothing)."""
    module, _, qualname = name.partition(":")
    found = sys.modules.get(module)  # only modules already imported: nothing is imported here
    for part in qualname.split(".") if found is not None else ():
        found = getattr(found, part, None)
    return found


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def check_entries(directory: Path, entries: Mapping[str, Any], arrays: Path) -> None:
    """Checks the form of every array entry, and that the bytes they claim are in the files under ``arrays``.

    Arrays are written uncompressed and every chunk of them is written, so
    the files hold at least the bytes the entries claim; an entry that claims
    more (an edited manifest) is refused before anything is allocated.

    Raises:
      CheckpointError: naming the manifest and the entry, or the bytes
        claimed and found.
    """
    where = directory / "manifest.json"
    claimed = 0
    for key, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("type") not in _ENTRY_TYPES:
            raise CheckpointError(f"{where}: array {key!r} has no type this library writes ({_ENTRY_TYPES}).")
        shape = entry.get("shape")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise CheckpointError(f"{where}: array {key!r} has shape {shape!r}, not a list of sizes >= 0.")
        try:
            dtype = dtype_named(entry.get("dtype"))
            if entry["type"] == "key":
                key_impl_named(entry.get("impl"))
        except CheckpointError as error:
            raise CheckpointError(f"{where}: array {key!r} ({entry.get('where')}): {error}") from None
        claimed += math.prod(shape) * dtype.itemsize
    found = _bytes_under(arrays)
    if claimed > found:
        raise CheckpointError(
            f"{where}: its arrays claim {claimed} bytes, but the files under {arrays} hold {found}: the manifest "
            "does not describe these files (edited, or the array files are truncated or missing). Nothing was read."
        )


def _bytes_under(directory: Path) -> int:
    """The bytes of the files under ``directory`` (0 where it does not exist)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:  # a file that went away while counted holds nothing to read
                pass
    return total
