"""A jitted step that donates a session except the objects it shares with other sessions.

Donating a pytree deletes its arrays; two sessions holding the same shared
object would lose it together ("Array has been deleted").  ``donate_unshared``
passes the shared objects to the compiled step as a separate, non-donated
argument and hands the inputs themselves back in the result, so the shared
buffers are never donated, never copied, and never written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.session import Session

__all__ = ["donate_unshared"]


def _split(session: Session, names: tuple[str, ...], where: str) -> tuple[Session, dict[str, Any]]:
    """The session with the shared objects reset (no arrays), and the shared objects."""
    if not isinstance(session, Session):
        raise PayloadTypeError(f"{where}: expected a jss.Session; got {type(session).__name__}.")
    missing = [name for name in names if name not in session]
    if missing:
        raise PayloadError(f"{where}: the session has no object {missing[0]!r} to share; it has {list(session)}.")
    held = {name: session[name] for name in names}
    return session.with_objects(**{name: obj.reset() for name, obj in held.items()}), held


def donate_unshared(
    fn: Callable[..., Any], *, shared: Sequence[str], **jit_options: Any
) -> Callable[..., Any]:
    """``jax.jit(fn)`` donating its first argument, a :class:`Session`, except the objects named ``shared``.

    The objects named ``shared`` (typically a conditioning
    :class:`~jax_session_state.EncodeOnceKV` taken from a
    :class:`~jax_session_state.reuse.SharedStore`) are read by ``fn`` but
    are **read-only** in it: whatever ``fn`` returns for them is dropped and
    the result holds the input objects themselves (no copy).  A written
    ``EncodeOnceKV`` never changes (every later commit is a no-op), so a
    step that commits it unconditionally loses nothing.  Everything else of
    the session is donated: written in place, as ``jax.jit(fn,
    donate_argnums=0)`` would.

    Args:
      fn: ``fn(session, *args) -> Session`` or ``-> (Session, *outputs)``; it
        keeps the session's structure (as every step does).
      shared: names of the objects other sessions hold too.
      **jit_options: more options for :func:`jax.jit` (``static_argnums``
        counts ``session`` as argument 0).

    Returns:
      The step ``step(session, *args)``; it compiles once per session
      structure, like any jitted step.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> cond = jss.EncodeOnceKV.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> cond = cond.commit((jnp.ones((1, 4, 1, 2)), jnp.ones((1, 4, 1, 2))))
      >>> make = lambda: jss.Session(objects={"cond": cond, "carry": jss.FixedState.allocate(shapes=(2,))})
      >>> a, b = make(), make()  # both read the same conditioning buffers
      >>> step = jss.reuse.donate_unshared(
      ...     lambda s: s.commit(carry=s.view()["carry"] + s.view()["cond"].k[0, 0, 0]), shared=["cond"])
      >>> a = step(a)  # a's carry is donated; the conditioning is not
      >>> a["cond"] is b["cond"], b["cond"].k.is_deleted(), a.view()["carry"]
      (True, False, Array([1., 1.], dtype=float32))
    """
    names = tuple(shared)
    if not all(isinstance(name, str) for name in names):
        raise PayloadTypeError(f"donate_unshared: shared must name objects by str; got {list(names)!r}.")
    if "donate_argnums" in jit_options or "donate_argnames" in jit_options:
        raise PayloadError("donate_unshared: it donates the session itself; do not pass donate_argnums.")
    static = jit_options.pop("static_argnums", ())
    static = (static,) if isinstance(static, int) else tuple(static)

    def inner(own: Session, held: dict[str, Any], *args: Any) -> Any:
        out = fn(own.with_objects(**held), *args)
        session, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        if not isinstance(session, Session):
            raise PayloadTypeError(
                "donate_unshared: fn must return a Session (or a tuple starting with one); "
                f"got {type(session).__name__}."
            )
        session = session.with_objects(**{name: session[name].reset() for name in names})
        return session if rest is None else (session, *rest)

    compiled = jax.jit(inner, donate_argnums=0, static_argnums=tuple(i + 1 for i in static), **jit_options)

    @functools.wraps(fn)
    def step(session: Session, *args: Any) -> Any:
        own, held = _split(session, names, "donate_unshared step")
        out = compiled(own, held, *args)
        if isinstance(out, tuple):
            return (out[0].with_objects(**held), *out[1:])
        return out.with_objects(**held)

    return step
