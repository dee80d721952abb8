"""``Session``: the named state objects of one rollout plus carried attrs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np
from flax import struct

from jax_session_state.accounting import SeenStorages, add_bytes, tree_bytes_by_device
from jax_session_state.base import StateObject
from jax_session_state.errors import PayloadError, PayloadTypeError, RecomputeGraphError

if TYPE_CHECKING:
    from jax_session_state.branches import Branches

__all__ = ["Session"]

T = TypeVar("T")


class Session(struct.PyTreeNode):
    """A pytree of named state objects plus ``attrs``.

    ``attrs`` are carried values the manager counts but never acts on (RNG
    keys, counters, small conditioning arrays).  The lifecycle fans out to
    every object; byte figures de-duplicate across objects and attrs.  The
    recompute graph (each object's ``recompute_source``) is validated on
    construction and on every ``replace``: every source must exist and there
    must be no cycle.

    Attributes:
      objects: the state objects by name (non-empty strings): each a
        :class:`~jax_session_state.base.StateObject` the manager may evict,
        demote or park.
      attrs: carried values by name, any pytrees (counted in byte figures,
        never acted on); empty by default.

    Raises:
      PayloadTypeError: ``objects`` or ``attrs`` is not a mapping, or an
        object name is not a str.
      PayloadError: an object name is the empty string.
      RecomputeGraphError: a recompute source is missing, or the sources
        form a cycle.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> session = jss.Session(
      ...     objects={
      ...         "kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=16),
      ...         "carry": jss.FixedState.allocate(shapes=(1, 8)),
      ...     },
      ...     attrs={"rng": jax.random.key(0)},
      ... )
      >>> rows = jnp.ones((1, 4, 2, 4))
      >>> session = session.stage(kv=(rows, rows), carry=jnp.ones((1, 8))).commit()
      >>> session.view()["kv"].lengths
      Array([4], dtype=int32)
    """

    objects: Mapping[str, StateObject]
    attrs: Mapping[str, Any] = struct.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.objects, Mapping) or not isinstance(self.attrs, Mapping):
            raise PayloadTypeError("Session(objects=..., attrs=...) takes two mappings from names.")
        object.__setattr__(self, "objects", dict(self.objects))
        object.__setattr__(self, "attrs", dict(self.attrs))
        for name in self.objects:
            if not isinstance(name, str):
                raise PayloadTypeError(f"Session object names must be non-empty strings; got {name!r}.")
            if not name:
                raise PayloadError(f"Session object names must be non-empty strings; got {name!r}.")
        _validate_recompute_graph(
            tuple((name, getattr(obj, "recompute_source", ())) for name, obj in self.objects.items())
        )

    # ----------------------------------------------------------- mapping
    def __getitem__(self, name: str) -> StateObject:
        self._require_objects([name])
        return self.objects[name]

    def _require_objects(self, names: Iterable[str]) -> None:
        """Raises ``KeyError`` for the first of ``names`` that names no object of this session."""
        for name in names:
            if name not in self.objects:
                raise KeyError(f"no object {name!r} in this session; it holds {sorted(self.objects)}.")

    def __contains__(self, name: object) -> bool:
        return name in self.objects

    def __iter__(self) -> Iterator[str]:
        return iter(self.objects)

    def __len__(self) -> int:
        return len(self.objects)

    def with_objects(self, **objects: StateObject) -> Session:
        """A session with these objects added or replaced."""
        return self.replace(objects={**self.objects, **objects})

    def with_attrs(self, **attrs: Any) -> Session:
        """A session with these attrs added or replaced."""
        return self.replace(attrs={**self.attrs, **attrs})

    # ---------------------------------------------------------- lifecycle
    def _map(self, method: Callable[[str, StateObject], StateObject], names: Any) -> Session:
        objects = dict(self.objects)
        for name in names:
            obj = self[name]
            try:
                objects[name] = method(name, obj)
            except Exception as error:
                raise _with_name(error, name) from error
        return self.replace(objects=objects)

    def stage(self, **payloads: Any) -> Session:
        """Stages each payload into the object of that name, replacing what it had staged."""
        return self._map(lambda name, obj: obj.stage(payloads[name]), payloads)

    def commit(self, **payloads: Any) -> Session:
        """Commits the session's window.

        Objects named in ``payloads`` commit that payload (in place of anything
        they have staged); every other object promotes what it has staged.

        Raises:
          KeyError: a payload names no object of this session (nothing is committed).
        """
        self._require_objects(payloads)
        return self._map(lambda name, obj: obj.commit(payloads.get(name)), self.objects)

    def append(self, **payloads: Any) -> Session:
        """Appends each payload to the object of that name; others are untouched."""
        return self._map(lambda name, obj: obj.append(payloads[name]), payloads)

    def discard(self) -> Session:
        """Drops what every object has staged."""
        return self._map(lambda name, obj: obj.discard(), self.objects)

    def view(self, *, include_staged: bool = True) -> dict[str, Any]:
        """Each object's view, by name.

        Args:
          include_staged: whether the views show what is staged (after the
            committed data) as well; False: committed data only.

        Returns:
          ``{name: view}``, each what that object's ``view()`` returns.
        """
        views = {}
        for name, obj in self.objects.items():
            try:
                views[name] = obj.view(include_staged=include_staged)
            except Exception as error:
                raise _with_name(error, name) from error
        return views

    # ---------------------------------------------------------- accounting
    def nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes of objects and attrs by device key; a shared buffer counts once."""
        seen = SeenStorages() if seen is None else seen
        total: dict[str, int] = {}
        for obj in self.objects.values():
            add_bytes(total, obj.nbytes_by_device(seen))
        return add_bytes(total, tree_bytes_by_device(self.attrs, seen))

    def staged_nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes held only for staged data, by device key."""
        seen = SeenStorages() if seen is None else seen
        total: dict[str, int] = {}
        for obj in self.objects.values():
            add_bytes(total, obj.staged_nbytes_by_device(seen))
        return total

    @property
    def nbytes(self) -> int:
        """Total bytes, all devices together (for reporting only)."""
        return sum(self.nbytes_by_device().values())

    # ----------------------------------------------------- recompute graph
    def recomputable(self, name: str) -> bool:
        """Whether ``name`` could be recomputed now: it has sources and all are resident.

        Args:
          name: an object of this session.

        Raises:
          KeyError: the session holds no object ``name``.
        """
        sources = self[name].recompute_source
        return bool(sources) and all(self.objects[source].resident for source in sources)

    # --------------------------------------------------------------- forks
    def fork(self) -> Session:
        """An independent deep copy (new buffers); safe to donate either side.

        Example:
          >>> import jax
          >>> import jax_session_state as jss
          >>> session = jss.Session(objects={"carry": jss.FixedState.allocate(shapes=(2,))})
          >>> copy = session.fork()
          >>> step = jax.jit(lambda s: s.commit(carry=s.view()["carry"] + 1), donate_argnums=0)
          >>> stepped = step(session)  # donates the original's buffers, not the copy's
          >>> copy.view()["carry"], stepped.view()["carry"]
          (Array([0., 0.], dtype=float32), Array([1., 1.], dtype=float32))
        """
        return jax.tree_util.tree_map(_copy_leaf, self)

    def branch(self, lanes: int, *, window: int | Mapping[str, int] | None = None) -> Branches:
        """``lanes`` speculative lanes over this session's committed data.

        See :func:`jax_session_state.branches.branch`.

        Args:
          lanes: how many lanes.
          window: entries one lane may write (K/V rows, latent items), per
            object name or one number for all; kinds that replace their
            value need none.

        Returns:
          The :class:`~jax_session_state.branches.Branches`.

        Raises:
          PayloadTypeError: ``lanes`` is not an int (a bool is not one).
          PayloadError: the session holds staged data, or ``lanes`` < 1.

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_session_state as jss
          >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
          >>> session = jss.Session(objects={"kv": kv.append((jnp.ones((1, 3, 1, 2)),) * 2)})
          >>> def guess(lane, x):  # each lane stages 2 rows into its own window
          ...     rows = jnp.full((1, 2, 1, 2), x)
          ...     return lane.stage(kv=(rows, rows)), x
          >>> branches, _ = session.branch(2, window=4).map(guess, jnp.arange(2.0))
          >>> branches.adopt(1).view()["kv"].lengths, session.view()["kv"].lengths
          (Array([5], dtype=int32), Array([3], dtype=int32))
        """
        from jax_session_state.branches import branch  # branches builds on sessions

        return branch(self, lanes, window=window)

    def staged_names(self) -> list[str]:
        """Names of the objects holding staged data (none can be told under jit)."""
        names = []
        for name, obj in self.objects.items():
            held = obj.holds_staged()
            if not isinstance(held, jax.core.Tracer) and bool(held):
                names.append(name)
        return names


def _copy_leaf(x: T) -> T:
    return x.copy() if isinstance(x, (jax.Array, np.ndarray)) else x


def _with_name(error: Exception, name: str) -> Exception:
    """The same kind of error, its message prefixed with the object's name."""
    try:
        return type(error)(f"session object {name!r}: {error}")
    except Exception:  # an exception type with another constructor: keep it as is
        return error


@functools.lru_cache(maxsize=256)
def _validate_recompute_graph(edges: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    """Raises RecomputeGraphError for a missing source or a cycle.

    Args:
      edges: each object's name and the names it can be recomputed from.  The
        graph is static, so a session made anew with the same structure (every
        jitted step's output) is checked once; errors are not cached.
    """
    sources = dict(edges)
    for name, names in sources.items():
        for source in names:
            if source not in sources:
                raise RecomputeGraphError(
                    f"recompute source {source!r} of {name!r} is not in this session; "
                    f"it holds {sorted(sources)}. Add it, or allocate {name!r} without it."
                )
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            raise RecomputeGraphError(
                f"recompute sources form a cycle: {' -> '.join(cycle)}. An object "
                "cannot be recomputed from itself; drop one of these edges."
            )
        if node not in done:
            for source in sources.get(node, ()):
                visit(source, [*path, node])
            done.add(node)

    for name in sources:
        visit(name, [])
