"""Records each test's time from a ``pytest --durations=0`` report, for the ``slow`` marker (tests/conftest.py).

The suite marks a test ``slow`` where its recorded time (setup, call and
teardown together) is at least ``SLOW_SECONDS``, so that ``pytest -m "not
slow"`` is an inner loop of a few minutes.  Refresh the record after adding
or changing heavy tests::

    python -m pytest --durations=0 > durations.txt; python -m tests.support.durations durations.txt

A test missing from the record (a new one) is not slow until the record is refreshed.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

RECORD = Path(__file__).resolve().parent.parent / "durations.json"
SLOW_SECONDS = 0.75
LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$")


def parse(report: str) -> dict[str, float]:
    """Each test's seconds (its phases summed) in a ``--durations=0`` report."""
    seconds: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        if match := LINE.match(line):
            seconds[match.group(2)] += float(match.group(1))
    return dict(seconds)


def recorded() -> dict[str, float]:
    """The record: test id to seconds; empty where there is none."""
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def main(report_path: str) -> None:
    seconds = parse(Path(report_path).read_text())
    if not seconds:
        raise SystemExit(f"{report_path}: no durations found; run pytest with --durations=0")
    RECORD.write_text(json.dumps({test: round(s, 2) for test, s in sorted(seconds.items())}, indent=0) + "\n")
    slow = [s for s in seconds.values() if s >= SLOW_SECONDS]
    print(f"recorded {len(seconds)} tests in {RECORD.name}: {len(slow)} slow ({sum(slow):.0f} s), "
          f"the others {sum(seconds.values()) - sum(slow):.0f} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
