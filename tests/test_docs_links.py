"""Every relative link in README.md and docs/**/*.md points at a file that exists, and at a heading of it.

Anchors are matched the way GitHub renders headings: lower case, punctuation dropped except `-` and `_`,
spaces turned into `-`, and `-1`, `-2`, ... appended to repeated headings. Links to web pages (`https:`,
`mailto:`) are not followed: the tests run without a network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

# [text](target) and [text](target "title"); images too. Inline code is removed first, so a `[x](y)` shown
# as code is not a link.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, with their line numbers."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters of any script, digits and `_`
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match is None:
            continue
        slug = github_anchor(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def relative_links(page: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
                links.append((number, target))
    return links


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{where}: no heading with anchor #{anchor}")
        elif anchor and destination.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not Markdown")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# A heading: with `code`, punctuation\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code-punctuation) [dup](other.md#twice-1) "
                    "[web](https://example.org/x.md) `[code](missing.md)`\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere) [self](#also-nowhere)\n"
                    "```\n[fenced](missing.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file", "other.md#nowhere: no heading with anchor #nowhere",
        "#also-nowhere: no heading with anchor #also-nowhere"]


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) < 200
