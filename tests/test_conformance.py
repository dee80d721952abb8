"""Every kind passes the public conformance suite."""

import pytest

from jax_session_state.testing import CHECKS, Conformance
from tests.support.kinds import KINDS


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_conformance(kind, check):
    make, payload = KINDS[kind]
    getattr(Conformance(make=make, payload=payload), check)()
