"""CRC-32 exactly as ``zlib.crc32`` computes it, several times faster where the CPU multiplies carry-less.

A verified restore checks every byte it reads against CRC-32s
(:mod:`jax_session_state.checkpoint._digest`).  zlib's CRC is
table-driven; the native library's (``csrc/crc32.cc``) folds 64 bytes at a
time with PCLMULQDQ, with the same values (BENCHMARKS.md, the digest rows).  It is used where the library is loaded on
any instruction-set path but ``baseline`` (plain x86-64 has no carry-less
multiply) and the CPU has PCLMULQDQ and SSE4.1; elsewhere, and under
``JSS_NATIVE_ISA=baseline`` or ``JSS_NATIVE_ATTENTION=0``, zlib computes it.
Either way the call releases the GIL, so threads checksum in parallel.

Example:
  >>> import zlib
  >>> import numpy as np
  >>> from jax_session_state._core import _crc32
  >>> data = np.frombuffer(b"session state" * 100, np.uint8)
  >>> _crc32.crc32(data) == zlib.crc32(data) and _crc32.PATH in ("pclmul", "zlib")
  True
"""

from __future__ import annotations

import ctypes
import zlib
from typing import Any

import numpy as np

from jax_session_state._core import _library

__all__ = ["PATH", "crc32"]


def _native() -> Any:
    """The library's ``JssCrc32`` where it folds on this CPU and path, else ``None``."""
    library = _library.LIBRARY
    if library is None or _library.ISA == "baseline" or not library.JssCrc32Supported():
        return None
    function = library.JssCrc32
    function.restype = ctypes.c_uint32
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32)
    return function


_NATIVE = _native()

PATH = "zlib" if _NATIVE is None else "pclmul"
"""Which computes :func:`crc32` here: ``"pclmul"`` (the native library) or ``"zlib"``."""


def crc32(data: np.ndarray, value: int = 0) -> int:
    """``zlib.crc32(data, value)`` of a one-dimensional, contiguous ``uint8`` array.

    Args:
      data: the bytes, ``uint8[n]``, C-contiguous.
      value: the CRC of the bytes before ``data`` (0 to start).

    Raises:
      ValueError: ``data`` is not a contiguous one-dimensional uint8 array.
    """
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"crc32 takes contiguous uint8[n] bytes; got {data.dtype}{list(data.shape)}.")
    if _NATIVE is None:
        return zlib.crc32(data, value)
    return int(_NATIVE(data.ctypes.data, data.size, value))
