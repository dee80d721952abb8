"""The exception types of ``jax_session_state``.

Every error subclasses :class:`SessionStateError` (catch-all) and the standard
exception that fits it, so ``except ValueError`` or ``except RuntimeError``
keeps working in code that does not know this library.  Messages say what
happened, to which object or session, and what the caller can do.

Example:
  >>> import jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=2)
  >>> try:
  ...     kv.append((jnp.ones((1, 3, 1, 2)),) * 2)
  ... except jss.CapacityError as error:  # also a RuntimeError and a SessionStateError
  ...     print(type(error).__name__, isinstance(error, RuntimeError))
  CapacityError True
"""

from __future__ import annotations

__all__ = [
      "SessionStateError",
      "CapacityError",
      "NotResidentError",
      "NotEvictableError",
      "RecomputeGraphError",
      "BudgetExceededError",
      "SessionAdmissionError",
      "SessionStateLostError",
      "SessionCheckedOutError",
      "CheckpointError",
      "PayloadError",
      "PayloadTypeError",
      "DonatedError",
      "NotDemotableError",
]


class SessionStateError(Exception):
    """Base class of every error raised by ``jax_session_state``."""


class CapacityError(SessionStateError, RuntimeError):
    """A write did not fit the object's capacity; nothing was written.

    Raised at once outside ``jit``.  Inside ``jit`` the object's ``overflowed``
    flag is set instead and :func:`jax_session_state.check` raises this error.
    """


class NotResidentError(SessionStateError, RuntimeError):
    """An evicted or reset object was read or written."""


class DonatedError(NotResidentError):
    """An object whose arrays were donated to a jitted call was used again.

    Donation hands the buffers to the call's output and deletes the input's
    arrays; use the output instead (or ``fork()`` before donating).
    """


class PayloadError(SessionStateError, ValueError):
    """A payload (or an argument) has the wrong shape or value; nothing was written.

    Raised at trace time, naming the object, what it expected and what came.
    """


class PayloadTypeError(SessionStateError, TypeError):
    """A payload (or an argument) has the wrong structure, type or dtype; nothing was written."""


class NotEvictableError(SessionStateError, RuntimeError):
    """``evict()`` was called on an object that may never be dropped."""


class NotDemotableError(SessionStateError, RuntimeError):
    """``demote()`` was called on an object that declares no lower tier."""


class RecomputeGraphError(SessionStateError, ValueError):
    """A recompute source names a missing object, or the sources form a cycle."""


class BudgetExceededError(SessionStateError, RuntimeError):
    """A put or create would exceed a byte budget and nothing could be freed."""


class SessionAdmissionError(SessionStateError, RuntimeError):
    """The manager is full and may not evict to admit another session."""


class SessionStateLostError(SessionStateError, LookupError):
    """The session is unknown, was dropped, or was preempted.

    Raised instead of silently handing back an empty session.
    """


class SessionCheckedOutError(SessionStateError, RuntimeError):
    """The session is checked out into a pool slot; the manager does not hold it until ``checkin``."""


class CheckpointError(SessionStateError, ValueError):
    """A checkpoint could not be restored, or a state could not be saved.

    Restoring raises it when there is no checkpoint, when it has another
    format version, when its files are damaged, or when it does not match the
    target; nothing is half-restored.
    """
