"""bench/record.py: results name their command and paths relative to the repository, wherever it was run."""

from __future__ import annotations

from pathlib import Path

import record


def test_a_command_reads_as_typed_at_the_repository_root() -> None:
    argv = [str(record.ROOT / "bench" / "token_path.py"), "--config", str(record.ROOT / "configs" / "config.yaml")]
    assert record.command(argv) == "python bench/token_path.py --config configs/config.yaml"


def test_arguments_keep_no_absolute_path_of_the_repository() -> None:
    args = {"out": record.ROOT / "bench" / "results", "config": f"{record.ROOT}/configs/config.yaml", "turns": 8}
    assert record.portable(args) == {"out": "bench/results", "config": "configs/config.yaml", "turns": 8}
    assert record.portable({"elsewhere": Path("/tmp/x")}) == {"elsewhere": "/tmp/x"}
