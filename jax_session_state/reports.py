"""``summary``: a readable table of every object in a session (or many).

Example:
  >>> import jax_session_state as jss
  >>> session = jss.Session(objects={
  ...     "kv": jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=4, capacity=16),
  ...     "carry": jss.FixedState.allocate(shapes=(1, 8)),
  ... })
  >>> print(jss.summary(session))
  name   kind        shapes         dtype    committed  staged  capacity  resident  recompute  cpu:0 bytes
  -----  ----------  -------------  -------  ---------  ------  --------  --------  ---------  -----------
  carry  FixedState  [1, 8]         float32  1          0       1         yes       -          65 B
  kv     KVCache     [1, 2, 16, 4]  float32  [0]        [0]     16        yes       -          1.0 KiB
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jax_session_state.accounting import SeenStorages, tree_bytes_by_device, tree_storages
from jax_session_state.base import StateObject
from jax_session_state.errors import PayloadTypeError
from jax_session_state.manager import Held, SessionStateManager
from jax_session_state.session import Session

__all__ = ["Summary", "summary"]

_FIXED_COLUMNS = [
    "name", "kind", "shapes", "dtype", "committed", "staged", "capacity", "margin", "resident", "recompute",
]


class Summary:
    """Rows describing state objects; prints as plain text, rich, or HTML.

    The rows hold numbers (entries per batch row, bytes per device key); the
    printed table reads without a glossary: ``committed`` says how many
    entries are kept and, for a ring that has seen more, how many it has
    seen; ``capacity`` adds a ring's staging slots (``+ 4 staging``); the
    byte columns are headed ``<device key> bytes`` and written in B, KiB,
    MiB or GiB.

    Attributes:
      rows: one dict per object (and one per session's attrs), keyed by column.
      columns: the column names, device keys last.

    Example:
      >>> import jax_session_state as jss
      >>> table = jss.summary(jss.FixedState.allocate(shapes=(2,)))
      >>> table.columns[-1], [(row["kind"], row["shapes"], row["cpu:0"]) for row in table.rows]
      ('cpu:0', [('FixedState', '[2]', 17)])
      >>> table._repr_html_()[:31]  # what a notebook shows
      '<table><thead><tr><th>name</th>'
    """

    def __init__(self, rows: list[dict[str, Any]], columns: list[str]):
        self.rows = rows
        self.columns = columns

    def _shown(self) -> list[str]:
        """The printed columns: the margin goes into ``capacity``'s cell."""
        return [column for column in self.columns if column != "margin"]

    def _headers(self) -> list[str]:
        return [f"{column} bytes" if _is_device_key(column) else column for column in self._shown()]

    def _cells(self) -> list[list[str]]:
        return [[_cell(row, column) for column in self._shown()] for row in self.rows]

    def __str__(self) -> str:
        cells, headers = self._cells(), self._headers()
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(headers)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(headers, widths)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
        return "\n".join(lines)

    __repr__ = __str__

    def __rich__(self) -> Any:
        from rich.table import Table  # rich ships with flax

        table = Table(title="session state")
        for column, header in zip(self._shown(), self._headers()):
            table.add_column(header, justify="right" if _is_device_key(column) else "left")
        for row in self._cells():
            table.add_row(*row)
        return table

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._headers())
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in self._cells()
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def print(self) -> None:
        """Prints with rich when it can, as plain text otherwise."""
        try:
            from rich.console import Console
        except ImportError:
            print(self)
        else:
            Console().print(self)


def _is_device_key(column: str) -> bool:
    return ":" in column or column == "host"


def _cell(row: Mapping[str, Any], column: str) -> str:
    """What the printed table shows of ``row[column]``."""
    value = row.get(column, "")
    if _is_device_key(column) and isinstance(value, int):
        return _bytes(value)
    if column == "committed" and row.get("ring") and isinstance(row.get("capacity"), int):
        return _committed(value, row["capacity"])
    if column == "capacity" and row.get("margin"):
        return f"{value} + {row['margin']} staging"
    return _text(value)


def _committed(value: Any, capacity: int) -> str:
    """Entries committed; where a ring has seen more than it keeps, how many it keeps of how many seen."""
    counts = value if isinstance(value, list) else [value]
    if not all(isinstance(n, int) for n in counts) or max(counts, default=0) <= capacity:
        return _text(value)
    kept = [f"{min(n, capacity)} of {n} seen" for n in counts]
    return f"[{', '.join(kept)}]" if isinstance(value, list) else kept[0]


def _bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _data_leaves(obj: StateObject) -> list[jax.ShapeDtypeStruct]:
    """The shape and dtype of every leaf of the object's data (not its bookkeeping)."""
    shapes = obj.storage_shapes()
    return [leaf for field in obj.data_fields for leaf in jax.tree_util.tree_leaves(shapes[field])]


def _shapes(obj: StateObject) -> str:
    """The shapes of the object's data storage, compactly (one entry per distinct shape)."""
    shapes = dict.fromkeys(str(list(leaf.shape)) for leaf in _data_leaves(obj))
    return ", ".join(shapes) or "-"


def _dtype(obj: StateObject) -> str:
    return ", ".join(sorted({np.dtype(leaf.dtype).name for leaf in _data_leaves(obj)})) or "-"


def object_row(name: str, obj: StateObject, seen: SeenStorages) -> dict[str, Any]:
    """One summary row: what the object is, how full, where its bytes are."""
    fill = obj.fill()
    return {
        "name": name,
        "kind": type(obj).__name__,
        "shapes": _shapes(obj),
        "dtype": _dtype(obj),
        "committed": fill.committed,
        "staged": fill.staged,
        "capacity": fill.capacity,
        "margin": fill.margin,
        "ring": getattr(obj, "window", None) is not None or getattr(obj, "ring", False) is True,
        "resident": obj.resident,
        "recompute": ", ".join(obj.recompute_source) or None,
        **obj.nbytes_by_device(seen),
    }


def session_rows(session: Session, seen: SeenStorages, extra: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """A row per object of ``session`` (sorted by name) and one for its attrs, each with ``extra``."""
    extra = extra or {}
    rows = [{**extra, **object_row(name, session[name], seen)} for name in sorted(session.objects)]
    return rows + _attrs_rows(session, seen, extra)


def _attrs_rows(session: Session, seen: SeenStorages, extra: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not session.attrs:
        return []
    attrs_bytes = tree_bytes_by_device(session.attrs, seen)
    shapes = ", ".join(sorted(session.attrs))
    return [{**extra, "name": "attrs", "kind": "attrs", "shapes": shapes, **attrs_bytes}]


def held_rows(session_id: Any, held: Held, seen: SeenStorages) -> list[dict[str, Any]]:
    """A row per object of a session a manager holds, saying how it is held, and one for its attrs."""
    extra = {"session": session_id}
    if held.donated:  # a step in progress donated its arrays: there is nothing to read
        return [{**extra, "held": "in use (donated)", "name": name, "kind": type(obj).__name__}
                for name, obj in sorted(held.session.objects.items())]
    rows = []
    for name in sorted(held.session.objects):
        if name in held.parked:
            row = object_row(name, held.parked[name].obj, seen)
            state = "parked"
        else:
            row = object_row(name, held.session[name], seen)
            state = "evicted" if name in held.evicted else "resident"
        rows.append({**extra, "held": state, **row})
    return rows + _attrs_rows(held.session, seen, extra)


def _mark_shared(rows: list[dict[str, Any]], helds: Mapping[Any, Held]) -> bool:
    """Sets ``shared`` ("N sessions") on the rows of objects holding a buffer other held sessions hold too (a
    conditioning shared by content, say); whether any row is shared."""
    held_storages = {
        (session_id, name): set(tree_storages(held.parked[name].obj if name in held.parked else obj))
        for session_id, held in helds.items() if not held.donated
        for name, obj in held.session.objects.items()
    }
    holders: dict[Any, set[Any]] = {}
    for (session_id, _), storages in held_storages.items():
        for storage in storages:
            holders.setdefault(storage, set()).add(session_id)
    marked = False
    for row in rows:
        storages = held_storages.get((row.get("session"), row.get("name")), ())
        sharing = max((len(holders[s]) for s in storages), default=1)
        if sharing > 1:
            row["shared"], marked = f"{sharing} sessions", True
    return marked


def summary(tree: StateObject | Session | SessionStateManager | Mapping[Any, Any]) -> Summary:
    """A table of every object in ``tree``.

    Args:
      tree: a state object, a :class:`Session`, a
        :class:`~jax_session_state.SessionStateManager` (every session it
        holds, least recently used first, with a ``held`` column: resident,
        parked or evicted, and a ``shared`` column where held sessions read
        one buffer, saying by how many; nothing is brought back), or a mapping of names /
        session ids to sessions or objects.  Bytes are de-duplicated across
        everything shown.

    With several JAX processes each process reports what it holds, without
    waiting for the others: a first ``process`` column ("1 of 4"), the
    bytes on its own devices, and counts of the rows its devices hold
    (None for rows on other processes' devices).

    Returns:
      A :class:`Summary`: ``print()`` it as plain text, give it to rich, or
      let a notebook render its HTML.

    Example:
      >>> import jax_session_state as jss
      >>> manager = jss.SessionStateManager()
      >>> manager.create("user", jss.Session(objects={"h": jss.FixedState.allocate(shapes=(2,))}))
      >>> print(jss.summary(manager))
      session  held      name  kind        shapes  dtype    committed  staged  capacity  resident  recompute  cpu:0 bytes
      -------  --------  ----  ----------  ------  -------  ---------  ------  --------  --------  ---------  -----------
      user     resident  h     FixedState  [2]     float32  1          0       1         yes       -          17 B
    """  # noqa: E501 - a doctest's expected table: its rows cannot be wrapped
    seen = SeenStorages()
    if isinstance(tree, StateObject):
        rows = [object_row(type(tree).__name__, tree, seen)]
        columns = list(_FIXED_COLUMNS)
    elif isinstance(tree, Session):
        rows = session_rows(tree, seen)
        columns = list(_FIXED_COLUMNS)
    elif isinstance(tree, SessionStateManager):
        helds = tree.held()
        rows = [row for session_id, held in helds.items() for row in held_rows(session_id, held, seen)]
        columns = ["session", "held", *(["shared"] if _mark_shared(rows, helds) else []), *_FIXED_COLUMNS]
    elif isinstance(tree, Mapping):
        rows = []
        for key, item in tree.items():
            if isinstance(item, Session):
                rows += session_rows(item, seen, {"session": key})
            elif isinstance(item, StateObject):
                rows.append(object_row(str(key), item, seen))
            else:
                raise PayloadTypeError(
                    f"summary() shows sessions and state objects; {key!r} is a {type(item).__name__}."
                )
        columns = (["session"] if any("session" in r for r in rows) else []) + list(_FIXED_COLUMNS)
    else:
        raise PayloadTypeError(
            f"summary() takes a state object, a Session, a SessionStateManager or a mapping of them; "
            f"got {type(tree).__name__}."
        )
    device_keys = sorted({key for row in rows for key in row if _is_device_key(key)})
    if jax.process_count() > 1:  # each process reports its own devices' bytes and the counts it holds
        here = f"{jax.process_index()} of {jax.process_count()}"
        rows, columns = [{"process": here, **row} for row in rows], ["process", *columns]
    return Summary(rows, columns + device_keys)
