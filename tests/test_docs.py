"""The documentation cannot go stale: its code runs, its reference is complete, its links hold.

- Every ```` ```python ```` block of a page under ``docs/`` runs: a page's
  blocks, in order, are one program (as a reader would paste them), run in a
  fresh interpreter on CPU.
- Every name in ``jax_session_state.__all__`` and every public module has an
  entry in the API reference (``docs/api/*.md``).
- The link checker that CI runs over the built site finds what is broken.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jax_session_state as jss

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_DIRECTIVE = re.compile(r"^:::\s+(?P<path>\S+)\n(?P<options>(?:[ \t]+\S.*\n)*)", re.MULTILINE)


def python_blocks(markdown: str) -> list[str]:
    """The source of every ```` ```python ```` block of a page, in order.

    A block with a title (```` ```python title="rollout.py" ````) is a program of its own, launched
    by a test of its own (the multi-host recipe runs in ``tests/multihost``), and is left out.
    """
    return [
        textwrap.dedent(m.group("body"))
        for m in _FENCE.finditer(markdown)
        if m.group("lang") in ("python", "py") and "title=" not in m.group("info")
    ]


def titled_program(markdown: str, title: str) -> str:
    """The source of the ```` ```python title="<title>" ```` block of a page."""
    (found,) = [textwrap.dedent(m.group("body")) for m in _FENCE.finditer(markdown)
                if m.group("lang") in ("python", "py") and f'title="{title}"' in m.group("info")]
    return found


PAGES_WITH_CODE = [p for p in sorted(DOCS.rglob("*.md")) if python_blocks(p.read_text())]


def test_blocks_are_extracted():
    text = "intro\n```python\nx = 1\n```\n\n!!! note\n    ```python\n    y = x + 1\n    ```\n```bash\nls\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = x + 1\n"]
    program = '```python title="run.py"\nz = 2\n```\n'
    assert python_blocks(text + program) == ["x = 1\n", "y = x + 1\n"]
    assert titled_program(text + program, "run.py") == "z = 2\n"
    assert len(PAGES_WITH_CODE) >= 7, [p.name for p in PAGES_WITH_CODE]


def _run_page(page: Path, workdir: Path) -> subprocess.CompletedProcess:
    """Runs a page's blocks, in order, as one program in a fresh interpreter."""
    blocks = python_blocks(page.read_text())
    script = workdir / f"{page.stem}.py"
    program = "\n".join(f"# --- block {i + 1}\n{block}" for i, block in enumerate(blocks))
    script.write_text(program)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a page sets its own devices
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, str(script)], check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """Every page's run, started together (the interpreters mostly wait on imports and compiles).

    Under pytest-xdist the pages are spread over the workers instead, each run when its test is.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield None
        return
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    runs = {page: pool.submit(_run_page, page, tmp_path_factory.mktemp(page.stem)) for page in PAGES_WITH_CODE
            if not missing_requirements(page.read_text())}
    yield runs
    pool.shutdown(cancel_futures=True)


_REQUIRES = re.compile(r"^<!-- requires: (?P<modules>[\w., ]+) -->$", re.MULTILINE)


def missing_requirements(markdown: str) -> list[str]:
    """The modules a page declares it needs (``<!-- requires: gemma -->``, an optional extra's) that are not
    installed."""
    declared = [m.strip() for found in _REQUIRES.finditer(markdown) for m in found.group("modules").split(",")]
    return [m for m in declared if importlib.util.find_spec(m) is None]


def test_a_page_declares_the_optional_modules_it_needs():
    assert missing_requirements("<!-- requires: json, no_such_module_here -->\ntext") == ["no_such_module_here"]
    assert missing_requirements("no declaration") == []


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page: Path, page_runs, tmp_path: Path):
    missing = missing_requirements(page.read_text())
    if missing:
        pytest.skip(f"{page.relative_to(ROOT)} needs {missing}: pip install -e '.[models]'")
    done = page_runs[page].result() if page_runs else _run_page(page, tmp_path)
    assert done.returncode == 0, f"{page.relative_to(ROOT)}: its code failed:\n{done.stdout}\n{done.stderr}"


def _documented() -> tuple[list[object], set[str]]:
    """The objects the API reference renders, and the modules it renders whole."""
    objects, modules = [], set()
    for page in sorted((DOCS / "api").glob("*.md")):
        for directive in _DIRECTIVE.finditer(page.read_text()):
            path = directive.group("path")
            try:
                target = importlib.import_module(path)
            except ModuleNotFoundError:
                module, _, name = path.rpartition(".")
                target = getattr(importlib.import_module(module), name)
            objects.append(target)
            if hasattr(target, "__all__") and "members: false" not in directive.group("options"):
                # a module's entry renders what the module exports
                modules.add(target.__name__)
                objects += [getattr(target, name) for name in target.__all__]
    return objects, modules


def test_every_public_name_has_a_reference_entry():
    objects, _ = _documented()
    missing = [name for name in jss.__all__ if not any(getattr(jss, name) is obj for obj in objects)]
    assert not missing, f"names in jax_session_state.__all__ with no entry in docs/api/: {missing}"


def test_every_public_module_has_a_reference_page():
    _, modules = _documented()
    public = [
        info.name
        for info in pkgutil.walk_packages(jss.__path__, prefix="jax_session_state.")
        if not any(part.startswith("_") for part in info.name.split("."))
    ]
    objects, _ = _documented()
    missing = []
    for name in public:
        module = importlib.import_module(name)
        exported = [getattr(module, n) for n in getattr(module, "__all__", ())]
        covered = name in modules or (exported and all(any(o is x for x in objects) for o in exported))
        if not covered:
            missing.append(name)
    assert not missing, f"public modules with no page in docs/api/: {missing}"


def _check_links():
    spec = importlib.util.spec_from_file_location("check_links", DOCS / "check_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_link_checker_finds_broken_links_and_images(tmp_path: Path):
    check_links = _check_links()
    (tmp_path / "guide").mkdir()
    (tmp_path / "img.png").write_bytes(b"\x89PNG")
    (tmp_path / "index.html").write_text(
        '<h1 id="top">Home</h1><a href="guide/">guide</a><a href="guide/#usage">usage</a>'
        '<a href="#top">top</a><img src="img.png"><a href="https://example.org/missing">out</a>'
    )
    (tmp_path / "guide" / "index.html").write_text('<h2 id="usage">Usage</h2><a href="../index.html#top">home</a>')
    assert check_links.broken_links(tmp_path) == []
    assert check_links.main([str(tmp_path)]) == 0

    (tmp_path / "guide" / "index.html").write_text(
        '<h2 id="usage">Usage</h2><a href="../nowhere/">x</a><img src="../gone.png">'
        '<a href="../index.html#bottom">y</a><link href="../../outside.css">'
    )
    problems = check_links.broken_links(tmp_path)
    assert len(problems) == 4, problems
    assert any("nowhere/" in p and "no file" in p for p in problems)
    assert any("gone.png" in p for p in problems)
    assert any("no anchor #bottom" in p for p in problems)
    assert any("outside the site" in p for p in problems)
    assert check_links.main([str(tmp_path)]) == 1


def test_reference_overview_lists_every_public_name():
    overview = (DOCS / "api" / "index.md").read_text()
    missing = [name for name in jss.__all__ if f"`jss.{name}" not in overview]
    assert not missing, f"docs/api/index.md does not list: {missing}"


def test_readme_links_to_the_pages():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Documentation"):]
    links = re.findall(r"\]\(([^)#\s]+)\)", section)
    assert ".venv/bin/pip install -e '.[docs]' && .venv/bin/mkdocs build --strict" in section
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README's Documentation section links to files that do not exist: {missing}"
    pages = {str(p.relative_to(ROOT)) for p in DOCS.glob("*.md")} | {
        str(p.relative_to(ROOT)) for p in (DOCS / "guides").glob("*.md")
    }
    unlinked = sorted(pages - set(links) - {"docs/benchmarks.md", "docs/benchmark-results.md", "docs/changelog.md"})
    assert not unlinked, f"pages README's Documentation section does not link: {unlinked}"


def _section_blocks(markdown: str, heading: str, lang: str) -> list[str]:
    """The ``lang`` blocks of the section under ``heading``, backslash continuations joined."""
    section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
    return [
        re.sub(r"\s*\\\n\s*", " ", m.group("body"))
        for m in _FENCE.finditer(section)
        if m.group("lang") == lang
    ]


def test_getting_started_is_the_readme_quickstart():
    readme, index = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    assert _section_blocks(index, "## Install and run", "bash") == _section_blocks(readme, "## Quickstart", "bash")
    idea = "## The idea in twenty lines"
    assert _section_blocks(index, idea, "python") == _section_blocks(readme, idea, "python")
