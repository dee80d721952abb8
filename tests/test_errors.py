"""The error types: each is a SessionStateError and the standard exception that fits it."""

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
