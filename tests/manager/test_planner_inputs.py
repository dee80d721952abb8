"""The planner refuses inputs it cannot plan over, and never returns a plan that leaves a key over budget."""

import pytest

from jax_session_state.errors import PayloadError, PayloadTypeError
from jax_session_state.manager import planner
from jax_session_state.manager.planner import ObjectUsage, Plan, Refusal, SessionUsage, plan


@pytest.mark.parametrize(
    ("budgets", "error", "message"),
    [
        ({"cpu:0": -5}, PayloadError, r"^plan: budgets must map device keys to byte counts >= 0; got \{'cpu:0': -5\}"),
        ({"cpu:0": 1.5}, PayloadTypeError, r"^plan: budgets must map device keys to byte counts \(ints >= 0\)"),
        ({"cpu:0": None}, PayloadTypeError, r"^plan: budgets must map device keys to byte counts \(ints >= 0\)"),
    ],
)
def test_budgets_are_byte_counts(budgets, error, message):
    with pytest.raises(error, match=message):
        plan([], budgets=budgets)
    assert plan([], budgets={"cpu:0": 0}) == Plan((), {})  # a budget of 0 bytes is one


def test_session_ids_are_unique():
    twice = [SessionUsage("s", (ObjectUsage("kv", {"cpu:0": 5}),), 0), SessionUsage("s", (), 1)]
    with pytest.raises(PayloadError, match=r"^plan: every session needs its own id; \['s'\] appear more than once\.$"):
        plan(twice, budgets={"cpu:0": 10}, protect="s", allow_preempt=True)


def searched_case():
    """Only evicting E, demoting D (which frees host room) and parking P fit; the greedy pass parks nothing."""
    evictable = ObjectUsage("E", {"cpu:0": 600}, recomputable=True)
    demotable = ObjectUsage(
        "D", {"cpu:0": 600, "cpu:1/pinned_host": 600}, demoted_bytes_by_device={"cpu:0": 100, "cpu:1/pinned_host": 100}
    )
    parkable = ObjectUsage("P", {"cpu:1": 900})
    sessions = [
        SessionUsage("s", (evictable, demotable, parkable), 0),
        SessionUsage("new", (ObjectUsage("x", {"cpu:0": 600, "cpu:1": 600}),), 1, pinned=True),
    ]
    return sessions, {"cpu:0": 1200, "cpu:1": 1000, "cpu:1/pinned_host": 1000}


def test_a_searched_demotion_that_frees_room_for_a_park_is_replayed():
    sessions, budgets = searched_case()
    result = plan(sessions, budgets=budgets, park=True, protect="new")
    assert [(type(a).__name__, a.name) for a in result.actions] == [
        ("EvictObject", "E"), ("DemoteObject", "D"), ("ParkObject", "P")
    ]
    assert dict(result.usage_after) == {"cpu:0": 700, "cpu:1": 600, "cpu:1/pinned_host": 1000}


def test_a_replay_still_over_budget_is_no_plan(monkeypatch):
    sessions, budgets = searched_case()
    monkeypatch.setattr(planner, "_park_phase", lambda *args, **kwargs: None)  # a replay that falls short
    result = plan(sessions, budgets=budgets, park=True, protect="new")
    assert isinstance(result, Refusal) and not result.proven
    assert "did not fit once replayed in rule order" in result.message
