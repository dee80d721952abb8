"""A checkpoint's array bytes, written and read with Orbax.

Arrays are written as one Orbax PyTree checkpoint keyed ``"0"``, ``"1"``, ...
and read back placed where the restore wants them: on a sharding, or as
numpy arrays.  Orbax's warnings about OCDBT merges (there is nothing to
merge without OCDBT) are silenced only while these calls run.

Orbax refuses arrays of zero size: those are not written (the manifest
records their shape and dtype) and a read makes them anew, placed as the
others.

Orbax's per-process array metadata files are not written: the manifest
records every array's shape and dtype (typed PRNG keys are saved as their
key data), and with several processes every non-primary process polled a
quarter of a second for the folder of those files, which doubled a save
(``benchmarks/multihost.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_session_state.errors import CheckpointError

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

__all__ = ["AS_NUMPY", "Destination", "read_arrays", "write_arrays"]

AS_NUMPY = "numpy"
"""The destination of arrays restored as numpy arrays (saved from numpy)."""

Destination = jax.sharding.Sharding | Literal["numpy"]
"""Where one restored array goes."""

_OPTIONS = {"use_ocdbt": False, "use_compression": False}
"""How arrays are written, chosen by measurement (``benchmarks/sharded.py``): session
state is a few large arrays of incompressible floats, so compression only costs
time, and plain zarr files saved faster than OCDBT's single data file."""

_CHUNK_BYTES = 16 << 20
"""The largest zarr chunk written, also chosen by measurement: 16 MiB chunks saved and
restored faster than Orbax's default chunking (BENCHMARKS.md)."""


class _WithoutOcdbtMergeWarning(logging.Filter):
    """Drops the warning Orbax logs on every save without OCDBT."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


@functools.cache
def _orbax() -> Any:
    """``orbax.checkpoint``, imported on the first save or restore: ``import jax_session_state`` stays fast."""
    import orbax.checkpoint

    return orbax.checkpoint


@functools.cache
def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's handlers for what a checkpoint's table holds, jax arrays without array metadata files."""
    handlers = _orbax().type_handlers
    scalar = handlers.ScalarHandler()
    return handlers.create_type_handler_registry(
        (int, scalar), (float, scalar), (np.number, scalar), (np.ndarray, handlers.NumpyHandler()),
        (jax.Array, handlers.ArrayHandler(array_metadata_store=None)),
    )


@contextlib.contextmanager
def _handler() -> Iterator[ocp.PyTreeCheckpointHandler]:
    """Orbax's PyTree handler as the library configures it, with the OCDBT merge warning filtered while it is used."""
    absl, quiet = logging.getLogger("absl"), _WithoutOcdbtMergeWarning()  # one filter per call: threads may overlap
    absl.addFilter(quiet)
    handler = _orbax().PyTreeCheckpointHandler(**_OPTIONS, type_handler_registry=_type_handlers())
    try:
        yield handler
    finally:
        handler.close()
        absl.removeFilter(quiet)


def write_arrays(directory: Path, values: Mapping[str, Any]) -> None:
    """Writes ``values`` (jax or numpy arrays by key) to ``directory``: this process's shards of them.

    Orbax's handler writes them without its ``Checkpointer``: the checkpoint
    makes its own partial directory and its own steps between processes,
    each with a timeout, where the ``Checkpointer``'s barriers would wait
    for a process that died.  Arrays of zero size are left out; with none of
    another size nothing is written.

    Raises:
      CheckpointError: the files cannot be written (a full or read-only file
        system, a folder deleted), naming the directory.
    """
    stored = {key: x for key, x in values.items() if x.size}
    if not stored:
        return
    try:
        with _handler() as handler:
            ocp = _orbax()
            save_args = {key: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES) for key in stored}
            handler.save(directory, args=ocp.args.PyTreeSave(stored, save_args=save_args))
    except Exception as error:  # Orbax and TensorStore raise many types for what the file system refused
        raise CheckpointError(f"{directory}: the arrays cannot be written: {error}") from error


def read_arrays(
    directory: Path, layout: Mapping[str, tuple[tuple[int, ...], str]], destinations: Mapping[str, Destination]
) -> dict[str, Any]:
    """Reads every array of ``layout`` (key -> shape, dtype name) onto its destination.

    Arrays of zero size (never written) are made anew there.

    Raises:
      CheckpointError: the files cannot be read (missing, damaged or truncated).
    """
    ocp, item, restore_args, empty = _orbax(), {}, {}, {}
    for key, (shape, dtype_name) in layout.items():
        place, dtype = destinations[key], jnp.dtype(dtype_name)
        on_host = isinstance(place, str)
        if not math.prod(shape):
            empty[key] = np.zeros(shape, dtype) if on_host else jax.device_put(np.zeros(shape, dtype), place)
            continue
        item[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=None if on_host else place)
        restore_args[key] = (
            ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
            if on_host
            else ocp.ArrayRestoreArgs(sharding=place, dtype=dtype)
        )
    if not item:
        return empty
    try:  # the handler alone: the checkpoint's own checks (and, with processes, its exchange) follow the read
        with _handler() as handler:
            read = handler.restore(directory, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
        return {**read, **empty}
    except Exception as error:  # Orbax and TensorStore raise many types for damaged files
        raise CheckpointError(
            f"{directory.parent}: the arrays cannot be read (damaged or truncated files?): {error}"
        ) from error
