"""The native CPU library: loaded once, its instruction-set path chosen, its XLA FFI targets registered.

``csrc/decode_attention.cc``, ``csrc/write_rows.cc``, ``csrc/owned_copy.cc``
and ``csrc/crc32.cc`` (for :mod:`._crc32`) are compiled at install time into
the shared library ``_decode_attention`` next to this module.  The build is
optional: without a C++ compiler the install still succeeds, attention stays
pure JAX and checkpoints checksum with zlib.  At import the library, when
present, is loaded and its handlers (decode attention over a head-major
cache or a paged one, plain or quantized, the row writer of :mod:`._writes`,
and the copy of :func:`owned_copy`) are registered as XLA FFI targets for
the ``"cpu"`` platform; attention
(:mod:`jax_session_state.attention._native`) and the bfloat16 / float8
writes call them through ``lax.platform_dependent``, so GPU and TPU lowering
never see them.  ``JSS_NATIVE_ATTENTION=0`` in the environment leaves them
unregistered.

The library holds the kernels once per instruction set (``baseline``
x86-64, ``avx2`` = x86-64-v3 with FMA, ``avx512`` = x86-64-v4) and uses the
best one the CPU runs; ``JSS_NATIVE_ISA=baseline|avx2|avx512`` forces one
(an error at import where the CPU lacks it).

Example:
  >>> from jax_session_state._core import _library
  >>> isinstance(_library.AVAILABLE, bool) and isinstance(_library.STATUS, str)
  True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = ["AVAILABLE", "ISA", "ISAS", "LIBRARY", "STATUS", "enabled", "owned_copy", "status", "use", "write_rows"]

TARGET = "jax_session_state_decode_attention"
PAGED_TARGET = "jax_session_state_paged_decode_attention"
QUANTIZED_TARGET = "jax_session_state_quantized_decode_attention"
QUANTIZED_PAGED_TARGET = "jax_session_state_quantized_paged_decode_attention"
RING_TARGET = "jax_session_state_ring_decode_attention"
QUANTIZED_RING_TARGET = "jax_session_state_quantized_ring_decode_attention"
WRITE_TARGET = "jax_session_state_write_rows"
OWNED_COPY_TARGET = "jax_session_state_owned_copy"
ENV_SWITCH = "JSS_NATIVE_ATTENTION"
ENV_ISA = "JSS_NATIVE_ISA"


def _select_isa(library: ctypes.CDLL) -> tuple[dict[str, bool], str]:
    """The library's instruction-set paths (name -> whether this CPU runs it), and the one selected.

    Raises:
      RuntimeError: ``JSS_NATIVE_ISA`` names an unknown path or one this CPU lacks.
    """
    library.JssIsaName.restype = library.JssCurrentIsa.restype = ctypes.c_char_p
    names = [library.JssIsaName(i).decode() for i in range(library.JssIsaCount())]
    paths = {name: bool(library.JssIsaSupported(i)) for i, name in enumerate(names)}
    wanted = os.environ.get(ENV_ISA, "")
    if wanted:
        if wanted not in paths:
            raise RuntimeError(f"{ENV_ISA}={wanted!r}: the native attention kernel has the paths {names}.")
        if not paths[wanted]:
            runs = [name for name, ok in paths.items() if ok]
            raise RuntimeError(f"{ENV_ISA}={wanted!r}: this CPU lacks the instructions of that path; it runs {runs}.")
        library.JssSelectIsa(names.index(wanted))
    return paths, library.JssCurrentIsa().decode()


def _load() -> tuple[bool, str, dict[str, bool], str | None, ctypes.CDLL | None]:
    """Registers the FFI targets; returns whether they are available and why (not), the ISA paths, the one used
    and the library."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False, f"disabled by {ENV_SWITCH}=0", {}, None, None
    here = Path(__file__).parent
    found = [here / f"_decode_attention{s}" for s in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((path for path in found if path.exists()), None)
    if path is None:
        return False, "the extension _decode_attention was not built (no C++ compiler at install time?)", {}, None, None
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
        handlers = (library.JssDecodeAttention, library.JssPagedDecodeAttention, library.JssQuantizedDecodeAttention,
                    library.JssQuantizedPagedDecodeAttention, library.JssRingDecodeAttention,
                    library.JssQuantizedRingDecodeAttention, library.JssWriteRows, library.JssOwnedCopy)
    except (OSError, AttributeError) as error:
        return False, f"{path.name} could not be loaded: {error}", {}, None, None
    paths, isa = _select_isa(library)
    targets = (TARGET, PAGED_TARGET, QUANTIZED_TARGET, QUANTIZED_PAGED_TARGET, RING_TARGET, QUANTIZED_RING_TARGET,
               WRITE_TARGET, OWNED_COPY_TARGET)
    for target, handler in zip(targets, handlers):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    how = f"forced by {ENV_ISA}" if os.environ.get(ENV_ISA) else "the best this CPU runs"
    return True, f"{path.name}, {isa} path ({how})", paths, isa, library


AVAILABLE, STATUS, ISAS, ISA, LIBRARY = _load()
"""Whether the native kernel is registered and a line saying why (not); its
instruction-set paths (name -> whether this CPU runs it), the one in use, and
the loaded library (for its plain C functions, :mod:`._crc32`)."""

_use_native = AVAILABLE


def enabled() -> bool:
    """Whether functions traced now call the native kernels on CPU: ``attend``, and bfloat16 / float8 writes.

    Never where the CPU backend has several devices: the FFI call has no
    partitioning rule, so XLA would gather a sharded cache onto every device
    to call it; there the pure loop runs, which partitions like any XLA op.
    """
    return _use_native and _one_cpu_device()


@functools.cache
def _cpu_devices() -> int:
    try:
        return len(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU backend out: nothing runs there
        return 0


def _one_cpu_device() -> bool:
    return _cpu_devices() == 1


def status() -> str:
    """Whether functions traced now call the native kernel on CPU, and why (not)."""
    if not AVAILABLE:
        return f"pure JAX: {STATUS}"
    if not _one_cpu_device():
        return f"pure JAX: {_cpu_devices()} CPU devices (the kernel has no partitioning rule)"
    if not _use_native:
        return "pure JAX: turned off by _library.use(False)"
    return f"native kernel ({ISA}): {STATUS}"


@contextlib.contextmanager
def use(native: bool) -> Iterator[None]:
    """Within the block, functions traced call the native kernels on CPU (attention, row writes) or not.

    Functions jitted before keep what they were traced with (clear them, e.g.
    ``jax.clear_caches()``, to retrace).

    Raises:
      RuntimeError: ``native`` is True but the kernel is not available.
    """
    global _use_native
    if native and not AVAILABLE:
        raise RuntimeError(f"the native attention kernel is not available: {STATUS}")
    before, _use_native = _use_native, native
    try:
        yield
    finally:
        _use_native = before


def write_rows(buffer: Array, slots: Array, rows: Array, *, axis: int) -> Array:
    """``buffer`` with ``rows`` written at ``slots`` along ``axis``, by the native row writer, in place.

    Operands as :func:`jax_session_state._core._writes.scatter_rows` (a slot
    outside ``[0, S)`` drops its row); the result aliases ``buffer``, so a
    donated buffer is written where it lies and only the rows' bytes move.
    Under ``jax.vmap`` every operand gets the mapped axis first.
    """
    call = jax.ffi.ffi_call(WRITE_TARGET, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                            input_output_aliases={0: 0}, vmap_method="broadcast_all")
    return call(buffer, slots.astype(jnp.int32), rows, tail_rank=np.int64(buffer.ndim - 1 - axis))


@jax.jit
def owned_copy(x: Array) -> Array:
    """``x`` (on one CPU device) copied by the native library into a buffer XLA allocated for the result.

    The buffer is the runtime's, so a donated step reuses it, and the library
    asks Linux to back its whole 2 MiB pages by huge pages before writing it:
    XLA:CPU's fresh buffers otherwise fault in 4 KiB pages as they are first
    written (``csrc/owned_copy.cc``), which made a copy from the host into
    one several times slower.  Needs :data:`AVAILABLE`.
    """
    return jax.ffi.ffi_call(OWNED_COPY_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
