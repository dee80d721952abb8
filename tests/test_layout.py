"""The package's layout: one-way imports, small modules, private modules inside their sub-package, no lost name."""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import re
import tokenize
from pathlib import Path

import jax_session_state

PACKAGE = Path(jax_session_state.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a sub-package by its ``__init__``)."""
    found = {"jax_session_state": PACKAGE / "__init__.py"}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="jax_session_state."):
        path = PACKAGE.joinpath(*info.name.split(".")[1:])
        source = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
        if source.exists():  # not the native library, an extension module
            found[info.name] = source
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import the module runs, at its top or inside functions; annotation-only imports under
    ``if TYPE_CHECKING:`` never run and are left out (as import-linter's ``exclude_type_checking_imports``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import sub`` counts as ``pkg.sub``)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join([*parts, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            edges |= {found for target in targets if (found := owner(target))}
        # Every module imports the top package implicitly, and it imports everything: not an edge.
        graph[name] = edges - {name, "jax_session_state"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_package_has_no_import_cycle():
    assert _cycles(_import_graph(_modules())) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
              "def f():\n    import z\n")
    assert [node.names[0].name for node in _imports(ast.parse(source))][1:] == ["y", "z"]


def test_data_flows_one_way_between_sub_packages():
    graph = _import_graph(_modules())
    below = {  # a layer never imports one above it
        "jax_session_state._core": {"jax_session_state.objects", "jax_session_state.attention",
                                   "jax_session_state.manager", "jax_session_state.checkpoint",
                                   "jax_session_state.session", "jax_session_state.pool"},
        "jax_session_state.objects": {"jax_session_state.session", "jax_session_state.attention",
                                      "jax_session_state.pool", "jax_session_state.manager",
                                      "jax_session_state.checkpoint"},
        "jax_session_state.attention": {"jax_session_state.session", "jax_session_state.pool",
                                        "jax_session_state.manager", "jax_session_state.checkpoint"},
        "jax_session_state.manager": {"jax_session_state.checkpoint"},
    }
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for layer, above in below.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if any(target == a or target.startswith(a + ".") for a in above)
    )
    assert wrong == []


def test_saving_a_session_does_not_depend_on_the_manager():
    """Only the manager's record in a checkpoint imports ``manager``; array helpers live below it, in ``_core``."""
    graph = _import_graph(_modules())
    importers = sorted(
        module for module, targets in graph.items()
        if module.startswith("jax_session_state.checkpoint")
        and any(t == "jax_session_state.manager" or t.startswith("jax_session_state.manager.") for t in targets)
    )
    assert importers == ["jax_session_state.checkpoint._save_restore"]


def test_private_modules_live_in_their_sub_package():
    loose = sorted(path.name for path in PACKAGE.glob("_*.py") if path.name != "__init__.py")
    assert loose == []


def test_every_sub_package_says_what_it_owns_and_may_import():
    for name, path in _modules().items():
        if path.name == "__init__.py" and name != "jax_session_state":
            doc = importlib.import_module(name).__doc__ or ""
            assert "import" in doc, f"{name}'s docstring does not say what it may import"


def test_no_compatibility_shim_before_a_first_release():
    """One name for each thing: no deprecated aliases, no module standing in for another in ``sys.modules``."""
    shims = []
    for name, path in _modules().items():
        source = path.read_text()
        if "deprecat" in source.lower():
            shims.append(f"{name}: mentions deprecation")
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules" for t in targets):
                shims.append(f"{name}: assigns into sys.modules")
    assert shims == []


RETIRED = {  # a retired word -> the one word the glossary (docs/concepts.md) keeps for its concept
    r"offload": "park",
    r"rebuil": "recompute",
    r"\bslot_rows\b": "capacity",
    r"\bjss\.kinds\b|\bjax_session_state\.kinds\b|\bjax_session_state import kinds\b": "building_blocks",
    r"\bjax_session_state\.summary\b|\bjax_session_state import summary\b": "reports (the module of jss.summary)",
    r"\bobjects\._prefix\b|\breuse\._prefix\b|\bimport _prefix\b": "_page_sharing / _prefix_index",
}


def _retired_words(root: Path) -> list[str]:
    """``file:line: word (say ...)`` for every retired word in the package, the docs, the examples and the README.

    The glossary section of the concepts page names the retired words, so it is left out; so is
    the changelog, which tells what they became."""
    sources = [*sorted((root / "jax_session_state").rglob("*.py")), *sorted((root / "docs").rglob("*.md")),
               *sorted((root / "examples").rglob("*.py")), root / "README.md"]
    found = []
    for path in sources:
        if path.name == "changelog.md" or not path.exists():
            continue
        in_glossary = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("## "):
                in_glossary = path.name == "concepts.md" and line == "## Glossary"
            if in_glossary:
                continue
            for pattern, word in RETIRED.items():
                if (match := re.search(pattern, line, re.IGNORECASE)):
                    found.append(f"{path.relative_to(root)}:{number}: {match.group(0)!r} (say {word})")
    return found


def test_one_word_per_concept():
    """The words the glossary retired appear nowhere in the package, the docs or the examples."""
    assert _retired_words(PACKAGE.parent) == []


def test_the_retired_word_check_names_file_and_line(tmp_path: Path):
    (tmp_path / "jax_session_state").mkdir()
    (tmp_path / "jax_session_state" / "a.py").write_text("x = 1\nmanager.register_rebuild('cond', fn)\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "concepts.md").write_text("# C\n## Glossary\nrebuild: retired\n## Next\nOffload it\n")
    (tmp_path / "README.md").write_text("cache.slot_rows\n")
    assert _retired_words(tmp_path) == [
        "jax_session_state/a.py:2: 'rebuil' (say recompute)",
        "docs/concepts.md:5: 'Offload' (say park)",
        "README.md:1: 'slot_rows' (say capacity)",
    ]


FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?[x\u00d7](?!\w)"  # a ratio: 3x, 1.18x
    r"|(?<![\w.])\d+(?:\.\d+)? ?(?:[GMKT]i?B/s|ms|µs|us|ns|[GT]FLOP/?s?)(?!\w)"  # a rate or a time
    r"|\bon an? (?:H100|H200|A100|EPYC|Xeon)\b"  # the machine a figure was taken on
)
"""A measured figure: those go in BENCHMARKS.md, where a rerun updates them, never in the code."""


def _figures(path: Path, root: Path) -> list[str]:
    """``file:line: figure`` for each measured figure in a docstring or comment of ``path`` (doctest input aside)."""
    source = path.read_text()
    texts = [(node.lineno + i, line)
             for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
             and isinstance(node.value.value, str)
             for i, line in enumerate(node.value.value.splitlines())]
    texts += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT]
    return [f"{path.relative_to(root)}:{number}: {match.group(0)!r}"
            for number, line in sorted(texts) if not line.lstrip().startswith((">>>", "..."))
            for match in FIGURE.finditer(line)]


def test_docstrings_and_comments_quote_no_measured_figures():
    """Timings, ratios and rates go stale in code: docstrings link BENCHMARKS.md instead."""
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _figures(path, PACKAGE.parent)]
    assert found == []


def test_the_figure_check_finds_figures_and_leaves_sizes(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Reads 12 GB/s, 3x faster.\n\nA [batch, 4 x 8] array of 2 MiB; 0x1f; (2, 2)x.\n"""\n\n'
        "x = 1  # 84 ms against 0.2 ms on an H200\n"
        'def f():\n    """Example:\n      >>> f()  # 2x\n    """\n'
    )
    assert _figures(module, tmp_path) == [
        "m.py:1: '12 GB/s'", "m.py:1: '3x'", "m.py:6: '84 ms'", "m.py:6: '0.2 ms'", "m.py:6: 'on an H200'"]
