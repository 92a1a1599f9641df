"""The layers docs/development.md states, held: each folder imports only the folders its row of the layers table
names, no two modules import each other (directly or round a circle), and no module but a role's client names a
role's method in a string (`handle.<method>.remote(...)`).

Imports are read with a regex, not `ast`: CPython 3.11 can fail an `ast.parse` with "AST constructor recursion depth
mismatch" when garbage collection runs a finalizer during it, which the tests before this one leave plenty of."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "development.md"
# `from a.b import c, d` (parenthesised over several lines or not) and `import a.b, c`, at any indentation: module
# level, inside a function or under TYPE_CHECKING.
IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)|import[ \t]+([\w., \t]+))", re.M
)
ROW = re.compile(r"^\| `(\w+)/` \|[^|]*\| (.*) \|$", re.M)
REMOTE = re.compile(r"^[^#\n]*\.remote\(", re.M)  # (not in a comment)
CLIENTS = {"decode/client.py", "prefill/client.py", "speech/client.py", "tts/client.py"}


def layers(guide: str) -> dict[str, set[str]]:
    """Folder -> what it may import (module prefixes: `core`, or `decode.client` for one module), from the table."""
    rules = {folder: set(re.findall(r"`([\w.]+)`", allowed)) for folder, allowed in ROW.findall(guide)}
    assert rules, "docs/development.md has no layers table"
    return rules


def source_files(root: Path, folders: set[str]) -> dict[str, Path]:
    """Module name -> file, for every module of the layered folders."""
    found: dict[str, Path] = {}
    for folder in folders:
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(text: str, modules: set[str]) -> set[str]:
    """The project modules a file imports (`from core import metrics` is `core.metrics`)."""
    found: set[str] = set()
    for match in IMPORT.finditer(text):
        if match.group(1):
            base = match.group(1)
            names = [n.split()[0] for n in match.group(2).strip("()").replace("\n", " ").split(",") if n.strip()]
            found.update(f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names)
        else:
            found.update(n.split()[0] for n in match.group(3).split(",") if n.strip())
    return {m for m in found if m.split(".")[0] in {k.split(".")[0] for k in modules}}


def graph(root: Path, rules: dict[str, set[str]]) -> dict[str, set[str]]:
    files = source_files(root, set(rules))
    modules = set(files)
    return {name: imports(path.read_text(), modules) - {name} for name, path in files.items()}


def broken_rules(root: Path, guide: str) -> list[str]:
    rules = layers(guide)
    broken = []
    for module, imported in sorted(graph(root, rules).items()):
        folder = module.split(".")[0]
        allowed = rules[folder] | {folder}
        for target in sorted(imported):
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                may = ", ".join(sorted(rules[folder])) or "nothing of the project"
                broken.append(f"{module} imports {target} ({folder}/ may import {may})")
    return broken


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_import_follows_the_layers_table() -> None:
    assert broken_rules(ROOT, GUIDE.read_text()) == []


def test_no_import_circle() -> None:
    assert circles(graph(ROOT, layers(GUIDE.read_text()))) == []


def test_only_the_role_clients_name_role_methods() -> None:
    """`handle.<method>.remote(...)` names a method in a string in all but name: only the clients may."""
    rules = layers(GUIDE.read_text())
    calls = [
        str(path.relative_to(ROOT))
        for path in source_files(ROOT, set(rules)).values()
        if REMOTE.search(path.read_text()) and str(path.relative_to(ROOT)) not in CLIENTS
    ]
    assert calls == []


def test_the_checks_catch_a_scratch_import_and_a_circle(tmp_path: Path) -> None:
    """The checker itself: a ground-layer module importing the router breaks the table; two modules importing each
    other make a circle (a TYPE_CHECKING import counts)."""
    guide = "| `core/` | ground | nothing of the project |\n| `router/` | ingress | `core` |\n"
    for folder in ("core", "router"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "core" / "a.py").write_text("from core import b\n")
    (tmp_path / "core" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.a import A\n"
    )
    (tmp_path / "router" / "app.py").write_text("from core import (\n    a,\n    b,\n)\n")
    assert broken_rules(tmp_path, guide) == []
    assert circles(graph(tmp_path, layers(guide))) == [["core.a", "core.b"]]
    (tmp_path / "core" / "c.py").write_text("def late():\n    from router.app import x\n")
    assert broken_rules(tmp_path, guide) == ["core.c imports router.app (core/ may import nothing of the project)"]
