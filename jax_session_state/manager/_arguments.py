"""Checks of what callers hand the session manager, made before anything changes.

Each check raises the library's error naming the argument, what it expects
and what came (:class:`~jax_session_state.errors.PayloadTypeError` for a
value of the wrong type, :class:`~jax_session_state.errors.PayloadError` for
one out of range).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

from jax_session_state._core._placement import is_donated
from jax_session_state._core._validation import non_negative, positive_int
from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.session import Session

OWNER = "SessionStateManager"


def manager_settings(
    *,
    max_sessions: Any,
    byte_budget: Mapping[str, int] | None,
    evict_when_full: Any,
    park_memory_kind: Any,
    host_budget: Any,
    on_event: Any,
    agreement_timeout: Any,
) -> dict[str, Any]:
    """The constructor's settings, checked (``byte_budget`` as a dict, None as empty).

    Raises:
      PayloadTypeError: ``max_sessions``, a ``byte_budget`` value or
        ``host_budget`` is not an int, a ``byte_budget`` key not a str,
        ``evict_when_full`` not a bool, ``on_event`` neither callable nor
        None, or ``agreement_timeout`` not a number.
      PayloadError: ``max_sessions`` is below 1, a budget below 0,
        ``park_memory_kind`` neither ``"pinned_host"`` nor None, or
        ``agreement_timeout`` below 0 or not finite.
    """
    budgets = {}
    for key, nbytes in dict(byte_budget or {}).items():
        if not isinstance(key, str):
            raise PayloadTypeError(
                f"{OWNER}: byte_budget is keyed by device keys ('cpu:0', 'cuda:0', "
                f"'cuda:0/pinned_host'); got the key {key!r}."
            )
        budgets[key] = positive_int(OWNER, f"byte_budget[{key!r}]", nbytes, minimum=0)
    if not isinstance(evict_when_full, bool):
        raise PayloadTypeError(f"{OWNER}: evict_when_full must be True or False; got {evict_when_full!r}.")
    if park_memory_kind not in ("pinned_host", None):
        raise PayloadError(f"{OWNER}: park_memory_kind is 'pinned_host' or None; got {park_memory_kind!r}.")
    if on_event is not None and not callable(on_event):
        raise PayloadTypeError(
            f"{OWNER}: on_event must be callable (it is called with each ManagerEvent) or None; "
            f"got {type(on_event).__name__} {on_event!r}."
        )
    if not math.isfinite(non_negative(OWNER, "agreement_timeout", agreement_timeout)):
        raise PayloadError(f"{OWNER}: agreement_timeout must be a finite number of seconds; got {agreement_timeout!r}.")
    return {
        "max_sessions": positive_int(OWNER, "max_sessions", max_sessions),
        "byte_budget": budgets,
        "evict_when_full": evict_when_full,
        "park_memory_kind": park_memory_kind,
        "host_budget": None if host_budget is None else positive_int(OWNER, "host_budget", host_budget, minimum=0),
        "on_event": on_event,
        "agreement_timeout": float(agreement_timeout),
    }


def recompute_arguments(name: Any, fn: Any, cost: Any) -> None:
    """Checks ``register_recompute(name, fn, cost=cost)``.

    Raises:
      PayloadTypeError: ``name`` is not a str, ``fn`` not callable, or
        ``cost`` neither a number nor None.
      PayloadError: ``name`` is empty, or ``cost`` below 0 (or NaN).
    """
    if not isinstance(name, str):
        raise PayloadTypeError(
            f"register_recompute(name, fn): name must be an object name (a str); got {type(name).__name__} {name!r}."
        )
    if not name:
        raise PayloadError("register_recompute(name, fn): name must be an object name; got the empty string.")
    if not callable(fn):
        raise PayloadTypeError(f"register_recompute({name!r}, fn): fn must be callable; got {type(fn).__name__}.")
    if cost is not None:
        non_negative(f"register_recompute({name!r})", "cost", cost)


def checked_session(session: Any, operation: str, session_id: Hashable) -> Session:
    """``session`` when the manager may store it: a :class:`Session` whose arrays are alive.

    Raises:
      PayloadTypeError: it is not a Session.
      PayloadError: some of its arrays were donated.
    """
    if not isinstance(session, Session):
        raise PayloadTypeError(
            f"{operation}({session_id!r}, session): expected a jss.Session; got {type(session).__name__}."
        )
    if is_donated(session):
        raise PayloadError(
            f"{operation}({session_id!r}, session): some of its arrays were deleted (donated to a jitted "
            "step). Pass the step's output instead. Nothing changed."
        )
    return session
