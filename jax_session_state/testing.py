"""A conformance suite any :class:`StateObject` implementation can run.

Point it at a factory of empty objects and a generator of valid payloads; it
checks the StateObject contract (see :class:`~jax_session_state.StateObject`): purity, two-phase writes
(a second ``stage`` replaces the first), jit/eager agreement, one compile per step, donation aliasing every storage
leaf, constant bytes under in-buffer staging, eviction, and clear errors for
malformed payloads.

Example:
  >>> import jax.numpy as jnp
  >>> import jax_session_state as jss
  >>> from jax_session_state.testing import Conformance
  >>> suite = Conformance(
  ...     make=lambda: jss.LatentBuffer.allocate(capacity=8, item_shape=(3,)),
  ...     payload=lambda rng: jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
  ... )
  >>> suite.run()  # raises AssertionError naming the first broken rule

In pytest, parametrise over :data:`CHECKS` to get one test per rule::

  @pytest.mark.parametrize("check", jss.testing.CHECKS)
  def test_my_kind(check):
      getattr(Conformance(make=..., payload=...), check)()

:data:`CHECKS` names every check, in the order :meth:`Conformance.run` runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jax_session_state.accounting import SeenStorages
from jax_session_state.base import StateObject
from jax_session_state.building_blocks import Fill
from jax_session_state.errors import DonatedError, NotEvictableError, NotResidentError, SessionStateError

__all__ = ["CHECKS", "Conformance", "assert_logically_equal", "logical", "logically_equal"]

CHECKS = (
    "check_pure",
    "check_staged_invisible",
    "check_discard_restores",
    "check_stage_commit_equals_append",
    "check_restage_replaces",
    "check_jit_matches_eager",
    "check_compiles_once",
    "check_donation_aliases",
    "check_nbytes_constant_under_staging",
    "check_evict_and_reset",
    "check_bad_payloads",
    "check_bookkeeping",
    "check_donated_use_raises",
)
"""The names of every check, in the order :meth:`Conformance.run` runs them."""


def logical(view: Any) -> Any:
    """A view's logical contents on the host: what two equal states share.

    Views that hold slots a reader must not see (past a length, outside a
    ring's window) provide ``materialize()``, which drops them; other views
    are compared leaf by leaf.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.testing import logical
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=8)
      >>> rows = logical(kv.append((jnp.ones((1, 2, 1, 2)),) * 2).view())  # per batch row: what is visible
      >>> rows[0]["positions"], rows[0]["k"].shape  # 2 rows written, not the 8 slots allocated
      (array([0, 1], dtype=int32), (2, 1, 2))
    """
    if hasattr(view, "materialize"):
        return view.materialize()
    if isinstance(view, dict):
        return {name: logical(v) for name, v in view.items()}
    return jax.tree_util.tree_map(np.asarray, view)


def logically_equal(a: Any, b: Any) -> bool:
    """Whether two views hold the same logical contents, exactly.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.testing import logically_equal
      >>> rows = (jnp.ones((1, 2, 1, 2)),) * 2
      >>> small, large = (jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=c) for c in (4, 16))
      >>> logically_equal(small.append(rows).view(), large.append(rows).view())  # capacity is not content
      True
      >>> logically_equal(small.append(rows).view(), small.view())
      False
    """
    leaves_a, tree_a = jax.tree_util.tree_flatten(logical(a))
    leaves_b, tree_b = jax.tree_util.tree_flatten(logical(b))
    return tree_a == tree_b and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b)
    )


def assert_logically_equal(a: Any, b: Any, message: str) -> None:
    """Asserts two views hold the same logical contents, exactly.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.testing import assert_logically_equal
      >>> kv = jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=2, capacity=4)
      >>> tried = kv.stage((jnp.ones((1, 1, 1, 2)),) * 2)
      >>> assert_logically_equal(tried.discard().view(), kv.view(), "discard() restores")
      >>> try:
      ...     assert_logically_equal(tried.view(include_staged=True), kv.view(), "staged rows are visible")
      ... except AssertionError as error:
      ...     print(str(error).splitlines()[0])
      staged rows are visible:
    """
    assert logically_equal(a, b), f"{message}:\n{logical(a)}\n!=\n{logical(b)}"


def _host_copy(tree: Any) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


def _pointers(tree: Any) -> list[int]:
    return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)]


def _call_method(method: str, obj: StateObject, payload: Any) -> StateObject:
    return getattr(obj, method)(payload)


def _perturbed_dtype(dtype: Any) -> Any:
    return jnp.float16 if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float16 else jnp.float32


@dataclasses.dataclass
class Conformance:
    """The contract checks for one kind of state object.

    Attributes:
      make: returns a fresh, empty, resident object (new buffers every call).
      payload: returns a valid payload for ``stage`` / ``commit`` /
        ``append`` from a numpy Generator, on random data; every payload it
        returns must have the same shapes (so a jitted step compiles once).
      seed: seeds the payload generator.
      jit_steps: how many jitted appends must compile once.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_session_state as jss
      >>> from jax_session_state.testing import CHECKS, Conformance
      >>> suite = Conformance(make=lambda: jss.FixedState.allocate(shapes=(2,)),
      ...                     payload=lambda rng: jnp.asarray(rng.normal(size=2), jnp.float32))
      >>> suite.check_discard_restores()  # one rule; run() checks all of CHECKS
      >>> len(CHECKS), CHECKS[0]
      (13, 'check_pure')
    """

    make: Callable[[], StateObject]
    payload: Callable[[np.random.Generator], Any]
    seed: int = 0
    jit_steps: int = 50

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def _payload(self) -> Any:
        return self.payload(self._rng)

    def _committed(self) -> StateObject:
        """An object holding committed data."""
        return self.make().append(self._payload())

    def run(self) -> None:
        """Runs every check in :data:`CHECKS`."""
        for name in CHECKS:
            getattr(self, name)()

    # ------------------------------------------------------------- checks
    def check_pure(self) -> None:
        """No method changes or deletes its input."""
        committed = self._committed()
        staged = committed.stage(self._payload())
        before = _host_copy((committed, staged))
        payload = self._payload()
        committed.stage(payload), committed.commit(payload), committed.append(payload)
        staged.commit(), staged.discard(), staged.view(), staged.view(include_staged=False)
        staged.reset()
        if staged.evictable:
            staged.evict()
        after = _host_copy((committed, staged))
        for x, y in zip(before, after, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"{staged.describe()}: a method changed its input")

    def check_staged_invisible(self) -> None:
        """``view(include_staged=False)`` ignores staged data; the staged view shows it."""
        fresh = self.make()
        staged = fresh.stage(self._payload())
        assert_logically_equal(
            staged.view(include_staged=False), fresh.view(), "staged data leaked into the committed view"
        )
        assert not logically_equal(staged.view(), fresh.view()), (
            f"{fresh.describe()}: view(include_staged=True) does not show staged data"
        )
        assert bool(staged.holds_staged()) and not bool(fresh.holds_staged()), "holds_staged() is wrong"
        assert not bool(staged.discard().holds_staged()) and not bool(staged.commit().holds_staged())
        obj = self._committed()
        assert_logically_equal(
            obj.stage(self._payload()).view(include_staged=False),
            obj.view(include_staged=False),
            "staged data changed the committed view",
        )

    def check_discard_restores(self) -> None:
        """``discard`` restores the committed view exactly."""
        obj = self._committed()
        restored = obj.stage(self._payload()).discard()
        assert_logically_equal(
            restored.view(include_staged=False), obj.view(include_staged=False), "discard did not restore the view"
        )

    def check_stage_commit_equals_append(self) -> None:
        """``stage(p).commit()`` equals ``append(p)`` equals ``commit(p)``."""
        obj, payload = self._committed(), self._payload()
        appended = obj.append(payload)
        assert_logically_equal(obj.stage(payload).commit().view(), appended.view(), "stage+commit != append")
        assert_logically_equal(obj.commit(payload).view(), appended.view(), "commit(p) != append(p)")

    def check_restage_replaces(self) -> None:
        """A second ``stage`` replaces the first, eagerly and under jit: ``stage(a).stage(b)`` reads as
        ``stage(b)``, commits as ``append(b)``, and ``stage(a).commit(b)`` equals ``append(b)``.

        The denoising pattern (stage a frame once per step, then commit the
        clean frame) relies on it: no step's rows stay visible after the next.
        """
        obj, first, second = self._committed(), self._payload(), self._payload()
        appended = obj.append(second)
        for how, run in (("eagerly", lambda f, o: f(o)), ("under jit", lambda f, o: jax.jit(f)(o))):
            restaged = run(lambda o: o.stage(first).stage(second), obj)
            assert_logically_equal(restaged.view(), obj.stage(second).view(), f"stage(a).stage(b) != stage(b) {how}")
            assert_logically_equal(restaged.view(include_staged=False), obj.view(include_staged=False),
                                   f"re-staging changed the committed view {how}")
            assert_logically_equal(restaged.commit().view(), appended.view(),
                                   f"stage(a).stage(b).commit() != append(b) {how}")
            replaced = run(lambda o: o.stage(first).commit(second), obj)
            assert_logically_equal(replaced.view(), appended.view(), f"stage(a).commit(b) != append(b) {how}")

    def check_jit_matches_eager(self) -> None:
        """Every lifecycle method gives the same result jitted and not."""
        committed = self._committed()
        staged = committed.stage(self._payload())
        payload = self._payload()
        steps: dict[str, tuple[StateObject, Callable[[StateObject, Any], Any]]] = {
            "stage": (committed, lambda o, p: o.stage(p).view()),
            "commit(payload)": (committed, lambda o, p: o.commit(p).view()),
            "append": (committed, lambda o, p: o.append(p).view()),
            "commit": (staged, lambda o, p: o.commit().view()),
            "discard": (staged, lambda o, p: o.discard().view()),
            "view(include_staged=False)": (staged, lambda o, p: o.view(include_staged=False)),
        }
        for name, (obj, step) in steps.items():
            assert_logically_equal(jax.jit(step)(obj, payload), step(obj, payload), f"{name}: jit != eager")

    def check_compiles_once(self) -> None:
        """A jitted, donated ``append`` called ``jit_steps`` times traces once (``chex.assert_max_traces``).

        chex counts traces per definition site for the whole process, so this
        check starts by clearing its counter (``chex.clear_trace_counter()``).
        """
        chex.clear_trace_counter()

        @chex.assert_max_traces(n=1)
        def append(obj: StateObject, payload: Any) -> StateObject:
            return obj.append(payload)

        step = jax.jit(append, donate_argnums=0)
        obj = self.make()
        for _ in range(self.jit_steps):
            obj = step(obj, self._payload())
        jax.block_until_ready(obj)

    def check_donation_aliases(self) -> None:
        """Donation writes in place: every storage leaf keeps its buffer.

        Checked for ``stage``, ``commit``, ``discard`` and ``append`` by buffer
        pointer and by the compiled program's aliased bytes.
        """
        steps: dict[str, Callable[[StateObject, Any], StateObject]] = {
            "stage": lambda o, p: o.stage(p),
            "commit": lambda o, p: o.commit(),
            "discard": lambda o, p: o.discard(),
            "append": lambda o, p: o.append(p),
        }
        for name, method in steps.items():
            obj, payload = self._committed(), self._payload()
            if name in ("commit", "discard"):
                obj = obj.stage(self._payload())
            step = jax.jit(method, donate_argnums=0)
            storage = sum(x.nbytes for x in jax.tree_util.tree_leaves(obj))
            aliased = step.lower(obj, payload).compile().memory_analysis().alias_size_in_bytes
            assert aliased == storage, f"{obj.describe()}.{name}: {aliased} of {storage} storage bytes aliased"
            before = _pointers(obj)
            out = step(obj, payload)
            assert _pointers(out) == before, f"{out.describe()}.{name}: a donated step moved storage"

    def check_nbytes_constant_under_staging(self) -> None:
        """Staging, committing and discarding allocate nothing."""
        obj = self._committed()
        staged = obj.stage(self._payload())
        for state in (staged, staged.commit(), staged.discard()):
            assert state.nbytes == obj.nbytes, f"{obj.describe()}: bytes changed under staging"
        total = sum(obj.nbytes_by_device().values())
        assert obj.nbytes_by_device(SeenStorages()) and total == obj.nbytes

    def check_evict_and_reset(self) -> None:
        """Evicted or reset objects hold nothing and refuse use."""
        obj = self._committed()
        released = [obj.reset()]
        if obj.evictable:
            evicted, freed = obj.evict()
            assert freed == obj.nbytes > 0, f"{obj.describe()}: evict freed {freed} of {obj.nbytes} bytes"
            released.append(evicted)
        else:
            try:
                obj.evict()
            except NotEvictableError:
                pass
            else:
                raise AssertionError(f"{obj.describe()}: evict() of a non-evictable object did not raise")
        payload = self._payload()
        for gone in released:
            assert not gone.resident and gone.nbytes == 0 and gone.nbytes_by_device() == {}
            assert gone.describe() == obj.describe(), "the static spec was lost"
            for use in (
                gone.view,
                gone.commit,
                functools.partial(gone.stage, payload),
                functools.partial(gone.append, payload),
                gone.discard,
            ):
                try:
                    use()
                except NotResidentError as error:
                    assert type(obj).__name__ in str(error), f"the message does not name the object: {error}"
                    continue
                raise AssertionError(f"{obj.describe()}: a non-resident object did not raise NotResidentError")
            assert gone.empty().resident and gone.empty().nbytes == obj.nbytes

    def check_bad_payloads(self) -> None:
        """Wrong structure, rank, shape or dtype: a clear error naming the object, what it expected and what came.

        Raised at trace time, so a jitted write raises the same error.
        """
        obj, payload = self._committed(), self._payload()
        leaves, treedef = jax.tree_util.tree_flatten(payload)
        first = jnp.asarray(leaves[0])

        def replace_first(x: Any) -> Any:
            return treedef.unflatten([x, *leaves[1:]])

        bad = {
            "structure": [payload],
            "rank": replace_first(first[..., None]),
            "shape": replace_first(jnp.concatenate([first, first[..., :1]], axis=-1)),
            "dtype": replace_first(first.astype(_perturbed_dtype(first.dtype))),
        }
        for what, wrong in bad.items():
            for method in ("stage", "commit", "append"):
                write = functools.partial(_call_method, method)
                for how, run in (("eagerly", write), ("under jit", jax.jit(write))):
                    try:
                        run(obj, wrong)
                    except (TypeError, ValueError) as error:
                        where = f"{obj.describe()}.{method} {how}, wrong {what}"
                        assert type(obj).__name__ in str(error), (
                            f"{where}: the message does not name the object: {error}"
                        )
                        assert "got" in str(error), f"{where}: the message does not say what came: {error}"
                        assert isinstance(error, SessionStateError), (
                            f"{where}: {type(error).__name__} is no SessionStateError"
                        )
                        continue
                    raise AssertionError(f"{obj.describe()}.{method} {how} accepted a payload of the wrong {what}")

    def check_bookkeeping(self) -> None:
        """``committed`` / ``staged`` / ``capacity`` / ``fill()`` mean the same in every kind.

        Staging raises ``staged`` and leaves ``committed``; ``commit()`` moves
        the staged entries to ``committed``; ``discard()`` zeroes ``staged``;
        ``fill()`` reports the same counts as host values.
        """
        obj = self.make()  # fresh: a write-once kind stages nothing once written
        name = obj.describe()
        assert isinstance(obj.capacity, int) and obj.capacity >= 1, f"{name}: capacity must be a static int"
        assert isinstance(obj.staging_margin, int) and obj.staging_margin >= 0, f"{name}: bad staging_margin"
        staged = obj.stage(self._payload())
        before, during = np.asarray(obj.committed), np.asarray(staged.committed)
        np.testing.assert_array_equal(during, before, err_msg=f"{name}: staging changed committed")
        assert np.asarray(staged.staged).sum() > 0, f"{name}: staging did not raise staged"
        assert not np.asarray(staged.discard().staged).any(), f"{name}: discard left staged entries"
        assert not np.asarray(staged.commit().staged).any(), f"{name}: commit left staged entries"
        fill = staged.fill()
        assert isinstance(fill, Fill) and fill.capacity == obj.capacity and fill.margin == obj.staging_margin
        assert fill.committed == np.asarray(staged.committed).tolist(), f"{name}: fill() committed is not committed"
        assert fill.staged == np.asarray(staged.staged).tolist(), f"{name}: fill() staged is not staged"
        gone = obj.reset().fill()
        assert gone.committed is None and gone.staged is None and gone.capacity == obj.capacity

    def check_donated_use_raises(self) -> None:
        """An object whose buffers were donated raises :class:`DonatedError` on use; it never reads as empty."""
        obj = self._committed()
        jax.block_until_ready(jax.jit(lambda o: o.discard(), donate_argnums=0)(obj))
        for use in (obj.view, obj.nbytes_by_device, obj.fill, lambda: obj.append(self._payload())):
            try:
                use()
            except DonatedError as error:
                assert type(obj).__name__ in str(error) and "donated" in str(error)
                continue
            raise AssertionError(f"{obj.describe()}: using a donated object did not raise DonatedError")
