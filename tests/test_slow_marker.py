"""The ``slow`` marker: a ``--durations=0`` report parsed into the record, and the record's tests marked."""

import pytest

from tests.support import durations

REPORT = """\
============================== slowest durations ===============================
2.50s call     tests/a.py::test_one[append, ring]
0.40s setup    tests/a.py::test_one[append, ring]
0.30s call     tests/b.py::TestMachine::runTest
0.01s teardown tests/b.py::TestMachine::runTest
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
1 passed in 3.21s
"""


def test_a_report_gives_each_test_its_phases_summed_and_keeps_ids_with_spaces():
    seconds = durations.parse(REPORT)
    assert seconds.keys() == {"tests/a.py::test_one[append, ring]", "tests/b.py::TestMachine::runTest"}
    assert seconds["tests/a.py::test_one[append, ring]"] == pytest.approx(2.9)
    assert seconds["tests/b.py::TestMachine::runTest"] == pytest.approx(0.31)


def test_a_report_without_durations_is_refused_by_name(tmp_path):
    report = tmp_path / "report.txt"
    report.write_text("1 passed in 3.21s\n")
    with pytest.raises(SystemExit, match=r"report\.txt: no durations found"):
        durations.main(str(report))


def test_every_recorded_slow_test_is_marked_and_no_other(request):
    seconds = durations.recorded()
    assert seconds, "tests/durations.json is missing or empty"
    items = request.session.items
    for item in items:
        marked = item.get_closest_marker("slow") is not None
        assert marked == (seconds.get(item.nodeid, 0.0) >= durations.SLOW_SECONDS), item.nodeid
