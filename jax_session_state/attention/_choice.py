"""Which reader reads a view here: the one place ``implementation=`` and the platform are turned into a reader.

Each view layout (``_append``, ``_ring``, ``_paged``) offers its readers
(the pure-JAX loop and buckets everywhere; the native CPU kernel and the
Pallas kernels where it has them) and :func:`by_platform` runs the one
that ``implementation`` and the platform pick; :func:`native_or` says
whether the native kernel takes the call, :func:`pallas_wanted` whether
a Pallas kernel does.  A new reader of a layout is one more keyword of
:func:`by_platform` given by that layout's module.
"""

from __future__ import annotations

import functools
from typing import Any

from jax import Array, lax

from jax_session_state._core import _library
from jax_session_state.attention import _native, _pallas, _pallas_tpu
from jax_session_state.errors import PayloadError


def use_native(q: Array, k: Array, v: Array, implementation: str, kv_heads: int | None = None,
               quantized: bool = False) -> bool:
    """Whether this call runs the native kernel (``"auto"`` where it takes the operands, or ``"native"``).

    Raises:
      PayloadError: ``"native"`` asked for operands the kernel on its path does not take.
    """
    if implementation not in ("auto", "native"):
        return False
    takes = _library.enabled() and _native.supports(q, k, v, kv_heads=kv_heads, quantized=quantized)
    if implementation == "native" and not takes:
        raise PayloadError(f"attend(implementation='native'): the kernel on its {_library.ISA} path does not take a "
                           f"{k.dtype} cache with q of shape {list(q.shape)} (see _native.supports).")
    return takes


def native_or(q: Array, k: Array, v: Array, implementation: str, kv_heads: int | None = None,
              quantized: bool = False) -> str:
    """``"native"`` where the native kernel reads this call (:func:`use_native`), else ``implementation``."""
    return "native" if use_native(q, k, v, implementation, kv_heads, quantized) else implementation


def pallas_wanted(implementation: str, k: Array, extent: int) -> bool:
    """Whether ``implementation`` reads a cache of ``k``'s keys in runs of ``extent`` through the Pallas kernel:
    ``"pallas"`` asked for, or ``"auto"`` (and ``"native"``, off CPU) where a CUDA GPU is attached (measured
    faster than buckets there, see BENCHMARKS.md), and a cache it reads (``_pallas.takes``).
    Otherwise buckets off CPU."""
    wanted = implementation == "pallas" or (implementation in ("auto", "native") and _pallas.gpu_attached())
    return wanted and _pallas.takes(k, extent)


def by_platform(implementation: str, loop: Any, bucketed: Any, *operands: Any, native: Any = None,
                pallas: Any = None) -> tuple[Array, Array]:
    """The reader ``implementation`` picks, run on ``operands``.

    ``"loop"`` and ``"bucketed"`` run everywhere; ``"pallas"`` runs
    ``pallas(*operands, interpret=...)`` where given (compiled on GPU,
    interpreted on CPU, on TPU with ``interpret=_pallas_tpu.TPU``: the
    Mosaic kernel; else ``bucketed``); otherwise (``"auto"``, ``"native"``)
    ``native`` where given (else ``loop``) runs on CPU, ``pallas`` compiled
    where given on CUDA (see :func:`pallas_wanted`), and ``bucketed`` (a
    handful of fused kernels) elsewhere.
    """
    if implementation in ("loop", "bucketed"):
        return (loop if implementation == "loop" else bucketed)(*operands)
    branches = {"cpu": loop if native is None else native}
    if pallas is not None:
        compiled = functools.partial(pallas, interpret=False)
        branches["cuda"] = compiled
        if implementation == "pallas":
            branches.update(cpu=functools.partial(pallas, interpret=True), rocm=compiled,
                            tpu=functools.partial(_tpu_or_bucketed, pallas, bucketed))
    elif implementation == "pallas":
        return bucketed(*operands)
    return lax.platform_dependent(*operands, default=bucketed, **branches)


def _tpu_or_bucketed(pallas: Any, bucketed: Any, *operands: Any) -> tuple[Array, Array]:
    """On TPU: ``pallas`` with the Mosaic kernel (``_pallas_tpu``), or ``bucketed`` where its tiling does not take
    the cache (the reader raises :class:`_pallas_tpu.Untileable` before tracing anything)."""
    try:
        return pallas(*operands, interpret=_pallas_tpu.TPU)
    except _pallas_tpu.Untileable:
        return bucketed(*operands)


def tpu_kernel(interpret: Any) -> bool:
    """Whether a Pallas reader given ``interpret`` runs the TPU kernel (``_pallas_tpu``): compiled on TPU, or
    interpreted on CPU where the tests ask for it (``_pallas_tpu.ON_CPU``)."""
    return interpret is _pallas_tpu.TPU or (interpret is True and _pallas_tpu.ON_CPU)
