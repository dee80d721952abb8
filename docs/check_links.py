"""Checks the internal links and images of a built site.

Every ``href`` and ``src`` of every HTML page that points inside the site
must name a file that exists, and a ``#fragment`` must name an ``id`` (or an
``<a name>``) on the page it points to.  External links (``https:``,
``mailto:``, ...) are not followed: the check is about what the site itself
ships.

Run:  python docs/check_links.py site
"""

from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# (tag, attribute) pairs that load or link a resource.
_LINKING = {
    ("a", "href"),
    ("link", "href"),
    ("img", "src"),
    ("script", "src"),
    ("source", "src"),
    ("iframe", "src"),
}


class _Page(HTMLParser):
    """The anchors a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.anchors: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag, url)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.anchors.add(value)
            if (tag, name) in _LINKING:
                self.links.append((tag, value))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _target(site: Path, page: Path, url: str) -> tuple[Path, str] | None:
    """The file and fragment an internal URL points to; None for an external one."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or url.startswith("//"):
        return None
    if parts.path.startswith("/"):
        path = site / unquote(parts.path).lstrip("/")
    elif parts.path:
        path = page.parent / unquote(parts.path)
    else:
        path = page
    if path.is_dir() or parts.path.endswith("/"):
        path = path / "index.html"
    return path, unquote(parts.fragment)


def broken_links(site: Path) -> list[str]:
    """Every broken internal link or image of the site, one line each (empty: none)."""
    site = site.resolve()
    pages = {path: _parse(path) for path in sorted(site.rglob("*.html"))}
    problems = []
    for page, parsed in pages.items():
        where = page.relative_to(site)
        for tag, url in parsed.links:
            target = _target(site, page, url)
            if target is None:
                continue
            path, fragment = target
            path = path.resolve()
            if site not in path.parents and path != site:
                problems.append(f"{where}: <{tag}> {url!r} points outside the site")
            elif not path.is_file():
                problems.append(f"{where}: <{tag}> {url!r}: no file {path.relative_to(site)}")
            elif fragment and path.suffix == ".html":
                anchors = pages[path].anchors if path in pages else _parse(path).anchors
                if fragment not in anchors:
                    problems.append(f"{where}: <{tag}> {url!r}: no anchor #{fragment} in {path.relative_to(site)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site's directory (mkdocs build writes site/)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"check_links: {args.site} holds no index.html; build the site first.", file=sys.stderr)
        return 2
    problems = broken_links(args.site)
    for line in problems:
        print(line, file=sys.stderr)
    pages = sum(1 for _ in args.site.rglob("*.html"))
    print(f"check_links: {pages} pages, {len(problems)} broken internal links or images.")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
