"""The dependency floors CI installs are the ones setup.cfg declares.

``.ci/run`` installs ``.ci/floors.txt`` (exact pins) in a second virtual
environment and runs a smoke selection there, so each floor in
``install_requires`` is a version the library was tested with.  A floor
raised or lowered in one file and not in the other would test something else.
"""

import configparser
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINNED = re.compile(r"^([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)$")
FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)$")


def pins() -> dict[str, str]:
    """``.ci/floors.txt`` as {name: version}, comments and blank lines skipped."""
    lines = (line.split("#")[0].strip() for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines())
    found = {}
    for line in filter(None, lines):
        match = PINNED.match(line)
        assert match, f".ci/floors.txt: expected NAME==VERSION, got {line!r}"
        found[match[1].lower()] = match[2]
    return found


def floors() -> dict[str, str]:
    """setup.cfg's install_requires as {name: floor}; each requirement has exactly one ``>=`` floor."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    found = {}
    for line in filter(None, map(str.strip, config["options"]["install_requires"].splitlines())):
        match = FLOOR.match(line)
        assert match, f"setup.cfg install_requires: expected NAME>=VERSION, got {line!r}"
        found[match[1].lower()] = match[2]
    return found


def test_ci_pins_exactly_the_floors_setup_cfg_declares():
    assert pins() == floors()


def test_the_build_requires_the_jax_floor():
    """The native kernel builds against jaxlib's FFI headers: its build floor is the runtime floor."""
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert f"jax>={floors()['jax']}" in build
