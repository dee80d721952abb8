"""``SharedStore``: content key -> one shared state object, held in a ``SessionStateManager``.

Each key's object is held by the manager as its own small session under the
id :class:`SharedKey` (``objects={"value": obj}``), so the manager's ledger,
budgets, events and ``summary`` count its bytes once per device, whatever the
number of users.  While a user holds a key, that session is pinned (never
evicted, demoted, parked or preempted); once the last user lets go it is an
ordinary least recently used session the manager may park or preempt, and
the next ``acquire`` of the key copies it back or encodes it again.

A miss encodes once even when many threads ask at the same moment
(single-flight: the first caller encodes, the others wait on its result).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable
from typing import Any

from jax_session_state.accounting import tree_storages
from jax_session_state.base import StateObject
from jax_session_state.errors import PayloadError, PayloadTypeError, SessionStateLostError
from jax_session_state.session import Session

__all__ = ["SharedKey", "SharedStore"]

_VALUE = "value"


@dataclasses.dataclass(frozen=True)
class SharedKey:
    """The manager's session id of the shared object of content key ``key``.

    Example:
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> store = jss.SharedStore(manager)
      >>> _ = store.acquire("k1", "alice", lambda: jss.FixedState.allocate(shapes=(4,)))
      >>> jss.reuse.SharedKey("k1") in manager, len(manager)  # held by the manager, as a session
      (True, 1)
    """

    key: str


def _bytes_of(obj: StateObject) -> dict[str, int]:
    out: dict[str, int] = {}
    for device, _, nbytes in set(tree_storages(obj)):
        out[device] = out.get(device, 0) + nbytes
    return out


class SharedStore:
    """Shared state objects by content key, held once in a manager; thread-safe.

    ``acquire(key, user, encode)`` returns the object of ``key``, encoding it
    (``encode()``) only when the manager does not hold it; every user of a
    key reads the same buffers.  ``release(key, user)`` (or
    ``release_user(user)`` for all of a user's keys) lets go.  Pass the
    object to steps as a non-donated argument, or keep it in the user's
    session and step with :func:`~jax_session_state.reuse.donate_unshared`
    (never donate it: that deletes it for every user).  Sessions holding it
    may be held by the manager too: a buffer several sessions read counts
    once, and the manager never evicts, demotes, parks or preempts it while
    another session still reads it (preempting a session frees only what it
    alone holds).

    Args:
      manager: the :class:`~jax_session_state.SessionStateManager` that holds
        the objects (under ids :class:`SharedKey`; they count towards its
        ``max_sessions``).  Its ``stats()`` gains a ``"shared"`` entry: this
        store's :meth:`stats`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> store = jss.reuse.SharedStore(manager)
      >>> def encode():
      ...     cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=4, capacity=8)
      ...     return cond.commit((jnp.ones((1, 8, 1, 4)), jnp.ones((1, 8, 1, 4))))
      >>> key = jss.reuse.content_key(jnp.arange(8), identity="encoder@1")
      >>> a = store.acquire(key, "alice", encode)  # a miss: encodes
      >>> b = store.acquire(key, "bob", encode)    # a hit: the same buffers
      >>> a.k is b.k, store.stats()["encodes"], store.stats()["bytes_saved"]
      (True, 1, {'cpu:0': 265})
      >>> store.release_user("alice"), store.users(key)
      (1, 1)
    """

    def __init__(self, manager: Any):
        if not hasattr(manager, "pin") or not hasattr(manager, "create"):
            raise PayloadTypeError(f"SharedStore: expected a SessionStateManager; got {type(manager).__name__}.")
        self.manager = manager
        self._lock = threading.RLock()
        self._flights: dict[str, concurrent.futures.Future[None]] = {}
        self._holds: dict[str, dict[Hashable, contextlib.ExitStack]] = {}
        self._bytes: dict[str, dict[str, int]] = {}
        self._hits = self._misses = self._waits = 0
        reports = getattr(manager, "_stat_reports", None)
        if reports is not None:
            reports["shared"] = self.stats

    # ---------------------------------------------------------------- use
    def acquire(self, key: str, user: Hashable, encode: Callable[[], StateObject]) -> StateObject:
        """The object of ``key``, held for ``user`` until released; encoded only on a miss.

        Args:
          key: a content key (:func:`~jax_session_state.reuse.content_key`).
          user: who holds it (a session id); acquiring a key twice for one
            user holds it once.
          encode: ``encode() -> StateObject``, a resident object; called
            outside every lock, by one thread per missing key.

        Returns:
          The shared object.  Do not donate it.

        Raises:
          PayloadTypeError: ``key`` is not a str, or ``encode`` did not return
            a resident state object.
          BudgetExceededError: the manager has no room for it (the waiting
            threads get the same error).
        """
        if not isinstance(key, str):
            raise PayloadTypeError(f"SharedStore.acquire: key must be a str content key; got {type(key).__name__}.")
        while True:
            with self._lock:
                held = self._pin(key, user)
                if held is not None:
                    self._hits += 1
                    return held
                flight = self._flights.get(key)
                owner = flight is None
                if owner:
                    flight = self._flights[key] = concurrent.futures.Future()
            if not owner:
                with self._lock:
                    self._waits += 1
                flight.result()  # raises the encoder's error
                continue  # now held: pin it (or, if it was lost meanwhile, encode it)
            try:
                obj = encode()
                if not isinstance(obj, StateObject) or not obj.resident:
                    got = type(obj).__name__ if not isinstance(obj, StateObject) else f"{obj.describe()} (not resident)"
                    raise PayloadTypeError(
                        f"SharedStore.acquire({key!r}): encode() must return a resident state object; got {got}."
                    )
                with self._lock:
                    self.manager.create(SharedKey(key), Session(objects={_VALUE: obj}))
                    self._bytes[key] = _bytes_of(obj)
                    held = self._pin(key, user)
                    self._misses += 1
                    del self._flights[key]
                flight.set_result(None)
            except BaseException as error:
                with self._lock:
                    self._flights.pop(key, None)
                flight.set_exception(error)
                raise
            if held is None:  # lost between create and pin (extreme pressure): try again
                continue
            return held

    def _pin(self, key: str, user: Hashable) -> StateObject | None:
        """Pins the key's session for ``user`` (once per user); its object, or None when not held."""
        sid = SharedKey(key)
        if user in self._holds.get(key, {}):
            return self.manager.get(sid)[_VALUE]
        if sid not in self.manager:
            return None
        stack = contextlib.ExitStack()
        try:
            session = stack.enter_context(self.manager.pin(sid))
        except SessionStateLostError:
            return None
        self._holds.setdefault(key, {})[user] = stack  # a key is in use only once a user holds it
        return session[_VALUE]

    def release(self, key: str, user: Hashable) -> bool:
        """``user`` lets go of ``key``; True if it held it.  The last user's release unpins it."""
        with self._lock:
            stack = self._holds.get(key, {}).pop(user, None)
            if stack is None:
                return False
            stack.close()
            if not self._holds[key]:
                del self._holds[key]
            return True

    def release_user(self, user: Hashable) -> int:
        """``user`` lets go of every key it holds (call it when its session is released); how many."""
        with self._lock:
            keys = [key for key, holds in self._holds.items() if user in holds]
            return sum(self.release(key, user) for key in keys)

    def users(self, key: str) -> int:
        """How many users hold ``key`` now."""
        with self._lock:
            return len(self._holds.get(key, {}))

    def forget(self, key: str) -> bool:
        """Releases the manager's copy of an unused key at once; True if it was held.

        Raises:
          PayloadError: a user still holds the key.
        """
        with self._lock:
            if self._holds.get(key):
                raise PayloadError(f"SharedStore.forget({key!r}): {len(self._holds[key])} users still hold it; "
                                   "release them first.")
            self._bytes.pop(key, None)
            return self.manager.release(SharedKey(key))

    def stats(self) -> dict[str, Any]:
        """What the store did and what sharing saves now.

        Returns:
          ``keys`` (keys in use), ``users`` (holds over all keys), ``hits``
          (acquires served without encoding, ``waits`` of them behind another
          thread's encode), ``misses`` (acquires that encoded: ``encodes``),
          ``bytes_shared`` (bytes by device key of the keys in use, each once)
          and ``bytes_saved`` (what one copy per user would add to them).
        """
        with self._lock:
            shared: dict[str, int] = {}
            saved: dict[str, int] = {}
            for key, holds in self._holds.items():
                for device, nbytes in self._bytes.get(key, {}).items():
                    shared[device] = shared.get(device, 0) + nbytes
                    saved[device] = saved.get(device, 0) + nbytes * (len(holds) - 1)
            return {
                "keys": len(self._holds),
                "users": sum(len(holds) for holds in self._holds.values()),
                "hits": self._hits,
                "waits": self._waits,
                "misses": self._misses,
                "encodes": self._misses,
                "bytes_shared": shared,
                "bytes_saved": {k: b for k, b in saved.items() if b},
            }
