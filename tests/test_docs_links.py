"""Every relative link in the README and under docs/ leads somewhere: the file exists and, where the
link names a heading (``page.md#anchor``), the page has that heading (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered ``-1``, ``-2``."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http(s):, mailto: — not ours to check offline
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository (a clone has no such file)")
        elif not destination.exists():
            problems.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{target}: no heading with that anchor in {destination.relative_to(ROOT)}")
    return problems


def test_the_anchor_rule_matches_githubs_on_a_known_heading():
    page = ROOT / "docs/results/README.md"
    assert "4-scheduler-time-and-placement-oracle-gap-74-fig-9" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []
