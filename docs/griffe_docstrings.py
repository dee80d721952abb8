"""Griffe extension: reads the library's docstrings as the API reference should show them.

The docstrings are Google style with two habits of Sphinx that Markdown
renders badly; this rewrites them when the reference is built, never in the
source:

- ``Example:`` (singular) heads the runnable example; Griffe's Google parser
  only knows ``Examples:``, and would render the doctest lines as nested
  block quotes.
- Sphinx roles (``:class:`~jax_session_state.errors.CapacityError```) become
  links to the reference entry where the name resolves, and inline code
  where it does not (a name of another library).
- A paragraph ending in ``::`` followed by an indented block (a reST literal
  block) becomes a fenced Python block.
"""

from __future__ import annotations

import re
import textwrap

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([^`]+)`")
_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class LibraryDocstrings(griffe.Extension):
    """Rewrites every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                text = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
                text = _fence_literal_blocks(text)
                obj.docstring.value = _ROLE.sub(lambda m, obj=obj: _link(obj, pkg, m), text)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def _link(obj: griffe.Object, pkg: griffe.Module, match: re.Match) -> str:
    short, target = match.group(1), match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if short else target
    path = _resolve(obj, pkg, target)
    if path is None:
        return f"`{shown}`"
    return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'


def _resolve(obj: griffe.Object, pkg: griffe.Module, target: str) -> str | None:
    """The canonical path of ``target`` as named in ``obj``'s module, or None."""
    head, _, rest = target.partition(".")
    try:
        if head == pkg.name:
            found = pkg[rest] if rest else pkg
        else:
            found = obj.modules_collection[obj.resolve(head)]
            for part in rest.split(".") if rest else ():
                found = found[part]
        return found.final_target.path if found.is_alias else found.path
    except (KeyError, ValueError, griffe.NameResolutionError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        # a name outside the package, or one Griffe cannot follow
        return None


def _fence_literal_blocks(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 2 < len(lines) and not lines[i + 1].strip():
            indent = len(line) - len(line.lstrip())
            j = i + 2
            block = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            if block:
                pad = " " * indent
                out += [line.rstrip()[:-1], "", pad + "```python"]
                out += [pad + row for row in textwrap.dedent("\n".join(block)).splitlines()]
                out += [pad + "```", ""]
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)
