"""Digests of arrays that no one process holds whole: the pieces each process wrote, checked on restore.

A checkpoint saved from one process records one digest per array (its whole
bytes, :mod:`._digest`).  Saved from several processes, an array sharded
over them is recorded as *pieces*: each process digests the shards it
writes (those with ``replica_id == 0``), the boxes they cover and their
digests are gathered to every process, and the primary writes them all into
the manifest.  A piece's digest is :func:`._digest.array_digests` of the
box's bytes, so a whole-array digest is the piece whose box is the array.

A restore checks every piece once, on any process count and mesh: a piece is
checked by the first process holding a shard that contains its box (read off
the sharding, which every process knows); pieces that no process holds whole
(the restore's shards split them, as when a checkpoint from one process is
restored onto several) are checked after gathering that array to the host,
one array at a time.  What any process found wrong is gathered (one small
exchange), so every process raises the same
:class:`~jax_session_state.errors.CheckpointError` and none returns a
half-checked state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_session_state.checkpoint import _processes
from jax_session_state.checkpoint._digest import array_digests
from jax_session_state.errors import CheckpointError

__all__ = ["expected", "gather_digests", "local_digests", "verify"]

Box = list[list[int]]
"""A region of an array: ``[start, stop)`` on each axis."""


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _inside(inner: Box, outer: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def local_digests(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """This process's digests: the pieces it writes of a global array, else the whole array."""
    views: dict[str, Any] = {}
    boxes: dict[str, list[tuple[str, Box]]] = {}
    for key, x in values.items():
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            shards = [s for s in x.addressable_shards if s.replica_id == 0]
            boxes[key] = [(f"{key}/{i}", _box(s.index, x.shape)) for i, s in enumerate(shards)]
            views.update((name, np.asarray(s.data)) for (name, _), s in zip(boxes[key], shards))
        else:
            views[key] = x
    digests = array_digests(views)
    return {
        key: {"pieces": [[box, digests[name]] for name, box in boxes[key]]}
        if key in boxes
        else {"digest": digests[key]}
        for key in values
    }


def gather_digests(
    entries: Mapping[str, dict[str, Any]], gathered: Sequence[Mapping[str, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """The manifest entries with the digests of every process's pieces (``gathered``: each one's :func:`local_digests`).

    Raises:
      CheckpointError: an array every process holds whole (numpy, or on one
        process's devices) is not the same on every process.
    """
    out = {}
    for key, entry in entries.items():
        mine = [process[key] for process in gathered]
        if "pieces" in mine[0]:
            pieces = {str(box): [box, digest] for process in mine for box, digest in process["pieces"]}
            out[key] = {**entry, "pieces": [pieces[k] for k in sorted(pieces)]}
            continue
        differing = sorted({process["digest"] for process in mine})
        if len(differing) > 1:
            which = [i for i, process in enumerate(mine) if process["digest"] != mine[0]["digest"]]
            raise CheckpointError(
                f"{entry['where']}: each of the {len(mine)} processes holds its own copy, and processes {which} "
                "hold other values than process 0; a checkpoint saved from several processes needs every copy "
                "equal (or the array placed on a mesh over all processes). Nothing was saved."
            )
        out[key] = {**entry, "digest": differing[0]}
    return out


Piece = tuple[str, Box, str]
"""An array's key, a box of it and the digest of the box's bytes."""


def expected(entries: Mapping[str, dict[str, Any]]) -> list[Piece]:
    """Every piece the manifest's ``entries`` record (raises KeyError / ValueError if malformed)."""
    jobs: list[Piece] = []
    for key, entry in entries.items():
        full = [[0, int(n)] for n in entry["shape"]]
        pieces = entry["pieces"] if "pieces" in entry else [[full, entry["digest"]]]
        for box, digest in pieces:
            if len(box) != len(full) or not isinstance(digest, str):
                raise ValueError(f"array {key}: the piece {box} does not fit shape {entry['shape']}")
            jobs.append((key, [[int(a), int(b)] for a, b in box], digest))
    return jobs


def verify(
    directory: Path, arrays: Mapping[str, Any], entries: Mapping[str, Any], jobs: list[Piece], steps: _processes.Steps
) -> None:
    """Checks every restored array against the pieces :func:`expected` found (collective: ``steps``' ``check``).

    A process whose read failed has told the others under both steps, so
    they raise at ``check`` (or at ``read``, which precedes the gathering of
    arrays no process holds whole).

    Raises:
      CheckpointError: on every process, naming the first array (and box) that does not match.
    """
    me, views, split = jax.process_index(), {}, []
    shards = {key: _shard_boxes(x) for key, x in arrays.items()}
    for j, (key, box, _) in enumerate(jobs):
        held = _first_holder(arrays[key], shards[key], box)
        if held is None:
            split.append(j)
        elif held[0] == me:
            views[str(j)] = _cut(*held[1:], box)
    if split:  # every process has read its arrays (or said why not) before any enters the device collective
        steps.step("read", lambda: None)
    for key in dict.fromkeys(jobs[j][0] for j in split):  # pieces this layout splits, one array at a time
        data = steps.within_timeout(f"gather {key}", lambda key=key: _processes.gather_to_host(arrays[key]))
        if _processes.is_primary():
            views.update((str(j), _cut(data, [0] * data.ndim, jobs[j][1])) for j in split if jobs[j][0] == key)

    def check() -> list[int]:
        digests = array_digests(views)
        return sorted(int(j) for j, digest in digests.items() if digest != jobs[int(j)][2])

    _, found = steps.step("check", check, share=lambda bad: [len(bad), bad[0] if bad else len(jobs)])
    found = np.asarray(found, np.int64).reshape(-1, 2)  # each piece is checked once, on one process
    if found[:, 0].any():
        key, box, _ = jobs[int(found[:, 1].min())]
        piece = "" if "pieces" not in entries[key] else f" (the piece {[tuple(b) for b in box]})"
        raise CheckpointError(
            f"{directory}: array {entries[key]['where']}{piece} does not match its digest: its files under "
            f"{directory / 'arrays'} are damaged ({int(found[:, 0].sum())} damaged piece(s) in all). Nothing was "
            "restored."
        )


def _shard_boxes(x: Any) -> list[tuple[int, int, Box]] | None:
    """Every shard of ``x`` as (process, device id, box), first process first; ``None`` if every process holds ``x``.

    Read off the sharding, so the same on every process without an exchange.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return None
    return sorted(
        (device.process_index, device.id, _box(index, x.shape))
        for device, index in x.sharding.devices_indices_map(x.shape).items()
    )


def _first_holder(x: Any, shards: list[tuple[int, int, Box]] | None, box: Box) -> tuple[int, Any, list[int]] | None:
    """The first process holding ``box`` of ``x`` in one shard, with its local data and the data's origin.

    An array every process holds whole (numpy, or on each process's own
    devices) is checked by the primary.  ``None`` where no shard holds the
    whole box.
    """
    if shards is None:
        return 0, x, [0] * len(box)
    holding = next((shard for shard in shards if _inside(box, shard[2])), None)
    if holding is None:
        return None
    process, device, where = holding
    if process != jax.process_index():
        return process, None, where
    data = next(s.data for s in x.addressable_shards if s.device.id == device)
    return process, data, [start for start, _ in where]


def _cut(data: Any, origin: list[int], box: Box) -> Any:
    """The bytes of ``box`` out of ``data``, whose first element is at ``origin`` of the whole array."""
    if [[0, n] for n in data.shape] == [[b0 - o, b1 - o] for (b0, b1), o in zip(box, origin)]:
        return data  # whole: a jax array is read to the host by array_digests, one at a time
    return np.asarray(data)[tuple(slice(b0 - o, b1 - o) for (b0, b1), o in zip(box, origin))]
