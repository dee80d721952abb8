"""What a checkpoint needs from JAX's multi-controller runtime: who is primary, small exchanges.

Every call here but :func:`count` and :func:`is_primary` is collective when
``jax.process_count() > 1``: all processes make it, in the same order.  With
one process each is a no-op or returns its input, so a single-process save
or restore runs no collective.  The exchanges go through
:mod:`jax.experimental.multihost_utils` (device collectives, CPU ones
included when ``jax_cpu_collectives_implementation`` is set); an exchange
returns on no process before every process has made it, so it doubles as a
barrier.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_session_state.errors import CheckpointError

__all__ = ["allgather_ints", "allgather_json", "broadcast_int", "count", "is_primary", "run_on_primary"]


def count() -> int:
    """The number of JAX processes."""
    return jax.process_count()


def is_primary() -> bool:
    """Whether this process writes what only one process writes (the manifest, the rename)."""
    return jax.process_index() == 0


def _multihost() -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils


def broadcast_int(value: int) -> int:
    """The primary process's ``value``, on every process."""
    if count() == 1:
        return value
    return int(_multihost().broadcast_one_to_all(np.int32(value)))


def run_on_primary(action: Callable[[], int], what: str) -> int:
    """``action()`` run by the primary process; its result (an int >= 0) on every process.

    The outcome is exchanged, so a failure reaches every process and none
    waits for a primary that gave up: the primary raises what ``action``
    raised, the others a :class:`CheckpointError` saying that the primary
    could not ``what``.
    """
    failure, result = None, -1
    if is_primary():
        try:
            result = action()
        except Exception as error:
            failure = error
    result = broadcast_int(result)
    if failure is not None:
        raise failure
    if result < 0:
        raise CheckpointError(f"the primary process could not {what} (its own error says why); nothing was saved.")
    return result


def allgather_ints(values: list[int]) -> np.ndarray:
    """Every process's ``values`` (the same number on each), one row per process in process order."""
    row = np.asarray(values, np.int32).reshape(1, -1)
    if count() == 1:
        return row
    return np.asarray(_multihost().process_allgather(row, tiled=True)).reshape(count(), -1)


def allgather_json(value: Any) -> list[Any]:
    """Every process's ``value`` (anything JSON holds), in process order, on every process."""
    if count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value, separators=(",", ":")).encode(), np.uint8)
    sizes = allgather_ints([data.size])[:, 0]
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(_multihost().process_allgather(padded))
    return [json.loads(bytes(row[: int(size)]).decode()) for row, size in zip(rows, sizes)]


def gather_to_host(x: jax.Array) -> np.ndarray:
    """The whole global array ``x`` as numpy, on every process (collective)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(_multihost().process_allgather(x, tiled=True))
