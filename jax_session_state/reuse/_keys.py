"""Content keys: host-side hashes of what produced a piece of state.

A key is a BLAKE2b digest over the caller's identity string (model, encoder,
version) and the dtype, shape and bytes of every part, so equal inputs to the
same encoder give the same key in any process, and a change of dtype, shape,
byte or identity gives another.  Paged prefixes use chained per-page keys: page
``i``'s key hashes page ``i - 1``'s key and page ``i``'s tokens, so it covers
every token up to the end of page ``i`` (vLLM's prefix caching does the same).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from jax_session_state.errors import PayloadError, PayloadTypeError

__all__ = ["content_key", "page_keys"]

_PERSON = b"jss-content-v1"  # bumps every key if the encoding below ever changes


def _check_identity(owner: str, identity: Any) -> bytes:
    if not isinstance(identity, str) or not identity:
        raise PayloadTypeError(
            f"{owner}: identity must be a non-empty str naming the model / encoder that produced the state "
            f"(e.g. 'text-encoder@v3'); got {identity!r}."
        )
    return identity.encode()


def _feed(digest: Any, part: Any) -> None:
    """Adds one part: a str, bytes, or anything numpy reads as an array (its dtype, shape, bytes)."""
    if isinstance(part, str):
        data, tag = part.encode(), b"s"
    elif isinstance(part, (bytes, bytearray, memoryview)):
        data, tag = bytes(part), b"b"
    else:
        array = np.ascontiguousarray(np.asarray(part))
        if array.dtype == object:
            raise PayloadTypeError(f"content_key: a part must be a str, bytes or an array; got {type(part).__name__}.")
        tag = f"a{array.dtype.str}{array.shape}".encode()
        data = array.tobytes()
    digest.update(len(tag).to_bytes(8, "little") + tag)
    digest.update(len(data).to_bytes(8, "little") + data)


def content_key(*parts: Any, identity: str) -> str:
    """The content key of ``parts`` as produced by ``identity``: a 32-character hex digest.

    Args:
      *parts: what produced the state: prompt tokens, conditioning bytes,
        arrays (jax or numpy: their dtype, shape and bytes count), strs.
      identity: the model / encoder that turns ``parts`` into state, with its
        version; two encoders never share a key.

    Returns:
      A stable hex string (the same in every process and run).

    Raises:
      PayloadTypeError: ``identity`` is not a non-empty str, or a part is not
        a str, bytes or an array.

    Example:
      >>> import numpy as np
      >>> from jax_session_state.reuse import content_key
      >>> tokens = np.arange(6, dtype=np.int32)
      >>> content_key(tokens, identity="enc@1") == content_key(tokens.copy(), identity="enc@1")
      True
      >>> content_key(tokens, identity="enc@1") == content_key(tokens, identity="enc@2")
      False
      >>> content_key(tokens, identity="enc@1") == content_key(tokens.astype(np.int64), identity="enc@1")
      False
    """
    digest = hashlib.blake2b(_check_identity("content_key", identity), digest_size=16, person=_PERSON)
    for part in parts:
        _feed(digest, part)
    return digest.hexdigest()


def page_keys(tokens: Any, *, page_size: int, identity: str) -> list[str]:
    """Chained keys of the full pages of ``tokens``: key ``i`` covers tokens ``[0, (i + 1) * page_size)``.

    A partial last page has no key (it is never shared).  Two prompts share
    key ``i`` exactly when they agree on every token up to the end of page
    ``i``, so a shared prefix is found page by page and a divergent suffix
    is not.

    Args:
      tokens: ``Int[Array, "T"]`` (or anything numpy reads as a 1-D integer array).
      page_size: tokens per page.
      identity: the model whose K/V the pages hold.

    Returns:
      ``T // page_size`` hex keys.

    Raises:
      PayloadError: ``tokens`` is not 1-D or ``page_size`` is below 1.
      PayloadTypeError: ``identity`` is not a non-empty str, or ``tokens`` not integers.

    Example:
      >>> import numpy as np
      >>> from jax_session_state.reuse import page_keys
      >>> a = page_keys(np.array([1, 2, 3, 4, 5, 6, 7]), page_size=2, identity="lm@1")
      >>> b = page_keys(np.array([1, 2, 3, 9, 5, 6]), page_size=2, identity="lm@1")
      >>> len(a), [x == y for x, y in zip(a, b)]  # pages 1 and 2 differ: page 1 holds the 9
      (3, [True, False, False])
    """
    seed = _check_identity("page_keys", identity)
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise PayloadError(f"page_keys: tokens must be 1-D (one sequence); got shape {list(array.shape)}.")
    if not np.issubdtype(array.dtype, np.integer):
        raise PayloadTypeError(f"page_keys: tokens must be integers; got dtype {array.dtype}.")
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise PayloadError(f"page_keys: page_size must be an int >= 1; got {page_size!r}.")
    array = array.astype(np.int64)  # the key does not depend on the token dtype
    keys, previous = [], b""
    for start in range(0, len(array) - page_size + 1, page_size):
        digest = hashlib.blake2b(seed, digest_size=16, person=_PERSON)
        digest.update(previous)
        digest.update(array[start:start + page_size].tobytes())
        previous = digest.digest()
        keys.append(previous.hex())
    return keys
