"""``save`` and ``restore``: what they write and read, and the record of a manager (a session's is in ``_sessions``).

The format is told in the package docstring (:mod:`jax_session_state.checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_session_state._core._placement import place, runtime_owned
from jax_session_state.checkpoint import _atomic, _claims, _codec, _manifest, _orbax_io, _pieces, _processes
from jax_session_state.checkpoint._manifest import FORMAT, VERSION, ArrayTable
from jax_session_state.checkpoint._orbax_io import AS_NUMPY, Destination
from jax_session_state.checkpoint._sessions import Plan, encode_session, plan_session, refuse_donated
from jax_session_state.errors import CheckpointError, PayloadError, PayloadTypeError
from jax_session_state.manager import (
    ManagerSnapshot,
    SessionStateManager,
    SnapshotSession,
)
from jax_session_state.session import Session
from jax_session_state.sharding import ShardingRules

__all__ = ["FORMAT", "VERSION", "restore", "save"]

_ARRAYS = "arrays"


# --------------------------------------------------------------------- API
def save(
    path: str | os.PathLike, state: Session | SessionStateManager, *, timeout: float = _processes.DEFAULT_TIMEOUT_S
) -> Path:
    """Saves ``state`` as the newest checkpoint in directory ``path``, atomically.

    The previous checkpoint stays complete and restorable until the new one
    is; it is removed once the new one is in place.  One writer per ``path``
    at a time.  With several JAX processes every process calls it (a
    collective): each writes its addressable shards, the primary the manifest
    and the rename; ``path`` must be one directory all processes see.

    Args:
      path: the checkpoint directory (created if missing).
      state: a :class:`~jax_session_state.Session` (objects, attrs including
        typed PRNG keys, lengths, flags and static specs; non-resident
        objects are saved as non-resident), or a
        :class:`~jax_session_state.SessionStateManager`: its settings and
        every session it holds (:meth:`~SessionStateManager.snapshot`),
        least recently used first, parked objects included (read from host
        memory, nothing is brought back), evicted objects recorded as
        evicted.  Pins, counters, callbacks, recompute and demotion functions
        are not saved.  Sessions between a ``get`` and the ``put`` of a step
        that donated them cannot be saved.
      timeout: with several processes, the seconds each process waits for
        the others at each step of the save (start, write, publish); a
        process that fails, dies or does not answer in time makes every
        process raise.

    Returns:
      The directory of the new checkpoint.

    Raises:
      PayloadTypeError: ``state`` is not something a checkpoint can hold.
      CheckpointError: a spec, structure or attr that cannot be recorded
        (numpy arrays of strings, objects, dates or records among them),
        naming it; nothing is written.  Or the file system refused (full,
        read-only, the directory deleted mid-save), naming the path; or,
        with several processes, another process failed or did not answer
        within ``timeout``, naming it.  Nothing is published then, no
        partial directory is left, and the previous checkpoint is untouched.
      DonatedError: an array of the session was donated to a jitted step
        (deleted), naming the object or attr; nothing is written.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> import jax_session_state as jss
      >>> session = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
      >>> path = tempfile.mkdtemp()
      >>> [jss.checkpoint.save(path, session).name for _ in range(2)]
      ['ckpt-000001', 'ckpt-000002']
      >>> [p.name for p in Path(path).glob("ckpt-*")]  # the older one goes once the new one is in place
      ['ckpt-000002']
    """
    root = Path(path)
    with _processes.Steps(f"checkpoint.save({str(root)!r})", _SAVE_STEPS, timeout) as steps:
        try:
            return _save(root, state, steps)
        except OSError as error:  # the file system refused: full, read-only, a folder gone
            raise CheckpointError(
                f"checkpoint.save() into {root} failed: {error}. Nothing was published; the previous checkpoint "
                "is untouched."
            ) from error


_SAVE_STEPS = ("start", "write", "publish")


def _save(root: Path, state: Any, steps: _processes.Steps) -> Path:
    """A save on every process: each writes its shards, the primary the manifest and the rename.

    Steps (each exchanged between processes, with a timeout): ``start``:
    every process records its state and the primary clears leftovers and
    creates the partial directory, holding it open; ``write``: every process
    writes its shards through Orbax and digests them, and shares the
    digests; ``publish``: the primary checks that the partial directory is
    still the one it made, writes the manifest and publishes; the others
    return once it has.  A failure at any step (an error, a process that
    dies or does not answer) raises on every process, and every process that
    wrote removes the partial directory, so the previous checkpoint stays the
    newest and nothing else is left.
    """
    with contextlib.ExitStack() as held:

        def start() -> tuple[str, dict[str, Any], ArrayTable, int | None, Callable[[], None]]:
            content = next((c for c in _CONTENTS.values() if isinstance(state, c.type)), None)
            if content is None:
                kinds = ", ".join(c.type.__name__ for c in _CONTENTS.values())
                raise PayloadTypeError(f"checkpoint.save() saves a {kinds}; got {type(state).__name__}.")
            table = ArrayTable()
            record = content.encode(state, table)
            if not _processes.is_primary():
                return content.name, record, table, None, lambda: None
            partial, final = _atomic.begin(root)
            held.enter_context(_atomic.removed_on_failure(partial))  # also if another process fails to start
            check = held.enter_context(_atomic.held_open(partial))
            return content.name, record, table, _atomic.save_number(final), check

        (content, record, table, _, check), numbers = steps.step("start", start, share=lambda started: started[3])
        partial, final = _atomic.named(root, numbers[0])
        with _atomic.removed_on_failure(partial, settled=lambda: steps.settled("write")):
            # With several processes Orbax refuses arrays one process holds whole: those (numpy, attrs on one
            # device) are the same on every process (checked by their digests) and written once, by the
            # primary, as numpy.
            values = table.values if _processes.count() == 1 else {
                k: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x
                for k, x in table.values.items()
            }

            def write() -> dict[str, Any]:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    local = pool.submit(_pieces.local_digests, table.values)  # hashlib releases the GIL
                    _orbax_io.write_arrays(partial / _ARRAYS, values)
                    return local.result()

            _, digests = steps.step("write", write, share=lambda local: local)

            def publish() -> int:
                entries = _pieces.gather_digests(table.entries, digests)
                check()
                _manifest.write(partial, content, record, entries)
                check()
                return _atomic.save_number(_atomic.publish(partial, final))

            steps.on_primary("publish", publish)
        return final


def restore(
    path: str | os.PathLike,
    *,
    target: Session | SessionStateManager | None = None,
    shardings: ShardingRules | None = None,
    classes: Iterable[type] = (),
    timeout: float = _processes.DEFAULT_TIMEOUT_S,
) -> Session | SessionStateManager:
    """Restores the newest checkpoint in directory ``path``, verified, running no code it names.

    Args:
      path: the checkpoint directory given to :func:`save`.
      target: for a session checkpoint, a session the checkpoint must match
        (object names, kinds, specs, attrs structure, shapes and dtypes);
        restored objects take its placement (each object's ShardingRules,
        else where its arrays are, memory kind included) and what a
        checkpoint does not record (demotion functions).  For a manager
        checkpoint, an empty manager to fill (its own settings, callbacks
        and registered recompute functions apply); without one, a new manager with the
        saved settings.
      shardings: rules to place every object by (attrs are replicated on the
        mesh), whatever the checkpoint was saved on; overrides ``target``'s.
      classes: state-object kinds and namedtuple classes the checkpoint may
        name besides those already defined in this process.  A restore
        imports nothing: the kinds it finds are the library's own and every
        :class:`~jax_session_state.StateObject` subclass whose module was
        imported (:func:`~jax_session_state.base.state_object_classes`), and
        namedtuples of modules already imported.
      timeout: with several processes (each calls it), the seconds each
        waits for the others at each step (read, check); a process that
        fails, dies or does not answer in time makes every process raise.

    Without ``target`` or ``shardings`` everything lands on the default
    device (``jax.default_device``'s, where ``jnp`` puts new arrays).  A
    restored session continues a rollout bit for bit.  A restored manager
    admits the sessions least recently used first, by its usual rules
    (:meth:`SessionStateManager.load`).

    Raises:
      CheckpointError: no checkpoint, another format version, a manifest or
        array that does not match its digest (damaged files), truncated
        files, files that vanish while read, a target that does not match (or
        a manager target that is not empty), a class, dtype or key
        implementation that is not known here, or arrays that claim more
        bytes than their files hold; naming the file and what is wrong; with
        several processes, on every process, also when another process
        failed or did not answer within ``timeout``.  Nothing is
        half-restored.
      PayloadError, PayloadTypeError: ``shardings`` (or ``target``'s rules)
        cannot place an object, naming the argument.
      BudgetExceededError, SessionAdmissionError: a manager's sessions do
        not fit ``target``; it is left empty.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> manager.create("user", jss.Session(objects={"h": jss.FixedState.allocate(shapes=(2,)).commit(jnp.ones(2))}))
      >>> path = tempfile.mkdtemp()
      >>> _ = jss.checkpoint.save(path, manager)
      >>> again = jss.checkpoint.restore(path, target=jss.SessionStateManager(max_sessions=8))
      >>> again.get("user")["h"].view()
      Array([1., 1.], dtype=float32)
    """
    with _processes.Steps(f"checkpoint.restore({str(path)!r})", ("read", "check"), timeout) as steps:
        return _restore(path, target, shardings, classes, steps)


def _restore(
    path: str | os.PathLike,
    target: Session | SessionStateManager | None,
    shardings: ShardingRules | None,
    classes: Iterable[type],
    steps: _processes.Steps,
) -> Session | SessionStateManager:
    """:func:`restore`, its steps exchanged between processes by ``steps``."""
    if target is not None and not isinstance(target, (Session, SessionStateManager)):
        raise PayloadTypeError(
            f"restore(target=...) takes a Session or a SessionStateManager; got {type(target).__name__}."
        )
    if shardings is not None and not isinstance(shardings, ShardingRules):
        raise PayloadTypeError(f"restore(shardings=...) takes ShardingRules; got {type(shardings).__name__}.")
    known = _claims.Classes(classes)
    directory = _atomic.newest(Path(path))
    manifest = _manifest.read(directory)
    content = _CONTENTS.get(manifest.get("content"))
    if content is None:
        raise CheckpointError(f"{directory}: holds {manifest.get('content')!r}, which this library cannot restore.")
    if target is not None and not isinstance(target, content.type):
        raise CheckpointError(
            f"{directory} holds a {content.type.__name__}; restore(target=...) got a {type(target).__name__}."
        )
    if isinstance(target, SessionStateManager) and len(target):
        raise CheckpointError(f"restore(target=...): the manager must be empty; it holds {len(target)} sessions.")
    entries = manifest["arrays"]
    _claims.check_entries(directory, entries, directory / _ARRAYS)  # before anything is decoded or allocated
    with _decoding(directory):
        destinations, uncommitted, assemble = content.plan(manifest["record"], entries, target, shardings, known)
        layout = {key: (tuple(entry["shape"]), str(entry["dtype"])) for key, entry in entries.items()}
        pieces = _pieces.expected(entries)
    read_to = {key: AS_NUMPY if key in uncommitted else where for key, where in destinations.items()}
    arrays = _orbax_io.read_arrays(directory / _ARRAYS, layout, read_to)
    _pieces.verify(directory, arrays, entries, pieces, steps)
    with _decoding(directory):
        values = {
            key: _finish(arrays.pop(key), entry, destinations[key] if key in uncommitted else None)
            for key, entry in entries.items()
        }
    return assemble(values)


@contextlib.contextmanager
def _decoding(directory: Path) -> Iterator[None]:
    """Turns what a record that does not decode raises into a CheckpointError naming the manifest.

    Errors about restore's own arguments (rules that cannot place an object)
    pass as they are.
    """
    try:
        yield
    except (PayloadError, PayloadTypeError):
        raise
    except CheckpointError as error:
        raise CheckpointError(f"{directory / _manifest.MANIFEST}: {error}") from error
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise _manifest.malformed(directory, error) from error


def _finish(x: Any, entry: dict[str, Any], uncommitted_on: jax.sharding.Sharding | None) -> Any:
    """A verified array as the session holds it: in runtime-owned buffers, committed or not, typed keys wrapped.

    An array a session made with ``jnp`` on the default device is not
    committed to it, and a jitted step compiles once more for the other kind;
    such arrays (``uncommitted_on`` their device) are read as numpy and
    placed uncommitted, at most one copy.  Orbax returns the others committed
    to their sharding; on CPU the shards that wrap Orbax's host buffers are
    copied into runtime-owned ones, one array at a time (the peak stays the
    state plus its largest array).  An array saved weakly typed (made from a
    Python scalar) is weakly typed again, so a jitted step does not trace
    once more for it.
    """
    if uncommitted_on is not None:
        x = jax.block_until_ready(place(x, uncommitted_on, committed=False))  # before the next array's copy
    elif isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set):
        x = jax.block_until_ready(runtime_owned(x))
    if entry["type"] == "key":
        return jax.random.wrap_key_data(x, impl=entry["impl"])
    if entry["type"] == "numpy_scalar":
        return np.asarray(x)[()]
    if entry.get("weak_type", False):
        return _weakly_typed(x)
    return x


def _weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` weakly typed, as an array made from a Python scalar is; placement and commitment kept.

    JAX sets the mark publicly only on arrays it makes from Python scalars;
    this is ``lax.convert_element_type`` with its private ``weak_type=True``.
    """
    from jax._src.lax import lax  # private: see the docstring

    return lax._convert_element_type(x, weak_type=True)


@dataclasses.dataclass(frozen=True)
class _Content:
    """One kind of thing a checkpoint holds: how to record it and how to plan its restore."""

    name: str
    type: type
    encode: Callable[[Any, ArrayTable], dict[str, Any]]
    plan: Callable[..., Plan]


# ------------------------------------------------------------- managers
def _encode_manager(manager: SessionStateManager, table: ArrayTable) -> dict[str, Any]:
    """The manager's snapshot: settings and every session, parked objects with their host arrays."""
    if manager.checked_out():
        raise CheckpointError(
            f"sessions {sorted(map(repr, manager.checked_out()))} are checked out into pool slots, so the "
            "manager does not hold them; checkin() them before saving the manager."
        )
    try:
        snapshot = manager.snapshot()
    except RuntimeError as error:  # a session donated to a step that has not been put back
        raise CheckpointError(f"cannot save the manager: {error}") from None
    sessions = [
        {
            "id": _codec.encode_value(held.session_id, where=f"session id {held.session_id!r}"),
            "session": encode_session(held.session, table),
            "evicted": sorted(held.evicted),
        }
        for held in snapshot.sessions
    ]
    return {"settings": dict(snapshot.settings), "sessions": sessions}


def _plan_manager(
    record: dict[str, Any],
    entries: dict[str, Any],
    target: SessionStateManager | None,
    shardings: ShardingRules | None,
    classes: _claims.Classes,
) -> Plan:
    """Each session planned as a session checkpoint; the (empty) manager filled in LRU order."""
    settings = dict(record["settings"])
    destinations: dict[str, Destination] = {}
    uncommitted: set[str] = set()
    sessions = []
    for saved in record["sessions"]:
        where, not_committed, assemble = plan_session(saved["session"], entries, None, shardings, classes)
        destinations.update(where)
        uncommitted |= not_committed
        sessions.append((_codec.decode_value(saved["id"], classes), assemble, frozenset(saved["evicted"])))

    def assemble_manager(arrays: dict[str, Any]) -> SessionStateManager:
        snapshot = ManagerSnapshot(
            settings, tuple(SnapshotSession(sid, assemble(arrays), evicted) for sid, assemble, evicted in sessions)
        )
        if target is None:
            return SessionStateManager.from_snapshot(snapshot)
        target.load(snapshot)
        return target

    return destinations, uncommitted, assemble_manager


def _encode_saved_session(session: Session, table: ArrayTable) -> dict[str, Any]:
    """The record of a session to save, refused (before anything is written) if its arrays were donated."""
    refuse_donated(session)
    return encode_session(session, table)


_CONTENTS = {
    "session": _Content("session", Session, _encode_saved_session, plan_session),
    "manager": _Content("manager", SessionStateManager, _encode_manager, _plan_manager),
}
"""What checkpoints hold, by the name in the manifest."""
