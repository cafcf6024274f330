"""The README is a front door and the docs/ pages link only to what exists.

Every relative Markdown link `[text](path)` or `[text](path#anchor)` in README.md and docs/*.md
names a file that exists (relative to the page that links it), and an anchor names a heading of
its target by GitHub's slug rule. Links to other sites (http, https, mailto) are not followed;
code blocks and inline code are not read for links. The README stays at most 250 lines and links
every docs page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

_FENCED = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) or ![alt](target "title"); the text may hold inline code, not brackets.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_EXTERNAL = ("http://", "https://", "mailto:")


def pages() -> list[Path]:
    """The README and every docs page."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where links are not links."""
    return _INLINE_CODE.sub("", _FENCED.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens, underscores and
    spaces kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    names = set()
    for heading in _HEADING.findall(_FENCED.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        names.add(base if count == 0 else f"{base}-{count}")
    return names


def links(page: Path) -> list[str]:
    """The targets of a page's Markdown links, as written."""
    return _LINK.findall(_prose(page.read_text(encoding="utf-8")))


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file or heading does not exist, with the reason."""
    broken = []
    for target in links(page):
        if target.startswith(_EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


def linked_files(page: Path) -> set[Path]:
    """The files a page's relative links point at."""
    found = set()
    for target in links(page):
        path = target.partition("#")[0]
        if path and not target.startswith(_EXTERNAL):
            found.add((page.parent / path).resolve())
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_a_front_door() -> None:
    num_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines"


def test_readme_links_every_docs_page() -> None:
    docs_pages = sorted(DOCS.glob("*.md"))
    assert docs_pages, "docs/ holds no page"
    unlinked = [p.name for p in docs_pages if p.resolve() not in linked_files(README)]
    assert unlinked == []


def test_checker_catches_broken_links(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A reply cut: inside `a call`\n")
    (tmp_path / "image.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Same\n\n## Same\n\n"
        "[ok](other.md) [ok](other.md#a-reply-cut-inside-a-call) ![ok](image.png)\n"
        "[ok](#same-1) [ok](https://example.com/missing.md) [`ok`](other.md#other-page)\n"
        "[missing file](missing.md) [missing anchor](other.md#nowhere) [self](#same-2)\n"
        "`[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == [
        "missing.md",
        "other.md#nowhere",
        "#same-2",
    ]
