"""Dependencies that must go one way: the shared engine (engine/llm.py) imports nothing of the prefill
role that starts its scheduler but the scheduler's config, and router/ and prefill/ do not import each other (the
session -> replica mapping lives in core/placement.py); speech/ imports no other role."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A statement that imports, at module level or inside a function. (Not `ast`: CPython 3.11 can fail an
# `ast.parse` with "AST constructor recursion depth mismatch" when garbage collection runs a finalizer during
# it, which the tests before this one leave plenty of.)
IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w., ]+))", re.MULTILINE)


def imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside a function."""
    found: set[str] = set()
    for match in IMPORT.finditer(path.read_text()):
        if match.group(1):
            found.add(match.group(1))
        else:
            found.update(name.split()[0] for name in match.group(2).split(",") if name.strip())  # (`a as b`)
    return found


def test_the_shared_engine_does_not_import_the_prefill_scheduler_that_starts_it() -> None:
    engine = imports(ROOT / "engine" / "llm.py")
    assert not {m for m in engine if m.split(".")[0] == "prefill" and m != "core.scheduler_config"}, engine


def test_router_and_prefill_do_not_import_each_other() -> None:
    for package, other in (("router", "prefill"), ("prefill", "router")):
        for path in (ROOT / package).rglob("*.py"):
            crossing = {m for m in imports(path) if m == other or m.startswith(other + ".")}
            assert not crossing, f"{path.relative_to(ROOT)} imports {crossing}"


def test_the_speech_role_imports_no_other_role() -> None:
    """speech/ (its replicas, and the utterance client the router uses) stands alone: the router imports it, not
    the other way round."""
    for path in (ROOT / "speech").rglob("*.py"):
        crossing = {m for m in imports(path) if m.split(".")[0] in ("router", "prefill", "decode")}
        assert not crossing, f"{path.relative_to(ROOT)} imports {crossing}"
