"""Every relative link in README.md and docs/*.md resolves to a file or folder of this repository, and no
page names a path outside it (a reader of the repository alone must be able to follow every reference)."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"),
                *(REPO_ROOT / "examples").glob("**/README.md")])
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
# a path into the sibling folders of a development checkout: design notes, vendor code, test peers
OUTSIDE = re.compile(r"(?<![\w./-])(?:\.\./)*shared/(?:design|vendor|peers)/|\]\(\.\./\.\./\.\./")


def _prose(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _relative_links(page: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # https:, mailto:, an anchor on the same page
            found.append((number, target.split("#", 1)[0]))
    return found


def test_the_pages_exist_and_have_links():
    assert REPO_ROOT / "README.md" in PAGES and len(PAGES) >= 5
    assert sum(len(_relative_links(page)) for page in PAGES) >= 10  # the pattern finds the links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    broken = []
    for number, target in _relative_links(page):
        resolved = (page.parent / target).resolve()
        if REPO_ROOT not in (resolved, *resolved.parents):
            broken.append(f"{page.relative_to(REPO_ROOT)}:{number}: {target} leaves the repository")
        elif not resolved.exists():
            broken.append(f"{page.relative_to(REPO_ROOT)}:{number}: {target} does not exist")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_page_names_a_path_outside_the_repository(page):
    outside = [f"{page.relative_to(REPO_ROOT)}:{number}: {line.strip()}" for number, line in enumerate(page.read_text().splitlines(), 1)
               if OUTSIDE.search(line)]
    assert not outside, "\n".join(outside)


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](nope.md#x) [web](https://example.org) [anchor](#top)\n"
                    "```\n[in code](not/checked.md)\n```\nsee `../shared/design/NOTES.md`\n")
    assert _relative_links(page) == [(1, "page.md"), (1, "nope.md")]
    assert OUTSIDE.search(page.read_text().splitlines()[4])
    assert not OUTSIDE.search("the adapter's `verl/workers/remote_client/common/shared/x.py`")
