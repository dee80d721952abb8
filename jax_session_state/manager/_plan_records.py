"""The planner's records: what it reads (object and session usage) and what it returns (actions, plans, refusals).

Immutable dataclasses over byte figures; :mod:`jax_session_state.manager.planner`
exports them and documents how they are used.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Hashable, Mapping
from typing import Literal

import numpy as np

from jax_session_state._core._validation import non_negative
from jax_session_state.errors import PayloadError, PayloadTypeError

ObjectState = Literal["resident", "evicted", "parked"]


def byte_counts(
    owner: str, field: str, bytes_by_device: Mapping[str, int], *, keep_zeros: bool = False
) -> Mapping[str, int]:
    """``bytes_by_device`` as a read-only mapping of ints (keys with 0 bytes left out unless ``keep_zeros``);
    else raises naming it.

    Raises:
      PayloadTypeError: a count is not an int (a bool, a float such as 1.5,
        NaN or inf is not one).
      PayloadError: a count is below 0.
    """
    wrong = {
        key: count
        for key, count in bytes_by_device.items()
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer))
    }
    if wrong:
        raise PayloadTypeError(f"{owner}: {field} must map device keys to byte counts (ints >= 0); got {wrong}.")
    negative = {key: count for key, count in bytes_by_device.items() if count < 0}
    if negative:
        raise PayloadError(f"{owner}: {field} must map device keys to byte counts >= 0; got {negative}.")
    return types.MappingProxyType({k: int(b) for k, b in bytes_by_device.items() if b or keep_zeros})


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectUsage:
    """Byte figures of one named object of a session.

    Attributes:
      name: object name, unique within its session.
      bytes_by_device: bytes per device key where the storage is now; for a
        parked object that is under the pinned_host keys, for an evicted object
        where a recompute would put it (not counted as usage).
      state: ``"resident"``, ``"evicted"`` or ``"parked"``.
      sources: names of sibling objects the object is recomputed from.
      recompute_cost: estimated work to recompute the object, >= 0.
      recomputable: whether a recompute function is registered for the object.
      demoted_bytes_by_device: bytes per device key the object would hold
        once demoted to its next lower tier; None when it has none.
      parkable: whether parking the object moves exactly its
        ``bytes_by_device`` (False for one that shares storage with another
        object, which a park would copy without freeing it).

    Raises:
      PayloadTypeError: a byte count is not an int (a bool, 1.5, NaN or inf
        is not one), or ``recompute_cost`` is not a number.
      PayloadError: a byte count or ``recompute_cost`` is below 0, or
        ``state`` is not one of the three.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage
      >>> kv = ObjectUsage("kv", {"cpu:0": 1000, "cpu:1": 0}, demoted_bytes_by_device={"cpu:0": 270})
      >>> dict(kv.bytes_by_device), kv.demotion_frees  # keys with no bytes are dropped
      ({'cpu:0': 1000}, {'cpu:0': 730})
    """

    name: str
    bytes_by_device: Mapping[str, int]
    state: ObjectState = "resident"
    sources: tuple[str, ...] = ()
    recompute_cost: float = 0.0
    recomputable: bool = False
    demoted_bytes_by_device: Mapping[str, int] | None = None
    parkable: bool = True

    def __post_init__(self) -> None:
        if self.state not in ("resident", "evicted", "parked"):
            raise PayloadError(
                f"ObjectUsage {self.name!r}: state must be 'resident', 'evicted' or 'parked'; got {self.state!r}."
            )
        owner = f"ObjectUsage {self.name!r}"
        non_negative(owner, "recompute_cost", self.recompute_cost)
        object.__setattr__(self, "bytes_by_device", byte_counts(owner, "bytes_by_device", self.bytes_by_device))
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.demoted_bytes_by_device is not None:
            demoted = byte_counts(owner, "demoted_bytes_by_device", self.demoted_bytes_by_device)
            object.__setattr__(self, "demoted_bytes_by_device", demoted)

    @property
    def demotion_frees(self) -> dict[str, int]:
        """Bytes per device key a demotion frees (empty when it frees none)."""
        if self.demoted_bytes_by_device is None:
            return {}
        after = self.demoted_bytes_by_device
        freed = {k: b - after.get(k, 0) for k, b in self.bytes_by_device.items()}
        return {k: b for k, b in freed.items() if b > 0}


@dataclasses.dataclass(frozen=True, slots=True)
class SessionUsage:
    """Byte figures of one session.

    Attributes:
      session_id: any hashable id, unique among the sessions planned over.
      objects: the session's objects.
      last_used: recency tick; larger is more recent.
      pinned: pinned sessions are never touched.
      attrs_bytes_by_device: bytes of carried values that are never evicted
        or parked individually.

    Raises:
      PayloadTypeError: an attrs byte count is not an int.
      PayloadError: an attrs byte count is below 0.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> old = SessionUsage("old", (ObjectUsage("kv", {"cpu:0": 600}),), last_used=1)
      >>> new = SessionUsage("new", (ObjectUsage("kv", {"cpu:0": 600}),), last_used=2)
      >>> plan([old, new], budgets={"cpu:0": 1000}, allow_preempt=True).actions  # least recently used goes
      (PreemptSession(session_id='old', freed=mappingproxy({'cpu:0': 600})),)
    """

    session_id: Hashable
    objects: tuple[ObjectUsage, ...]
    last_used: int
    pinned: bool = False
    attrs_bytes_by_device: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        attrs = byte_counts(f"SessionUsage {self.session_id!r}", "attrs_bytes_by_device", self.attrs_bytes_by_device)
        object.__setattr__(self, "attrs_bytes_by_device", attrs)


@dataclasses.dataclass(frozen=True, slots=True)
class _FreeingObject:
    """An action on one object of a session that frees ``freed`` bytes per device key."""

    session_id: Hashable
    name: str
    freed: Mapping[str, int]


class EvictObject(_FreeingObject):
    """Evict an object (release its storage to recompute it later); ``freed`` is its bytes per device key.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> cond = ObjectUsage("cond", {"cpu:0": 300}, sources=("prompt",), recomputable=True)
      >>> session = SessionUsage("s", (cond, ObjectUsage("prompt", {"cpu:0": 100})), last_used=0)
      >>> plan([session], budgets={"cpu:0": 200}).actions
      (EvictObject(session_id='s', name='cond', freed=mappingproxy({'cpu:0': 300})),)
    """

    __slots__ = ()


class DemoteObject(_FreeingObject):
    """Replace an object by its next lower tier (lossy, not undone); ``freed`` is the bytes it saves per device key.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> kv = ObjectUsage("kv", {"cpu:0": 1000}, demoted_bytes_by_device={"cpu:0": 270})
      >>> plan([SessionUsage("s", (kv,), last_used=0)], budgets={"cpu:0": 500}).actions
      (DemoteObject(session_id='s', name='kv', freed=mappingproxy({'cpu:0': 730})),)
    """

    __slots__ = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ParkObject:
    """Move an object to host memory; ``moved[k]`` bytes go from k to k + "/pinned_host".

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> session = SessionUsage("s", (ObjectUsage("kv", {"cpu:0": 600}),), last_used=0)
      >>> result = plan([session], budgets={"cpu:0": 500}, park=True)
      >>> result.actions
      (ParkObject(session_id='s', name='kv', moved=mappingproxy({'cpu:0': 600})),)
      >>> dict(result.usage_after)
      {'cpu:0/pinned_host': 600}
    """

    session_id: Hashable
    name: str
    moved: Mapping[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class PreemptSession:
    """Release a whole session; ``freed`` is all its bytes per device key.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> sessions = [SessionUsage(i, (ObjectUsage("kv", {"cpu:0": 400}),), last_used=i) for i in range(3)]
      >>> [a.session_id for a in plan(sessions, budgets={"cpu:0": 500}, protect=2, allow_preempt=True).actions]
      [0, 1]
    """

    session_id: Hashable
    freed: Mapping[str, int]


Action = EvictObject | DemoteObject | ParkObject | PreemptSession


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Actions to apply in order, and the usage per device key after them.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> result = plan([SessionUsage("s", (ObjectUsage("kv", {"cpu:0": 100}),), last_used=0)],
      ...               budgets={"cpu:0": 500})
      >>> result.actions, dict(result.usage_after)  # within budget: nothing to do
      ((), {'cpu:0': 100})
    """

    actions: tuple[Action, ...]
    usage_after: Mapping[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """No plan was found.

    Attributes:
      shortfall_by_device: bytes by which each key still exceeds its budget
        after the rule-ordered greedy plan (including preemptions if allowed).
      proven: True when no valid plan fits (see :func:`plan`); False only when
        preemption was disallowed and the bounded search gave up.
      message: a readable summary naming the keys and shortfalls.

    Example:
      >>> from jax_session_state.manager.planner import ObjectUsage, SessionUsage, plan
      >>> session = SessionUsage("s", (ObjectUsage("kv", {"cpu:0": 600}),), last_used=0)
      >>> refusal = plan([session], budgets={"cpu:0": 500})  # not recomputable, no parking, no preemption
      >>> refusal.message, refusal.proven
      ('over budget: cpu:0 by 100 bytes', True)
    """

    shortfall_by_device: Mapping[str, int]
    proven: bool
    message: str
