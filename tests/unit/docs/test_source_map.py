"""docs/development.md names every source file, one line each, and names none that is gone: the map cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GUIDE = ROOT / "docs" / "development.md"
FOLDERS = ("core", "local_models", "engine", "decode", "prefill", "speech", "tts", "router", "serve_app")
ENTRY = re.compile(r"^- `([\w/]+\.py)` — \S", re.M)  # a bullet that names a file and says what it is


def sources() -> set[str]:
    """Every source file of the layered folders (an empty `__init__.py` says nothing: not listed)."""
    return {
        str(path.relative_to(ROOT))
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if not (path.name == "__init__.py" and not path.read_text().strip())
    }


def test_the_guide_lists_every_source_file_once() -> None:
    section = GUIDE.read_text().split("## Source files", 1)[1].split("\n## ", 1)[0]
    listed = ENTRY.findall(section)
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert sorted(sources() - set(listed)) == [], "source files missing from docs/development.md"
    assert sorted(set(listed) - sources()) == [], "docs/development.md lists files that do not exist"
