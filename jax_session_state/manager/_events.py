"""What the session manager reports: one :class:`ManagerEvent` per action, delivered to ``on_event``.

Every operation collects its events while it holds the manager's lock and
delivers them, in order, once it is done and the lock is released.  Every
event reaches the listener even when the listener raises: its errors are
collected and raised after the last event (the one error itself, or an
``ExceptionGroup`` of all of them).  When the operation itself failed (a
refusal), the operation's error is raised and the listener's errors are
logged and noted on it.  Either way the manager's state is what the
operation made it, as if the listener had not failed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Literal

__all__ = ["EventKind", "ManagerEvent", "deliver"]

EventKind = Literal["evict", "demote", "park", "restore", "recompute", "preempt", "refusal"]

_log = logging.getLogger("jax_session_state.manager")


@dataclasses.dataclass(frozen=True)
class ManagerEvent:
    """Something the manager did to a session, or refused to do.

    Attributes:
      kind: ``"evict"`` (an object evicted, to be recomputed), ``"demote"`` (an
        object replaced by its lower tier, lossy and not undone), ``"park"`` (an
        object moved to host memory), ``"restore"`` (a parked object copied
        back), ``"recompute"`` (an evicted object recomputed), ``"preempt"`` (a whole
        session released: later lookups raise SessionStateLostError) or
        ``"refusal"`` (a create, put or restore refused; nothing changed).
      session_id: the session acted on (for a refusal, the one refused).
      object_name: the object acted on; None for whole sessions.
      bytes_by_device: the bytes moved, freed or taken, by device key (for a
        refusal, the shortfall).
      reason: why, in words.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> def new_session(x):  # 80 bytes of K/V
      ...     kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      ...     return jss.Session(objects={"kv": kv.append((jnp.full((1, 2, 1, 2), x),) * 2)})
      >>> events = []
      >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 100}, on_event=events.append)
      >>> manager.create("a", new_session(1.0))
      >>> manager.create("b", new_session(2.0))  # no room for both: "a"'s K/V is parked
      >>> [(e.kind, e.session_id, e.object_name, dict(e.bytes_by_device)) for e in events]
      [('park', 'a', 'kv', {'cpu:0': 80})]
      >>> events[0].reason
      "cpu:0 over its budget of 100 bytes by 60 while creating session 'b'"
    """

    kind: EventKind
    session_id: Hashable
    object_name: str | None
    bytes_by_device: Mapping[str, int]
    reason: str


def deliver(
    listener: Callable[[ManagerEvent], object] | None,
    events: Sequence[ManagerEvent],
    *,
    failing: BaseException | None = None,
) -> None:
    """Hands every event to ``listener``, in order, whatever it raises.

    Args:
      listener: the manager's ``on_event`` (None: nothing to do).
      events: what one operation did.
      failing: the operation's own error, when it failed: the listener's
        errors are then logged and noted on it instead of raised.

    Raises:
      Exception: the listener's one error, after every event was delivered.
      ExceptionGroup: the listener's errors, when it raised more than once.
    """
    if listener is None:
        return
    errors: list[Exception] = []
    for event in events:
        try:
            listener(event)
        except Exception as error:  # a listener's error must not stop the other events
            errors.append(error)
    if not errors:
        return
    if failing is not None:
        for error in errors:
            _log.error("on_event raised while %s was being raised", type(failing).__name__, exc_info=error)
            failing.add_note(f"on_event also raised {type(error).__name__}: {error}")
        return
    if len(errors) == 1:
        raise errors[0]
    raise ExceptionGroup(f"on_event raised for {len(errors)} of {len(events)} events (all were delivered)", errors)
