"""The error types: each is a SessionStateError and the standard exception that fits it."""

import jax
import pytest

import jax_session_state as jss
from jax_session_state import errors

PARENTS = {
    "CapacityError": RuntimeError,
    "NotResidentError": RuntimeError,
    "DonatedError": RuntimeError,
    "NotEvictableError": RuntimeError,
    "NotDemotableError": RuntimeError,
    "BudgetExceededError": RuntimeError,
    "SessionAdmissionError": RuntimeError,
    "SessionCheckedOutError": RuntimeError,
    "ProcessDisagreementError": RuntimeError,
    "RecomputeGraphError": ValueError,
    "PayloadError": ValueError,
    "CheckpointError": ValueError,
    "PayloadTypeError": TypeError,
    "SessionStateLostError": LookupError,
}


def test_every_error_is_listed():
    assert set(errors.__all__) == {"SessionStateError", *PARENTS}


@pytest.mark.parametrize("name", sorted(PARENTS))
def test_error_subclasses_the_library_base_and_its_standard_type(name):
    error_type = getattr(errors, name)
    assert getattr(jss, name) is error_type, f"jss.{name} is not the one of jax_session_state.errors"
    assert issubclass(error_type, errors.SessionStateError)
    assert issubclass(error_type, PARENTS[name])
    try:
        raise error_type(f"{name} raised")
    except PARENTS[name] as caught:  # code unaware of the library catches it by its standard type
        assert str(caught) == f"{name} raised"


def test_check_under_jit_is_refused():
    """jss.check reads overflow flags on the host: under jit they are tracers, and it says to call it outside."""
    session = jss.Session(objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=2)})
    with pytest.raises(jss.PayloadTypeError, match=r"check\(\) reads overflow flags; call it outside jit"):
        jax.jit(jss.check)(session)
    jss.check(session)  # outside jit, nothing flagged: no error
