"""`make bench-quick` (bench/suite.py --quick) writes into its scratch folder, never over the full run's committed
results and plots; every part it starts, the token path's included, is told the same folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import suite


def test_a_quick_run_writes_into_its_scratch_folder_and_a_full_run_into_the_results() -> None:
    assert suite.parse_args(["--quick"]).out == suite.QUICK_RESULTS != suite.RESULTS
    assert suite.parse_args([]).out == suite.RESULTS
    assert suite.parse_args(["--quick", "--out", "/tmp/x"]).out == Path("/tmp/x")
    ignored = (suite.ROOT / ".gitignore").read_text().splitlines()
    assert "bench/results/quick/" in ignored


@pytest.mark.parametrize("quick", [True, False])
def test_every_part_is_given_the_runs_folder(monkeypatch: pytest.MonkeyPatch, quick: bool) -> None:
    ran: list[tuple[str, list[str], Path]] = []

    def run_part(script: str, argv: list[str], result: Path) -> dict[str, Any] | None:
        ran.append((script, argv, result))
        return None

    monkeypatch.setattr(suite, "_run_part", run_part)
    args = suite.parse_args(["--quick"] if quick else [])
    suite.token_streaming(args)
    suite.separate_part(args, "preemptive")
    for script, argv, result in ran:
        assert argv[argv.index("--out") + 1].startswith(str(args.out)), (script, argv)
        assert result.is_relative_to(args.out), (script, result)
        assert quick == result.is_relative_to(suite.QUICK_RESULTS)
