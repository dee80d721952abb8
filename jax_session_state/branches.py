"""Speculative branches: n lanes over one shared committed prefix.

World-model planners branch one state into many candidate futures, score
them, keep one and throw the rest away.  :meth:`Session.branch` gives ``n``
lanes whose writes go to small per-lane windows (a leading lane axis that
``jax.vmap`` maps over) while the committed prefix is stored once and read
once: memory grows with ``n x window``, not ``n x prefix``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> session = jss.Session(
  ...     objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=64)},
  ...     attrs={"rng": jax.random.key(0)},
  ... )
  >>> session = session.append(kv=(jnp.ones((1, 8, 1, 2)), jnp.ones((1, 8, 1, 2))))
  >>> branches = session.branch(4, window=16)
  >>> def guess(lane, scale):
  ...     rows = scale * jnp.ones((1, 2, 1, 2))
  ...     return lane.stage(kv=(rows, rows)), scale
  >>> branches, scores = branches.map(guess, jnp.arange(4.0))
  >>> best = branches.adopt(int(jnp.argmax(scores)))
  >>> best.view()["kv"].lengths
  Array([10], dtype=int32)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_session_state._core._validation import is_integer_scalar, positive_int
from jax_session_state.accounting import SeenStorages, add_bytes, tree_bytes_by_device
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import refuse_now_if
from jax_session_state.errors import CapacityError, PayloadError, PayloadTypeError

if TYPE_CHECKING:  # annotations only; at run time Session.branch imports this module
    from jax_session_state.session import Session

__all__ = ["Branches", "Lane", "branch"]


class Lane(struct.PyTreeNode):
    """One speculative lane: the shared prefix, this lane's windows and attrs.

    A lane only stages: its writes go to its windows, never to the prefix.

    Attributes:
      prefix: the committed session all lanes share.
      windows: per object name, this lane's window (objects lanes may write).
      attrs: this lane's attrs (RNG keys already split per lane).

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
      >>> session = jss.Session(objects={"kv": kv.append((jnp.ones((1, 3, 1, 2)),) * 2)})
      >>> lane = session.branch(2, window=4).lane(0)
      >>> lane = lane.stage(kv=(jnp.zeros((1, 1, 1, 2)),) * 2)  # into this lane's window only
      >>> type(lane.view()["kv"]).__name__, int(lane.view()["kv"].window.lengths[0])  # 3 shared + 1
      ('BranchKVView', 4)
      >>> int(lane.prefix.view()["kv"].lengths[0])  # the shared prefix is untouched
      3
    """

    prefix: Session
    windows: Mapping[str, StateObject]
    attrs: Mapping[str, Any]

    def stage(self, **payloads: Any) -> Lane:
        """Adds each payload to this lane's window of that object.

        A lane's writes accumulate: each is the next step of the lane's
        future, kept after the lane's earlier writes until
        :meth:`Branches.adopt` commits them all (the window keeps what the
        lane staged before, then stages the payload).
        """
        windows = dict(self.windows)
        for name, payload in payloads.items():
            if name not in windows:
                kind = self.prefix[name].describe()
                raise PayloadTypeError(
                    f"lanes cannot write {name!r} ({kind}): it is shared by all lanes. Write it "
                    "before branching, or after adopting a lane."
                )
            windows[name] = windows[name].commit().stage(payload)
        return self.replace(windows=windows)

    def discard(self) -> Lane:
        """Empties this lane's windows."""
        return self.replace(windows={name: w.discard() for name, w in self.windows.items()})

    def with_attrs(self, **attrs: Any) -> Lane:
        """This lane with these attrs replaced."""
        return self.replace(attrs={**self.attrs, **attrs})

    def view(self) -> dict[str, Any]:
        """Each object as this lane sees it: the prefix, then the lane's writes."""
        return {name: obj.branch_view(self.windows.get(name)) for name, obj in self.prefix.objects.items()}


class Branches(struct.PyTreeNode):
    """``lanes`` speculative lanes over one shared prefix.

    Attributes:
      prefix: the committed session, stored once.
      windows: per object name, the lanes' windows with a leading lane axis.
      attrs: the lanes' attrs with a leading lane axis.
      lanes: the number of lanes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=256)
      >>> session = jss.Session(objects={"kv": kv.append((jnp.ones((1, 200, 1, 2)),) * 2)})
      >>> branches = session.branch(8, window=4)
      >>> branches.lanes, branches.nbytes < 2 * session.nbytes  # 8 lanes, not 8 copies of the prefix
      (8, True)
      >>> branches.discard() is session
      True
    """

    prefix: Session
    windows: Mapping[str, StateObject]
    attrs: Mapping[str, Any]
    lanes: int = struct.field(pytree_node=False)

    def map(self, fn: Callable[..., Any], *xs: Any) -> Any:
        """Runs ``fn(lane, *x)`` on every lane under ``jax.vmap``.

        The prefix is closed over, not mapped: attention over it reads it once
        for all lanes.

        Args:
          fn: takes a :class:`Lane` and one lane's slice of each ``xs``;
            returns the new lane, or ``(lane, aux)``.
          *xs: arrays (pytrees) with a leading lane axis.

        Returns:
          The new branches, or ``(branches, aux)`` with aux stacked by lane.
        """
        has_aux = []

        def one(windows: Any, attrs: Any, *x: Any) -> Any:
            out = fn(Lane(prefix=self.prefix, windows=windows, attrs=attrs), *x)
            lane, aux = out if isinstance(out, tuple) else (out, None)
            has_aux.append(isinstance(out, tuple))
            return lane.windows, lane.attrs, aux

        windows, attrs, aux = jax.vmap(one)(self.windows, self.attrs, *xs)
        branches = self.replace(windows=windows, attrs=attrs)
        return (branches, aux) if has_aux[0] else branches

    def lane(self, index: int) -> Lane:
        """Lane ``index`` on its own (its windows and attrs sliced out).

        Raises:
          PayloadTypeError: ``index`` is not an integer scalar (a bool is not one).
          IndexError: a concrete ``index`` outside ``[0, lanes)``.
        """
        self._check_index(index, "lane")
        pick = lambda tree: jax.tree_util.tree_map(lambda x: x[index], tree)  # noqa: E731
        return Lane(prefix=self.prefix, windows=pick(self.windows), attrs=pick(self.attrs))

    def adopt(self, index: int | jax.Array) -> Session:
        """The session with lane ``index``'s writes committed; the other lanes are dropped.

        Under ``jit`` ``index`` may be traced; an out-of-range traced index
        adopts nothing (the prefix comes back unchanged).  A lane whose
        writes were refused (they did not fit its window) passes the refusal
        on: under ``jit`` the adopted object's ``overflowed`` flag is set, so
        :func:`~jax_session_state.check` reports the lost rows; eagerly
        nothing is adopted and :class:`CapacityError` is raised.

        Raises:
          PayloadTypeError: ``index`` is not an integer scalar (a bool is not one).
          IndexError: a concrete ``index`` outside ``[0, lanes)``.
          CapacityError: eagerly, a write of lane ``index`` was refused.
        """
        self._check_index(index, "adopt")
        in_range = (index >= 0) & (index < self.lanes)
        lane = self.lane(jnp.clip(index, 0, self.lanes - 1))
        self._refuse_lost_writes(lane, index)
        session = self.prefix.discard()
        objects = dict(session.objects)
        for name, window in lane.windows.items():
            # An out-of-range lane contributes an empty window: nothing is written, nothing was refused.
            window = jax.tree_util.tree_map(lambda w, e: jnp.where(in_range, w, e), window, window.empty())
            objects[name] = objects[name].commit_window(window)
        attrs = dict(session.attrs)
        for name, value in lane.attrs.items():
            kept = attrs.get(name, value)
            attrs[name] = jax.tree_util.tree_map(lambda a, p: jnp.where(in_range, a, p), value, kept)
        return session.replace(objects=objects, attrs=attrs)

    def discard(self) -> Session:
        """Drops every lane; the prefix session comes back as it was."""
        return self.prefix

    def nbytes_by_device(self, seen: SeenStorages | None = None) -> dict[str, int]:
        """Bytes of the prefix (once) and of every lane's windows and attrs."""
        seen = SeenStorages() if seen is None else seen
        total = self.prefix.nbytes_by_device(seen)
        for window in self.windows.values():
            add_bytes(total, window.nbytes_by_device(seen))
        return add_bytes(total, tree_bytes_by_device(self.attrs, seen))

    @property
    def nbytes(self) -> int:
        """Total bytes, all devices together (for reporting only)."""
        return sum(self.nbytes_by_device().values())

    def _refuse_lost_writes(self, lane: Lane, index: int | jax.Array) -> None:
        """Raises at once when a window of ``lane`` (concrete: not under ``jit``) refused a write."""
        for name, window in lane.windows.items():
            refuse_now_if(
                window.overflowed,
                lambda name=name, window=window: CapacityError(
                    f"Branches.adopt: a write of lane {int(index)} to {name!r} ({self.prefix[name].describe()}) "
                    f"was refused: it did not fit the lane's window of {window.capacity} entries "
                    f"({window.describe()}), which holds {np.asarray(window.committed + window.staged).tolist()}; "
                    "adopting the lane would lose that write, so nothing was adopted. Branch with a larger window "
                    f"for {name!r}, or adopt another lane."
                ),
            )

    def _check_index(self, index: Any, operation: str) -> None:
        if not is_integer_scalar(index):  # a bool is not one: x[True] would add an axis, not pick lane 1
            raise PayloadTypeError(f"Branches.{operation}: index must be an integer scalar; got {index!r}.")
        if isinstance(index, jax.core.Tracer):
            return
        if not 0 <= int(index) < self.lanes:
            raise IndexError(f"lane {int(index)} is out of range: these branches have lanes 0..{self.lanes - 1}.")


def _split_attr(value: Any, lanes: int) -> Any:
    """A typed PRNG key splits into one key per lane; anything else is copied per lane."""
    if isinstance(value, (jax.Array, np.ndarray)) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.split(value, lanes)
    return jnp.broadcast_to(value, (lanes, *jnp.shape(value)))


def branch(session: Session, lanes: int, *, window: int | Mapping[str, int] | None = None) -> Branches:
    """``lanes`` speculative lanes over ``session``'s committed data: what :meth:`Session.branch` calls.

    Arguments, result and errors as :meth:`~jax_session_state.Session.branch`
    says: ``session`` must hold no staged data (under ``jit`` this cannot be
    checked: lanes then read the committed data only), and ``window`` gives
    the entries one lane may write, per object name or one number for all.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.branches import branch
      >>> session = jss.Session(objects={"kv": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)})
      >>> branch(session, 3, window=2).lanes  # what session.branch(3, window=2) calls
      3
      >>> try:
      ...     branch(session.stage(kv=(jnp.ones((1, 1, 1, 2)),) * 2), 3, window=2)
      ... except ValueError as error:
      ...     print(error)
      cannot branch a session with staged data in ['kv']: lanes share only committed data. Commit
      or discard it first.
    """
    lanes = positive_int("branch()", "lanes", lanes)
    staged = session.staged_names()
    if staged:
        raise PayloadError(
            f"cannot branch a session with staged data in {staged}: lanes share only committed "
            "data. Commit or discard it first."
        )
    sizes = window if isinstance(window, Mapping) else {name: window for name in session.objects}
    windows = {}
    for name, obj in session.objects.items():
        one = obj.branch_window(sizes.get(name))
        if one is not None:
            windows[name] = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (lanes, *x.shape)).copy(), one)
    attrs = jax.tree_util.tree_map(lambda x: _split_attr(x, lanes), dict(session.attrs))
    return Branches(prefix=session, windows=windows, attrs=attrs, lanes=lanes)
