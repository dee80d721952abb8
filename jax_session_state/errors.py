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
    "BudgetExceededError",
    "CapacityError",
    "CheckpointError",
    "DonatedError",
    "NotDemotableError",
    "NotEvictableError",
    "NotResidentError",
    "PayloadError",
    "PayloadTypeError",
    "ProcessDisagreementError",
    "RecomputeGraphError",
    "SessionAdmissionError",
    "SessionCheckedOutError",
    "SessionStateError",
    "SessionStateLostError",
]


class SessionStateError(Exception):
    """Base class of the errors raised by ``jax_session_state``.

    Every error about a state object, a session, a payload or an argument is
    one.  Where Python's protocols ask for a built-in type the library raises
    that type: ``KeyError`` for a name a :class:`~jax_session_state.Session`
    does not hold, ``IndexError`` for a pool slot or branch lane out of
    range.  ``RuntimeError`` is left for what no argument caused: a native
    kernel asked for that this build or CPU lacks (``JSS_NATIVE_ISA``,
    ``implementation="native"``), ``update`` called from inside its own
    ``fn``, and a registered recompute function that raised (its error
    chained).

    Example:
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> try:
      ...     manager.get("nobody")
      ... except jss.SessionStateError as error:  # catches every error of the library
      ...     print(type(error).__name__)
      SessionStateLostError
    """


class CapacityError(SessionStateError, RuntimeError):
    """A write did not fit the object's capacity; nothing was written.

    Raised at once outside ``jit``.  Inside ``jit`` the object's ``overflowed``
    flag is set instead and :func:`jax_session_state.check` raises this error.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> full = jax.jit(lambda kv, k: kv.append((k, k)))(kv, jnp.ones((1, 5, 1, 2)))  # 5 rows > 4
      >>> try:
      ...     jss.check(full)
      ... except jss.CapacityError as error:
      ...     print(error)
      a write inside jit was refused and wrote nothing (it did not fit, its per-row counts were
      out of range, or it named a slot it may not use), in: <root>: KVCache(...). Allocate more
      capacity ...
    """


class NotResidentError(SessionStateError, RuntimeError):
    """An evicted or reset object was read or written.

    Example:
      >>> import jax_session_state as jss
      >>> cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4, recompute_source="prompt")
      >>> evicted, freed = cond.evict()
      >>> try:
      ...     evicted.view()
      ... except jss.NotResidentError as error:
      ...     print(error)
      view() on EncodeOnceKV(...), which is not resident (it was evicted or reset). Recompute it,
      restore it through the manager, or start over with .empty().
    """


class DonatedError(NotResidentError):
    """An object whose arrays were donated to a jitted call was used again.

    Donation hands the buffers to the call's output and deletes the input's
    arrays; use the output instead (or ``fork()`` before donating).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> step = jax.jit(lambda kv, k: kv.append((k, k)), donate_argnums=0)
      >>> new = step(kv, jnp.ones((1, 1, 1, 2)))
      >>> try:
      ...     kv.view()  # the old cache's buffers now belong to ``new``
      ... except jss.DonatedError as error:
      ...     print(error)
      view() on KVCache(...), whose storage ('k') was donated to a jitted call and deleted. Use
      that call's output instead, or fork() before donating.
    """


class PayloadError(SessionStateError, ValueError):
    """A payload (or an argument) has the wrong shape or value; nothing was written.

    Raised at trace time, naming the object, what it expected and what came.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> try:
      ...     kv.append((jnp.ones((1, 1, 1, 3)),) * 2)  # head_dim 3, not 2
      ... except jss.PayloadError as error:
      ...     print(error)
      KVCache(...).append: k must have shape [1, T, 1, 2] and dtype float32 (with T=1); got shape
      [1, 1, 1, 3] and dtype float32.
    """


class PayloadTypeError(SessionStateError, TypeError):
    """A payload (or an argument) has the wrong structure, type or dtype; nothing was written.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> try:
      ...     kv.append((jnp.ones((1, 1, 1, 2), jnp.int32),) * 2)
      ... except jss.PayloadTypeError as error:
      ...     print(error)
      KVCache(...).append: k must have shape [1, T, 1, 2] and dtype float32; got shape [1, 1, 1, 2]
      and dtype int32. Cast it first.
    """


class NotEvictableError(SessionStateError, RuntimeError):
    """``evict()`` was called on an object that may never be evicted.

    Example:
      >>> import jax_session_state as jss
      >>> carry = jss.FixedState.allocate(shapes=(2,))  # no recompute_source: it cannot be recomputed
      >>> try:
      ...     carry.evict()
      ... except jss.NotEvictableError as error:
      ...     print(error)
      FixedState(float32[2]) cannot be evicted: it has no recompute source, so its contents could
      not be recomputed. Declare recompute_source= at allocate, park it to host memory, or reset() it
      deliberately.
    """


class NotDemotableError(SessionStateError, RuntimeError):
    """``demote()`` was called on an object that declares no lower tier.

    Example:
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> try:
      ...     kv.demote()
      ... except jss.NotDemotableError as error:
      ...     print(error)
      KVCache(...) has no lower tier to demote to: allocate it with tiers=("int8",) to let it be
      quantized when memory is short.
    """


class RecomputeGraphError(SessionStateError, ValueError):
    """A recompute source names a missing object, or the sources form a cycle.

    Example:
      >>> import jax_session_state as jss
      >>> cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4, recompute_source="prompt")
      >>> try:
      ...     jss.Session(objects={"cond": cond})
      ... except jss.RecomputeGraphError as error:
      ...     print(error)
      recompute source 'prompt' of 'cond' is not in this session; it holds ['cond']. Add it, or
      allocate 'cond' without it.
    """


class BudgetExceededError(SessionStateError, RuntimeError):
    """A put or create would exceed a byte budget and nothing could be freed.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> def new_session():  # 80 bytes on cpu:0
      ...     kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      ...     return jss.Session(objects={"kv": kv.append((jnp.ones((1, 2, 1, 2)),) * 2)})
      >>> manager = jss.SessionStateManager(byte_budget={"cpu:0": 100}, park_memory_kind=None,
      ...                                   evict_when_full=False)
      >>> manager.create("a", new_session())
      >>> try:
      ...     manager.create("b", new_session())  # nothing to evict or park, no preemption
      ... except jss.BudgetExceededError as error:
      ...     print(error)
      creating session 'b' does not fit the byte budget (cpu:0 over its budget of 100 bytes by 60
      while creating session 'b'); after everything the manager may free it is still over budget:
      cpu:0 by 60 bytes. Nothing changed. Raise byte_budget, ...
      >>> list(manager.held())  # "a" as it was, "b" not admitted
      ['a']
    """


class SessionAdmissionError(SessionStateError, RuntimeError):
    """The manager is full and may not evict to admit another session.

    Example:
      >>> import jax_session_state as jss
      >>> session = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
      >>> manager = jss.SessionStateManager(max_sessions=1, evict_when_full=False)
      >>> manager.create("a", session)
      >>> try:
      ...     manager.create("b", session)
      ... except jss.SessionAdmissionError as error:
      ...     print(error)
      cannot create session 'b': the manager holds max_sessions=1 sessions and it may not evict
      (evict_when_full=False). Nothing changed; release() a session, raise max_sessions, or allow
      eviction.
    """


class SessionStateLostError(SessionStateError, LookupError):
    """The session is unknown, was released, or was preempted.

    Raised instead of silently handing back an empty session.

    Example:
      >>> import jax_session_state as jss
      >>> session = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
      >>> manager = jss.SessionStateManager(max_sessions=1)
      >>> manager.create("a", session)
      >>> manager.create("b", session)  # preempts "a", the least recently used
      >>> try:
      ...     manager.get("a")
      ... except jss.SessionStateLostError as error:
      ...     print(error)
      session 'a' is gone: preempted at the count cap (max_sessions=1) while creating session 'b'.
      Its state cannot be returned and nothing was created; start it again with create('a', session)
      (from a checkpoint if you keep them), and pin() sessions that must not be lost.
    """


class SessionCheckedOutError(SessionStateError, RuntimeError):
    """The session is checked out into a pool slot; the manager does not hold it until ``checkin``.

    Example:
      >>> import jax_session_state as jss
      >>> session = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
      >>> manager = jss.SessionStateManager()
      >>> manager.create("a", session)
      >>> pool = manager.checkout("a", jss.SessionPool.allocate(session, slots=2), 0)
      >>> try:
      ...     manager.get("a")
      ... except jss.SessionCheckedOutError as error:
      ...     print(error)
      session 'a' is checked out into slot 0 of pool ...; the manager does not hold it. checkin('a', pool, 0) first.
    """


class CheckpointError(SessionStateError, ValueError):
    """A checkpoint could not be restored, or a state could not be saved.

    Restoring raises it when there is no checkpoint, when it has another
    format version, when its files are damaged, or when it does not match the
    target; nothing is half-restored.

    Example:
      >>> import tempfile
      >>> import jax_session_state as jss
      >>> with tempfile.TemporaryDirectory() as empty:
      ...     try:
      ...         jss.checkpoint.restore(empty)
      ...     except jss.CheckpointError as error:
      ...         print(error)
      no complete checkpoint in ... (a save that crashed leaves none).
    """


class ProcessDisagreementError(SessionStateError, RuntimeError):
    """The managers of several JAX processes decided differently about a session that spans them.

    One :class:`~jax_session_state.SessionStateManager` runs per process; for
    a session whose arrays are not fully addressable every decision that
    makes room for it (evict, demote, park, restore, preempt) is exchanged
    between the processes before it is applied.  This is raised, with nothing
    changed on this process, when another process's decision differs (the
    message shows both) or when another process did not publish its decision
    within ``agreement_timeout`` seconds (the message names it).  Make the
    same calls on every process, in the same order, with the same budgets.
    A session that lives on one process's devices never raises it.

    Example:
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager(agreement_timeout=30.0)  # one per process
      >>> manager.create("local", jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))}))
      >>> issubclass(jss.ProcessDisagreementError, RuntimeError)  # nothing to agree on: one process's devices
      True
    """
