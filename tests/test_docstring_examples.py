"""Every public name shows a runnable example, and every example in the package runs.

- Every class and function in ``__all__`` of ``jax_session_state`` and of each
  public submodule has a ``>>>`` example in its own docstring.  A constant or a
  type alias has no docstring of its own to hold one: its module's docstring
  describes it instead.
- Every module's docstring examples run with :mod:`doctest`, one test per
  module, on the CPU, outputs compared with ELLIPSIS and NORMALIZE_WHITESPACE;
  an example's temporary directories land in the test's own.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.machinery
import pkgutil
import tempfile
import types
import typing
from pathlib import Path
from types import ModuleType

import jax
import pytest

import jax_session_state as jss

OPTIONS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _modules(*, public: bool) -> list[ModuleType]:
    """The package's Python modules (not the native kernel's shared library), or only its public ones."""
    names = [
        info.name
        for info in pkgutil.walk_packages(jss.__path__, prefix="jax_session_state.")
        if isinstance(info.module_finder.find_spec(info.name).loader, importlib.machinery.SourceFileLoader)
        and not (public and any(part.startswith("_") for part in info.name.split(".")))
    ]
    return [jss, *(importlib.import_module(name) for name in names)]


def _is_alias(obj: object) -> bool:
    """A type alias (``tuple[str, int]``, ``A | B``): no docstring of its own."""
    return isinstance(obj, (types.GenericAlias, types.UnionType)) or typing.get_origin(obj) is not None


def _exported() -> list[tuple[str, str, object]]:
    """(module name, name, object) for every name in a public module's ``__all__``."""
    return [
        (module.__name__, name, getattr(module, name))
        for module in _modules(public=True)
        for name in getattr(module, "__all__", ())
    ]


def _needs_example(obj: object) -> bool:
    return callable(obj) and not _is_alias(obj)


def test_every_public_class_and_function_has_an_example():
    exported = _exported()
    checked = [obj for _, _, obj in exported if _needs_example(obj)]
    for obj in (
        jss.KVCache, jss.accounting.add_bytes, jss.device_key, jss.manager.planner.plan,
        jss.errors.SessionCheckedOutError,
    ):
        assert any(obj is x for x in checked), f"{obj} is not among the names checked"
    missing = sorted(
        f"{module}.{name}" for module, name, obj in exported if _needs_example(obj) and ">>>" not in (obj.__doc__ or "")
    )
    assert not missing, f"public names whose own docstring has no >>> example: {missing}"


def test_every_public_constant_is_described_in_its_module():
    undescribed = sorted(
        f"{module}.{name}"
        for module, name, obj in _exported()
        if not _needs_example(obj) and not isinstance(obj, ModuleType)
        and f"`{name}`" not in (importlib.import_module(module).__doc__ or "")
    )
    assert not undescribed, f"constants and type aliases their module's docstring does not name: {undescribed}"


def _examples(module: ModuleType) -> list[doctest.DocTest]:
    """The docstring examples of ``module`` and of what it defines (not what it imports)."""
    return [test for test in doctest.DocTestFinder().find(module) if test.examples]


MODULES_WITH_EXAMPLES = [module for module in _modules(public=False) if _examples(module)]


def test_examples_are_found_in_every_kind_of_module():
    names = {module.__name__ for module in MODULES_WITH_EXAMPLES}
    assert {"jax_session_state.errors", "jax_session_state.manager._snapshot",
            "jax_session_state.objects.kv_views"} <= names, sorted(names)


@pytest.mark.parametrize("module", MODULES_WITH_EXAMPLES, ids=lambda module: module.__name__)
def test_docstring_examples_run(module: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    report: list[str] = []
    with jax.default_device(jax.devices("cpu")[0]):
        for test in _examples(module):
            runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0
    assert results.failed == 0, "".join(report)
