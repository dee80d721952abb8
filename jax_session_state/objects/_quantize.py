"""Symmetric per-row quantization of K/V: the storage of the demoted (int8, fp8) tiers.

Each row of ``head_dim`` values (one token of one head) is stored as int8
(or ``float8_e4m3fn``) times one float32 scale, ``x ~= q * scale`` with
``scale = max|x| / Q`` (``Q`` = 127 for int8, 448 for fp8).  The error
bound: an int8 value is off by at most ``scale / 2 = max|x| / 254`` (half a
step), so each entry of a row is within ``0.4%`` of the row's largest
magnitude.  fp8 keeps 3 mantissa bits, a relative error of at most ``2**-4``
per entry, down to float8's smallest normal number: an entry below
``max|x| * 2**-6 / 448`` is a float8 subnormal, off by at most half its step,
``max|x| / (448 * 2**10)``.  So each fp8 entry is within ``2**-4`` of itself
relative or ``max|x| / (448 * 2**10)`` absolute, whichever is larger.
Attention over such K/V stays within about 1e-2 relative of the float32
result on normal data (``benchmarks/tiers.py`` measures the distribution).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array

from jax_session_state.errors import NotDemotableError, PayloadError, PayloadTypeError

__all__ = ["FORMATS", "check_args", "demoted", "dequantize", "no_lower_tier", "quantize", "storage_dtype"]

FORMATS = ("int8", "fp8")
"""The quantized storage formats, lowest precision last."""

_LARGEST = {"int8": 127.0, "fp8": 448.0}


def storage_dtype(quantize: str) -> np.dtype:
    """The dtype of the stored values of a format."""
    return np.dtype(jnp.int8) if quantize == "int8" else np.dtype(jnp.float8_e4m3fn)


def quantize(x: Array, quantize: str) -> tuple[Array, Array]:
    """``x: [..., head_dim]`` as (values ``[..., head_dim]``, scales ``Float[Array, "... 1"]``)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / _LARGEST[quantize]
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero row: any scale, values 0
    scaled = x / scale
    if quantize == "int8":
        return jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8), scale
    return scaled.astype(jnp.float8_e4m3fn), scale


def dequantize(values: Array, scale: Array | None, dtype: Array | np.dtype = jnp.float32) -> Array:
    """``values * scale`` in ``dtype`` (``values`` as they are when ``scale`` is None)."""
    if scale is None:
        return values
    return (values.astype(jnp.float32) * scale).astype(dtype)


def check_args(owner: str, dtype: np.dtype, quantize: str | None, tiers: Any) -> tuple[str | None, tuple[str, ...]]:
    """Checks the ``quantize=`` and ``tiers=`` of a K/V cache whose payloads are ``dtype``; returns them normalised."""
    if isinstance(tiers, str):
        tiers = (tiers,)
    tiers = tuple(tiers)
    for name in (quantize, *tiers):
        if name is not None and name not in FORMATS:
            raise PayloadError(f"{owner}: quantize / tiers name a format in {FORMATS}; got {name!r}.")
    if (quantize or tiers) and not jnp.issubdtype(dtype, jnp.floating):
        raise PayloadTypeError(f"{owner}: only a floating-point cache can be quantized; dtype is {dtype.name}.")
    if quantize is not None and tiers:
        raise PayloadError(f"{owner}: a cache quantized to {quantize} has no lower tier; got tiers={tiers}.")
    if len(set(tiers)) != len(tiers):
        raise PayloadError(f"{owner}: tiers must not repeat a format; got {tiers}.")
    return quantize, tiers


def demoted(obj: Any, pairs: tuple[tuple[str, str], ...]) -> Any:
    """A K/V cache's next lower tier: each ``(values, scales)`` pair of storage fields requantized to ``tiers[0]``.

    ``obj`` has static ``quantize`` and ``tiers`` fields (a float cache has
    None scales); everything else it holds is kept as it is.

    Raises:
      NotDemotableError: ``obj`` declares no (further) tier.
    """
    obj._require_resident("demote")
    if not obj.tiers:
        raise no_lower_tier(obj.describe())
    target, storage = obj.tiers[0], {}
    for values, scales in pairs:
        storage[values], storage[scales] = quantize(dequantize(getattr(obj, values), getattr(obj, scales)), target)
    return obj.replace(quantize=target, tiers=obj.tiers[1:], **dict.fromkeys(storage)).with_storage(**storage)


def no_lower_tier(described: str) -> NotDemotableError:
    """The error of ``demote()`` on a K/V cache (``described``) that declares no further tier."""
    return NotDemotableError(
        f"{described} has no lower tier to demote to: allocate it with tiers=(\"int8\",) "
        "to let it be quantized when memory is short."
    )
