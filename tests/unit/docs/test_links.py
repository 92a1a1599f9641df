"""Links between the pages: every relative link (README -> docs/, page -> page, page -> a file of the repository)
points at something that exists, every `#anchor` at a heading of its page, and every page under docs/ is reached
from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.docs.blocks import ROOT, pages

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(page: Path) -> str:
    """The page without its code blocks and inline code (a link there is an example, not a link)."""
    text = re.sub(r"^(\s*)```.*?^\1```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)):
        base = slug(heading)
        n, name = 0, base
        while name in found:  # GitHub numbers repeated headings
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_reached_from_the_readme() -> None:
    readme = ROOT / "README.md"
    reached = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme)}
    unreached = [p.relative_to(ROOT) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in reached]
    assert not unreached, f"README.md links none of {unreached}"


def test_slugs_as_github_makes_them() -> None:
    assert slug("Failures: prefill replicas and sessions") == "failures-prefill-replicas-and-sessions"
    assert slug("prefill.scheduler") == "prefillscheduler"
    assert slug("kv_transfer") == "kv_transfer"
    assert slug("The streaming scheduler (prefill replicas)") == "the-streaming-scheduler-prefill-replicas"
    assert slug("`suite.py`: the suite") == "suitepy-the-suite"
