"""Where a benchmark writes its latest result, and how a result names the command and paths that made it.

Each benchmark keeps one result in bench/results/ under its topic's name (`<topic>.json`, its raw figures, beside
`<topic>.md` where it writes one): a new run replaces the last (git keeps the history, and the run's time is inside
the file). Paths are written relative to the repository, so a result reads the same on any machine.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def relative(value: str) -> str:
    """`value` with the repository's absolute path taken off wherever it appears (`--config=/repo/x.yaml` too)."""
    return value.replace(f"{ROOT}/", "").replace(str(ROOT), ".")


def command(argv: list[str] | None = None) -> str:
    """The command that ran this benchmark, as one types it at the repository's root: `python bench/x.py ...`."""
    return shlex.join(["python", *(relative(a) for a in (sys.argv if argv is None else argv))])


def portable(args: dict[str, Any]) -> dict[str, Any]:
    """A run's arguments for its record: paths as strings, relative to the repository."""
    return {
        k: relative(str(v)) if isinstance(v, Path) or (isinstance(v, str) and str(ROOT) in v) else v
        for k, v in args.items()
    }


def write(topic: str, table: list[str], raw: Any) -> None:
    """A run's result under its topic: the markdown table (`<topic>.md`, also printed) and the raw figures."""
    (RESULTS / f"{topic}.md").write_text("\n".join(table) + "\n")
    (RESULTS / f"{topic}.json").write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(table))
