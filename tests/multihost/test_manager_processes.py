"""One SessionStateManager per JAX process: decisions on a session spanning 2 processes agree or raise.

The children (``tests/multihost/_child.py``, role ``managers_agree``) hold
sessions sharded over both processes' devices.  The same calls on both agree
silently (one key-value exchange per decision; none for a session on one
process's devices); a budget that makes process 0's planner preempt a session
that process 1 keeps raises ProcessDisagreementError on both, changing
nothing; a call process 1 never makes raises on process 0 after its timeout.
"""

import json

from tests.multihost import _launch


def test_managers_of_two_processes_agree_or_raise_instead_of_diverging(tmp_path):
    _launch.run("managers_agree", 2, tmp_path, timeout=120)
    first, second = (json.loads((tmp_path / f"managers_agree-{i}.json").read_text()) for i in range(2))
    for report in (first, second):
        assert report["agreed"] == 7  # 2 creates and 5 puts of spanning sessions, one exchange each
        assert report["local_exchanges"] == 0
        assert report["held_after"] == ["a"]  # nothing applied: "a" not preempted, "b" not created
        message = report["disagreement"]
        assert message is not None and "session 'b'" in message and "disagree" in message, message
        assert "PreemptSession('a', None)" in message and "actions [], proceeds" in message, message
    assert "process 1 did not publish its decision for creating session 'a' within 2 s" in first["timeout"]
    assert 1.5 < first["timeout_s"] < 20, first["timeout_s"]
    assert "timeout" not in second
