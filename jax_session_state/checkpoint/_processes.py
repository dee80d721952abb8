"""The steps a save or restore takes on every JAX process at once: each named, each with a timeout.

With ``jax.process_count() > 1`` a save or restore is collective: every
process makes the same call, and the call is a fixed sequence of *steps*
(a save's ``start``, ``write`` and ``publish``; a restore's ``read`` and
``check``).  At each step a process does its own part, then publishes the
outcome (a small JSON value, or its error) in the distributed runtime's
key-value store under ``jss/checkpoint/<operation>/<process>/<step>`` and
reads every other process's with a timeout.  So a failure anywhere reaches
every process: a process that raises publishes its error under every step it
has not reached, and the others raise
:class:`~jax_session_state.errors.CheckpointError` naming it, at once; a
process that dies or hangs is named once the timeout has passed.  No process
waits in a collective another process never reaches.  The one device
collective (gathering an array no restoring process holds whole, to check
it) runs only after every process has read its arrays, and is given the same
timeout.

Operations are numbered in the order each process makes them, so every
process must make its saves and restores in the same order (as SPMD code
does).  With one process every step just runs its part.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from jax_session_state._core._coordination import KeyValueStore, store
from jax_session_state.errors import CheckpointError

__all__ = ["DEFAULT_TIMEOUT_S", "Steps", "count", "is_primary"]

DEFAULT_TIMEOUT_S = 300.0
"""How long, by default, a process waits at each step of a save or restore for the others."""

T = TypeVar("T")

_OPERATIONS = itertools.count()
_PUBLISHED: list[tuple[int, str]] = []  # (operation, key) this process published and has not deleted
_PUBLISHED_LOCK = threading.Lock()


def count() -> int:
    """The number of JAX processes."""
    return jax.process_count()


def is_primary() -> bool:
    """Whether this process writes what only one process writes (the manifest, the rename)."""
    return jax.process_index() == 0


class Steps:
    """The named steps of one collective save or restore, each waiting at most ``timeout_s`` for the others.

    Made at the start of the call on every process (before anything that may
    fail), and used as a context manager: an exception leaving the block is
    published under every step this process has not taken, so the others
    raise at once instead of waiting for the timeout.
    """

    def __init__(self, what: str, names: Sequence[str], timeout_s: float):
        self.what, self.timeout_s, self._left = what, float(timeout_s), list(names)
        self._kv: KeyValueStore | None = None
        self._lost: set[int] = set()  # processes that did not answer in time
        if count() > 1:
            self._kv = store()
            if self._kv is None:
                raise CheckpointError(
                    f"{what}: {count()} JAX processes but no distributed runtime to exchange with; call "
                    "jax.distributed.initialize() first."
                )
            self._operation = next(_OPERATIONS)
            _forget_before(self._kv, self._operation - 1)

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        if error is not None and self._kv is not None and self._left:
            self._fail_the_rest(f"raised {type(error).__name__}: {error}")

    def step(self, name: str, work: Callable[[], T], share: Callable[[T], Any] = lambda _: None) -> tuple[T, list[Any]]:
        """Runs ``work`` here, then exchanges its outcome with every process.

        Returns:
          What ``work`` returned here, and every process's ``share(result)``
          (JSON), in process order.

        Raises:
          CheckpointError: another process failed at this step (its error
            quoted), or did not finish it within the timeout (named).  What
            ``work`` raised here is raised as it is, after the others are told.
        """
        if self._kv is None:
            result = work()
            return result, [share(result)]
        result = work()
        mine = share(result)
        self._publish(name, {"ok": mine})
        gathered = []
        for other in range(count()):
            gathered.append(mine if other == jax.process_index() else self._wait(name, other))
        return result, gathered

    def on_primary(self, name: str, work: Callable[[], Any]) -> Any:
        """``work()`` run by the primary process, its (JSON) result on every process."""
        return self.step(name, work if is_primary() else lambda: None, lambda result: result)[1][0]

    def settled(self, name: str) -> None:
        """Returns once every other process has published its outcome of step ``name`` (so its part of the step is
        over), skipping processes already found not to answer; waits at most the timeout for each."""
        if self._kv is None:
            return
        for other in range(count()):
            if other == jax.process_index() or other in self._lost:
                continue
            try:
                if self._kv.wait(self._key(other, name), self.timeout_s) is None:
                    self._lost.add(other)
            except Exception:  # the runtime is gone: nothing more to wait for
                return

    def within_timeout(self, name: str, collective: Callable[[], T]) -> T:
        """Runs a device collective every process makes at this point, raising if it does not end in time.

        Raises:
          CheckpointError: it did not end within the timeout (a process died
            or hung in it); the collective is left waiting in a daemon thread.
        """
        if self._kv is None:
            return collective()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(collective())
            except BaseException as error:  # handed to the caller
                done.set_exception(error)

        threading.Thread(target=run, name=f"jss {self.what} {name}", daemon=True).start()
        try:
            return done.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            message = (
                f"{self.what}: step {name!r} (a collective of every process) did not end within "
                f"{self.timeout_s:g} s; a process died or hung in it"
            )
            self._fail_the_rest(f"gave up: {message}")
            raise CheckpointError(message + ".") from None

    # ------------------------------------------------------------ the store
    def _key(self, process: int, name: str) -> str:
        return f"jss/checkpoint/{self._operation}/{process}/{name}"

    def _publish(self, name: str, value: dict[str, Any]) -> None:
        assert self._kv is not None
        if name in self._left:
            self._left.remove(name)
        key = self._key(jax.process_index(), name)
        self._kv.set(key, json.dumps(value, separators=(",", ":")))
        with _PUBLISHED_LOCK:
            _PUBLISHED.append((self._operation, key))

    def _fail_the_rest(self, message: str) -> None:
        """Publishes ``message`` as this process's failure under every step it has not taken."""
        for name in list(self._left):
            try:
                self._publish(name, {"failed": message})
            except Exception:  # the runtime is gone: the others time out instead
                break

    def _wait(self, name: str, other: int) -> Any:
        """Process ``other``'s outcome of step ``name``; raises (after telling the rest) if it failed or never came."""
        assert self._kv is not None
        try:
            value = self._kv.wait(self._key(other, name), self.timeout_s)
        except Exception as error:  # the runtime reports a lost process, or is shutting down
            value, problem = None, f"could not be heard from (the distributed runtime failed: {error})"
        else:
            problem = f"did not answer within {self.timeout_s:g} s (timeout): it died, hung or never made this call"
        if value is None:
            self._lost.add(other)
        else:
            outcome = json.loads(value)
            if "ok" in outcome:
                return outcome["ok"]
            problem = outcome["failed"]
        message = f"{self.what}: at step {name!r}, process {other} {problem}"
        self._fail_the_rest(f"gave up: {message}")
        raise CheckpointError(message.rstrip(".") + ".")


def _forget_before(kv: KeyValueStore, operation: int) -> None:
    """Deletes the keys this process published for operations before ``operation`` (every process has read them)."""
    with _PUBLISHED_LOCK:
        old = [key for op, key in _PUBLISHED if op < operation]
        _PUBLISHED[:] = [(op, key) for op, key in _PUBLISHED if op >= operation]
    for key in old:
        kv.delete(key)


def gather_to_host(x: jax.Array) -> np.ndarray:
    """The whole global array ``x`` as numpy, on every process (a device collective)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
