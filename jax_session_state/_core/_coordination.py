"""The key-value store of JAX's distributed runtime: the one private JAX import of the library.

``jax.distributed.initialize`` starts a coordination service and connects
every process to it; its client holds a small key-value store that works
without any device collective, with timeouts, so a process that never comes
is an error rather than a hang.  JAX exposes that client only as
``jax._src.distributed.global_state.client`` (Orbax reaches it the same way,
through its own private ``orbax.checkpoint._src.futures.signaling_client``,
whose timeouts are whole seconds), so the private import lives here alone:
if JAX moves it, this module is the one to change.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KeyValueStore", "store"]


class KeyValueStore:
    """Set, wait for and delete string values shared by every process of the job."""

    def __init__(self, client: Any):
        self._client = client

    def set(self, key: str, value: str) -> None:
        """Publishes ``value`` under ``key`` (a key is written once)."""
        self._client.key_value_set(key, value)

    def wait(self, key: str, timeout_s: float) -> str | None:
        """The value under ``key`` once some process sets it, or None after ``timeout_s`` seconds."""
        try:
            return str(self._client.blocking_key_value_get(key, max(int(timeout_s * 1000), 1)))
        except Exception as error:  # the runtime raises XlaRuntimeError (DEADLINE_EXCEEDED) on a timeout
            if "DEADLINE_EXCEEDED" in str(error) or "timed out" in str(error).lower():
                return None
            raise

    def delete(self, key: str) -> None:
        """Removes ``key`` (no error if it is gone)."""
        try:
            self._client.key_value_delete(key)
        except Exception:  # already deleted, or the service is shutting down: nothing to clean
            pass


def store() -> KeyValueStore | None:
    """The job's key-value store, or None when ``jax.distributed.initialize`` was not called."""
    from jax._src import distributed  # private: see the module docs

    client = distributed.global_state.client
    return None if client is None else KeyValueStore(client)
