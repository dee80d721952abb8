"""Content keys are stable, cover identity, dtype, shape and bytes, and chain page by page."""

from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_session_state as jss
from jax_session_state.reuse import content_key, page_keys


def test_content_key_is_stable_and_covers_every_part():
    tokens = np.arange(12, dtype=np.int32)
    key = content_key(tokens, b"scene", "prompt", identity="enc@1")
    assert key == content_key(jnp.asarray(tokens), b"scene", "prompt", identity="enc@1")  # jax or numpy
    assert len(key) == 32 and int(key, 16) >= 0
    others = [
        content_key(tokens, b"scene", "prompt", identity="enc@2"),
        content_key(tokens.astype(np.int64), b"scene", "prompt", identity="enc@1"),
        content_key(tokens.reshape(3, 4), b"scene", "prompt", identity="enc@1"),
        content_key(tokens[::-1].copy(), b"scene", "prompt", identity="enc@1"),
        content_key(tokens, b"scenf", "prompt", identity="enc@1"),
        content_key(tokens, b"scene", identity="enc@1"),
        content_key(tokens, "scene", "prompt", identity="enc@1"),  # str and bytes differ
    ]
    assert len({key, *others}) == len(others) + 1


def test_keys_refuse_bad_identity_and_parts():
    with pytest.raises(jss.PayloadTypeError, match="identity"):
        content_key([1], identity="")
    with pytest.raises(jss.PayloadTypeError, match="part"):
        content_key(object(), identity="x")
    with pytest.raises(jss.PayloadError, match="1-D"):
        page_keys(np.zeros((2, 2), np.int32), page_size=2, identity="x")
    with pytest.raises(jss.PayloadError, match="page_size"):
        page_keys(np.zeros(4, np.int32), page_size=0, identity="x")


def _reference_page_keys(tokens: list[int], page_size: int, identity: str) -> list[str]:
    """Page i's key, written independently: a hash of the identity and every token up to page i's end."""
    out = []
    for end in range(page_size, len(tokens) + 1, page_size):
        out.append(hashlib.sha256(repr((identity, tokens[:end])).encode()).hexdigest())
    return out


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), max_size=14),
    b=st.lists(st.integers(0, 3), max_size=14),
    page_size=st.integers(1, 4),
)
def test_page_keys_match_exactly_where_the_prefix_up_to_the_page_end_matches(a, b, page_size):
    ka, kb = (page_keys(np.asarray(x, np.int32), page_size=page_size, identity="lm") for x in (a, b))
    ra, rb = (_reference_page_keys(x, page_size, "lm") for x in (a, b))
    assert len(ka) == len(a) // page_size
    assert [x == y for x, y in zip(ka, kb)] == [x == y for x, y in zip(ra, rb)]
    assert page_keys(np.asarray(a, np.int64), page_size=page_size, identity="lm") == ka  # token dtype: no matter
