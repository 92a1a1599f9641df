"""The benchmark suite's quick mode, end to end on the real stack: this app (medium local model) streaming and
not streaming, Ray Serve LLM's P/D app as the peer, the memory-pressure app under each policy. It must work,
not be fast: every query answered, every summary key there, the plots written. (The token-path part runs
bench/token_path.py, started and checked on its own; it is left out here to keep the suite's CI time down.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.skipif(
    not os.environ.get("RTPD_BENCH_SUITE"),
    reason="10 minutes on two cores, past `make test`'s budget: `make bench-check` runs it (RTPD_BENCH_SUITE=1)",
)
@pytest.mark.timeout(1500)
def test_quick_suite_replays_every_workload_against_every_system(tmp_path: Path) -> None:
    argv = ["--quick", "--parts", "append", "update", "pressure", "--out", str(tmp_path)]
    # Its own process group: on a timeout, Ray and the engines it started go with it (they hold fixed ports
    # and the engines' cores, which later tests need).
    proc = subprocess.Popen(
        [sys.executable, "bench/suite.py", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=1400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the quick suite took more than 1400 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]

    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("p50_speedup_vs_peer", "p95_speedup_vs_peer", "p99_speedup_vs_peer", "p50_speedup_vs_on_end_only"):
        assert isinstance(summary["append"][key], float) and summary["append"][key] > 0, summary["append"]
    for key in ("p50_speedup_vs_peer", "p99_speedup_vs_peer"):
        assert isinstance(summary["update"][key], float) and summary["update"][key] > 0, summary["update"]
    assert set(summary["pressure"]) >= {"fcfs", "lcas", "mcps"}
    for policy in ("fcfs", "lcas", "mcps"):
        assert all(isinstance(v, float) for v in summary["pressure"][policy].values()), summary["pressure"]
    assert isinstance(summary["completion_time_ratio_vs_peer"], float)
    assert set(summary["token_streaming"]) == {
        "tokps_ratio_vs_vllm_at_128",
        "tokps_ratio_vs_rayllm_at_128",
        "itl_p50_ratio_vs_vllm_at_32",
    }
    assert set(summary["provenance"]) >= {"command", "commit", "machine", "date"}

    raw = json.loads((tmp_path / "suite.json").read_text())
    systems = {(r["workload"], r["system"]) for r in raw["runs"]}
    for workload in ("append", "update"):
        assert {(workload, s) for s in ("streaming", "on_end_only", "peer")} <= systems
    assert {("pressure", s) for s in ("fcfs", "lcas", "mcps", "nonstreaming")} <= systems
    for run in raw["runs"]:  # every query answered, in every run
        assert run["errors"] == 0 and None not in run["ttft_ms"], (run["workload"], run["system"], run)
    for name in ("ttft_ccdf_append.png", "ttft_ccdf_update.png", "ttft_ccdf_pressure.png", "p95_vs_qps_append.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert all(system in (tmp_path / "suite.md").read_text() for system in ("streaming", "on_end_only", "peer"))
    assert list((tmp_path / "workloads").glob("append-*.json")) and list((tmp_path / "workloads").glob("update-*.json"))
