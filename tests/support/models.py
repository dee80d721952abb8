"""Plain-Python reference models of each kind, and a driver that checks a kind against one.

A model applies the same operations to host lists and says what the
object's logical view must be after each; the driver runs the operations on
the real object (jitted or eagerly) and compares after every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.testing import logical

OK, REFUSED_CAPACITY, REFUSED_COUNTS = "ok", "capacity", "counts"


@dataclasses.dataclass
class Op:
    """One lifecycle call: ``name`` in stage / commit / commit_payload / append / discard."""

    name: str
    payload: Any = None


def call(obj: jss.StateObject, op: Op) -> jss.StateObject:
    if op.name == "stage":
        return obj.stage(op.payload)
    if op.name == "commit":
        return obj.commit()
    if op.name == "commit_payload":
        return obj.commit(op.payload)
    if op.name == "append":
        return obj.append(op.payload)
    if op.name == "discard":
        return obj.discard()
    raise ValueError(op.name)


# One function per operation, so every test's jitted variant of it shares one compiled program per shape.
_BY_NAME = {
    name: (lambda o, p, name=name: call(o, Op(name, p)))
    for name in ("stage", "commit", "commit_payload", "append", "discard")
}


def drive(obj: jss.StateObject, model: Any, ops: list[Op], variant: Any) -> None:
    """Runs ``ops`` on ``obj`` and ``model``; the views must agree after every step.

    ``variant`` is a ``chex.variants`` test's ``self.variant`` (jitted or
    not).  Eagerly a refused write raises (CapacityError, or ValueError for
    bad counts) and leaves the object as it was; under jit it writes nothing
    and sets ``overflowed``.
    """
    jit = variant.type == chex.ChexVariantType.WITH_JIT
    steps = {name: variant(fn) for name, fn in _BY_NAME.items()}
    for i, op in enumerate(ops):
        outcome = model.apply(op)
        if outcome != OK and not jit:
            error = jss.CapacityError if outcome == REFUSED_CAPACITY else ValueError
            with pytest.raises(error, match=type(obj).__name__):
                call(obj, op)
        else:
            obj = steps[op.name](obj, op.payload)
            if outcome != OK:
                model.overflowed = True
        where = f"after op {i} {op.name} ({'jit' if jit else 'eager'})"
        if obj.can_overflow:
            assert bool(obj.overflowed) == model.overflowed, where
        for include_staged in (True, False):
            got = logical(obj.view(include_staged=include_staged))
            want = model.view(include_staged)
            _assert_tree_equal(got, want, f"{where}, include_staged={include_staged}")
    if obj.can_overflow and model.overflowed:
        with pytest.raises(jss.CapacityError):
            jss.check({"obj": obj})
    else:
        jss.check({"obj": obj})


def _assert_tree_equal(got: Any, want: Any, where: str) -> None:
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"{where}: {got_tree} != {want_tree}"
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=where)


class KVModel:
    """Per batch row, a list of (k, v) rows by position; committed then staged."""

    def __init__(self, batch: int, *, capacity: int | None = None, window: int | None = None,
                 sink: int = 0, max_staged: int | None = None, heads: int, head_dim: int):
        self.capacity, self.window, self.sink, self.max_staged = capacity, window, sink, max_staged
        self.rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(batch)]
        self.committed = [0] * batch
        self.high_water = [0] * batch  # one past the largest position ever written, discarded or not
        self.overflowed = False
        self.heads, self.head_dim = heads, head_dim

    def _write(self, chunk: jss.KVChunk, committing: bool) -> str:
        """A ring takes a chunk of any length when it is committed at once (a prefill), at most
        ``max_staged`` rows to stage."""
        k, v = np.asarray(chunk.k), np.asarray(chunk.v)
        T = k.shape[1]
        counts = [T] * len(self.rows) if chunk.counts is None else list(np.asarray(chunk.counts))
        if any(c < 0 or c > T for c in counts):
            return REFUSED_COUNTS
        for c, committed in zip(counts, self.committed):
            if self.window is None:
                room = self.capacity - committed
            else:
                room = T if committing else self.max_staged
            if c > room:
                return REFUSED_CAPACITY
        for b, c in enumerate(counts):  # a write replaces what was staged
            self.rows[b] = self.rows[b][:self.committed[b]] + [(k[b, t], v[b, t]) for t in range(c)]
            self.high_water[b] = max(self.high_water[b], len(self.rows[b]))
        return OK

    def apply(self, op: Op) -> str:
        if op.name in ("stage", "commit_payload", "append"):
            outcome = self._write(op.payload, committing=op.name != "stage")
            if outcome != OK or op.name == "stage":
                return outcome
        if op.name == "discard":
            self.rows = [rows[:c] for rows, c in zip(self.rows, self.committed)]
        else:
            self.committed = [len(rows) for rows in self.rows]
        return OK

    def view(self, include_staged: bool) -> list[dict[str, np.ndarray]]:
        out = []
        for rows, committed, high_water in zip(self.rows, self.committed, self.high_water):
            end = len(rows) if include_staged else committed
            if self.window is None:
                start = 0
            elif include_staged:  # everything the ring still holds
                start = high_water - (self.window + self.max_staged)
            else:  # the committed window
                start = committed - self.window
            shown = [p for p in range(end) if p < self.sink or p >= start]
            out.append({
                "positions": np.asarray(shown, np.int32),
                "k": np.asarray([rows[p][0] for p in shown], np.float32).reshape(-1, self.heads, self.head_dim),
                "v": np.asarray([rows[p][1] for p in shown], np.float32).reshape(-1, self.heads, self.head_dim),
            })
        return out


class ItemModel:
    """A sequence of items (pytrees); the last ``capacity`` are visible."""

    def __init__(self, *, capacity: int, ring: bool, max_staged: int = 0, single_rank: int | None = None):
        self.capacity, self.ring, self.max_staged = capacity, ring, max_staged
        self.single_rank = single_rank  # rank of one item's first leaf, to tell one item from a batch
        self.items: list[Any] = []
        self.committed = 0
        self.overflowed = False

    def _split(self, payload: Any) -> list[Any]:
        leaves, treedef = jax.tree_util.tree_flatten(payload)
        leaves = [np.asarray(x) for x in leaves]
        if self.single_rank is not None and leaves[0].ndim == self.single_rank:
            return [treedef.unflatten(leaves)]
        return [treedef.unflatten([x[i] for x in leaves]) for i in range(leaves[0].shape[0])]

    def apply(self, op: Op) -> str:
        if op.name in ("stage", "commit_payload", "append"):
            new = self._split(op.payload)
            if not self.ring and self.committed + len(new) > self.capacity:
                return REFUSED_CAPACITY
            if self.ring and op.name == "stage" and len(new) > self.max_staged:
                return REFUSED_CAPACITY
            self.items[self.committed:] = new  # a write replaces what was staged
            if op.name == "stage":
                return OK
        if op.name == "discard":
            del self.items[self.committed:]
        else:
            self.committed = len(self.items)
        return OK

    def visible(self, include_staged: bool) -> list[Any]:
        end = len(self.items) if include_staged else self.committed
        return self.items[max(0, end - self.capacity):end]
