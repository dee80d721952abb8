"""Digests of checkpointed arrays and manifests, so a restore refuses damage.

An array's digest covers its dtype, its shape and every byte of the whole
array in row-major (C) order, whatever pieces it is held in: a checkpoint
saved on 8 devices checks on 1.  The bytes are checked as a two-level tree:
each ``CHUNK`` bytes by CRC-32 (the storage checksum of zip, gzip and
Zarr's ``crc32c`` codec), then the dtype, shape and every chunk's checksum,
in order, by BLAKE2b.  CRC-32 finds every change of up to 32 consecutive
bits in a chunk (so every flipped byte and every changed value) and any
other damage, a swap or a shift included, but for one chance in 2**32; it
reads several times faster than BLAKE2b by carry-less multiplication
(:mod:`jax_session_state._core._crc32`, zlib's where the CPU has none),
which keeps a verified restore close to an unverified one (BENCHMARKS.md).
The chunks of all arrays are checked on every core at once: the CRC
releases the GIL.

A manifest's digest is BLAKE2b over its JSON text in one canonical form
(keys in the order they were written, no whitespace), so a manifest that
parses to anything else than what was written no longer matches.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jax_session_state._core._crc32 import crc32

__all__ = ["CHUNK", "array_digests", "manifest_digest"]

CHUNK = 1 << 20
"""Bytes checked by one CRC-32, a leaf of an array's digest tree."""

_SIZE = 32  # bytes of a BLAKE2b-256 root digest


def _header_and_bytes(x: Any) -> tuple[bytes, np.ndarray]:
    """What the digest covers: dtype and shape, and the whole array's bytes in row-major order.

    A jax array on one CPU device is read in place; a sharded array or one
    on an accelerator is gathered to the host (one array at a time).
    """
    data = np.ascontiguousarray(np.asarray(x))
    return f"{data.dtype.name}{data.shape}".encode(), data.reshape(-1).view(np.uint8)


def _leaf(chunk: np.ndarray) -> bytes:
    return crc32(chunk).to_bytes(4, "little")


def _read_in_place(x: Any) -> bool:
    """Whether ``x``'s bytes are read without a copy (numpy, or a jax array on one CPU device)."""
    if not isinstance(x, jax.Array):
        return True
    devices = x.sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def array_digests(arrays: Mapping[str, Any]) -> dict[str, str]:
    """The hex digest of every array (jax, numpy or numpy scalar; not typed keys), by key.

    Arrays read in place are hashed all at once; an array that must be
    gathered to the host is hashed before the next is gathered, so at most
    one host copy exists at a time.
    """
    workers = min(os.cpu_count() or 1, 16)
    chunks: dict[str, tuple[bytes, list[concurrent.futures.Future[bytes]]]] = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for key, x in arrays.items():
            header, data = _header_and_bytes(x)
            chunks[key] = header, [pool.submit(_leaf, data[i : i + CHUNK]) for i in range(0, max(data.size, 1), CHUNK)]
            if not _read_in_place(x):
                concurrent.futures.wait(chunks[key][1])
            del data
        out = {}
        for key, (header, futures) in chunks.items():
            root = hashlib.blake2b(header, digest_size=_SIZE, person=b"jss-array")
            for future in futures:
                root.update(future.result())
            out[key] = root.hexdigest()
    return out


def canonical_json(record: Any) -> str:
    """``record`` as JSON in the one form its digest is taken of."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=True)


def manifest_digest(record: Any) -> str:
    """The hex digest of a manifest (without its own ``digest`` entry)."""
    return hashlib.blake2b(canonical_json(record).encode(), digest_size=_SIZE, person=b"jss-manifest").hexdigest()
