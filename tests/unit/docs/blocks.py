"""The Markdown pages a newcomer reads, and their fenced code blocks: what the docs checks (tests/unit/docs/) and
the examples run against the real stack (tests/integration/test_walkthrough.py) read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
# An example that talks to a running app (`make run`'s port): it runs against the real stack.
LIVE_URL = "localhost:8000"


def pages() -> list[Path]:
    """README.md and every page under docs/, plus the READMEs of bench/, bench/results/ and k8s/."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += [ROOT / p for p in ("bench/README.md", "bench/results/README.md", "k8s/README.md")]
    return [p for p in found if p.exists()]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def live(self) -> bool:
        """Talks to `make run`'s app: the README's and docs/'s (k8s/README.md's talk to a Kubernetes cluster)."""
        ours = self.page == ROOT / "README.md" or self.page.parent == ROOT / "docs"
        return ours and self.lang in ("python", "bash", "sh") and LIVE_URL in self.code


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    opened: tuple[int, str, str] | None = None  # (line, indent, lang)
    body: list[str] = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if opened is None and fence:
            opened, body = (number, fence.group(1), fence.group(2)), []
        elif opened is not None and fence and fence.group(1) == opened[1] and not fence.group(2):
            indent = len(opened[1])
            found.append(Block(page, opened[0], opened[2], "\n".join(b[indent:] for b in body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{page}:{opened[0]}: a code fence is never closed"
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def live_blocks() -> list[Block]:
    return [block for block in all_blocks() if block.live]
