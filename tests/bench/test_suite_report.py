"""bench/suite_report.py and bench/plots.py on synthetic suite results: summary keys, ratios, goals, files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:  # bench/ modules import each other flat, as the bench scripts do
    sys.path.insert(0, BENCH)

import suite_report  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def run(workload: str, qps: float, system: str, ttft: list[float | None], completion: float) -> dict[str, Any]:
    failed = sum(v is None for v in ttft)
    kinds = {"timeout": failed} if failed else {}
    return {
        "workload": workload,
        "qps": qps,
        "system": system,
        "ttft_ms": ttft,
        "errors": failed,
        "error_kinds": kinds,
        "completion_s": completion,
        "queries": len(ttft),
    }


def level(c: int, tok_s: float, itl_p50: float, ttft_p50: float) -> dict[str, Any]:
    # The shape of one chat level in a token_path results JSON (bench/token_path.py, clients.run_level).
    return {
        "concurrency": c,
        "requests_per_client": 2,
        "requests": 2 * c,
        "errors": 0,
        "error_examples": [],
        "prompt_tokens": 416,
        "completion_tokens": 256 * c,
        "wall_s": 10.0,
        "ttft_p50_ms": ttft_p50,
        "ttft_p90_ms": 2 * ttft_p50,
        "itl_p50_ms": itl_p50,
        "itl_p90_ms": 2 * itl_p50,
        "itl_p99_ms": 3 * itl_p50,
        "output_tok_s": tok_s,
        "cpu": {"wall_s": 10.0, "roles": {}, "core_busy_pct": [], "client_pct_core": 1.0, "outside_pct_core": 0.0},
    }


def token_path(levels: tuple[str, ...] = ("1", "32", "128")) -> dict[str, Any]:
    figures = {  # system: {c: (tok/s, ITL p50, TTFT p50)}
        "app": {"1": (100.0, 8.0, 50.0), "32": (1600.0, 12.5, 300.0), "128": (1900.0, 20.0, 900.0)},
        "plain": {"1": (120.0, 7.0, 40.0), "32": (1800.0, 10.0, 600.0), "128": (2000.0, 25.0, 1200.0)},
        "rayllm": {"1": (50.0, 9.0, 90.0), "32": (1200.0, 15.0, 500.0), "128": (1000.0, 30.0, 1500.0)},
    }
    systems = {
        name: {
            "model": "local:tiny-llama",
            "base": "http://127.0.0.1:1",
            "processes": {},
            "info": {},
            "chat": {c: level(int(c), *figs[c]) for c in levels},
        }
        for name, figs in figures.items()
    }
    return {
        "timestamp": "20261121T124541Z",
        "command": "python bench/token_path.py",
        "model": "local:tiny-llama",
        "machine": {"nproc": 2, "cpu_model": "AMD EPYC"},
        "max_tokens": 128,
        "total_s": 400.0,
        "systems": systems,
        "ratios": {},
        "goals": [],
    }


def spread(median: float, n: int = 21) -> list[float]:
    # Symmetric around the median, so p50 is exactly `median`; p99 is near the top value.
    return [median * (0.5 + i / (n - 1)) for i in range(n)]


def synthetic(token_streaming: dict[str, Any] | None) -> dict[str, Any]:
    runs = []
    for qps, scale in ((0.25, 0.5), (0.5, 1.0)):
        runs.append(run("append", qps, "streaming", [*spread(100.0 * scale), None], 101.0))
        runs.append(run("append", qps, "on_end_only", spread(400.0 * scale), 100.5))
        runs.append(run("append", qps, "peer", [*spread(1000.0 * scale), None, None], 100.0))
    runs += [run("update", 1.0, s, spread(m), 50.0) for s, m in (("streaming", 200.0), ("peer", 600.0))]
    runs += [
        run("pressure", 2.0, s, spread(m), 80.0)
        for s, m in (("fcfs", 500.0), ("lcas", 400.0), ("mcps", 2000.0), ("nonstreaming", 1000.0))
    ]
    workload = {"stats": {"queries": 22, "chunks": {"mean": 6.5}}, "paper": {"queries": 1000, "chunks": {"mean": 7}}}
    return {
        "provenance": {
            "command": "python bench/suite.py",
            "commit": "abc123",
            "machine": "test box",
            "date": "2026-11-21T12:00:00Z",
            "quick": True,
        },
        "model": {"name": "local:tiny-llama"},
        "workloads": {
            "append": {"file": "bench/workloads/append-q0.5.json", **workload, "headline_qps": 0.5, "qps": [0.25, 0.5]},
            "update": {"file": "bench/workloads/update-q1.json", **workload, "headline_qps": 1.0, "qps": [1.0]},
            "pressure": {"file": "bench/workloads/pressure-q2.json", **workload, "qps": [2.0]},
        },
        "runs": runs,
        "token_streaming": token_streaming,
        "notes": ["synthetic numbers for the unit test"],
    }


REQUIRED = {
    "append": {"p50_speedup_vs_peer", "p95_speedup_vs_peer", "p99_speedup_vs_peer", "p50_speedup_vs_on_end_only"},
    "update": {"p50_speedup_vs_peer", "p99_speedup_vs_peer"},
    "token_streaming": {"tokps_ratio_vs_vllm_at_128", "tokps_ratio_vs_rayllm_at_128", "itl_p50_ratio_vs_vllm_at_32"},
    "provenance": {"command", "commit", "machine", "date"},
}
PRESSURE_KEYS = {"p50_speedup_vs_nonstreaming", "p95_speedup_vs_nonstreaming", "p99_speedup_vs_nonstreaming"}


def test_pct_linear_and_ignores_none() -> None:
    assert suite_report.pct([4.0, None, 1.0, 3.0, 2.0], 50) == 2.5
    assert suite_report.pct([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert suite_report.pct([7.0], 99) == 7.0
    assert suite_report.pct([None, None], 50) is None
    assert suite_report.pct([], 50) is None


def test_summarise_counts_failures() -> None:
    rows = suite_report.summarise(synthetic(None))
    peer = next(r for r in rows if r["workload"] == "append" and r["qps"] == 0.5 and r["system"] == "peer")
    assert (peer["n"], peer["ok"], peer["errors"]) == (23, 21, 2)
    assert peer["p50"] == pytest.approx(1000.0)
    assert peer["mean"] == pytest.approx(1000.0)
    assert peer["completion_s"] == 100.0


def test_write_files_and_summary(tmp_path: Path) -> None:
    raw = synthetic(token_path())
    paths = suite_report.write(raw, tmp_path, "20261121T000000Z")

    assert json.loads(paths["raw"].read_text()) == raw
    assert paths["raw"].name == "suite.json"  # one file per topic: the latest run
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key, subkeys in REQUIRED.items():
        assert subkeys <= set(summary[key]), key
    assert "completion_time_ratio_vs_peer" in summary
    assert set(summary["pressure"]) == {"fcfs", "lcas", "mcps"}
    for ratios in summary["pressure"].values():
        assert set(ratios) >= PRESSURE_KEYS

    # Headline QPS 0.5: peer p50 1000 ms, on_end_only 400, streaming 100 (its failed query left out).
    append = summary["append"]
    assert append["p50_speedup_vs_peer"] == pytest.approx(10.0)
    assert append["p95_speedup_vs_peer"] == pytest.approx(10.0)
    assert append["p99_speedup_vs_peer"] == pytest.approx(10.0)
    assert append["p50_speedup_vs_on_end_only"] == pytest.approx(4.0)
    assert summary["update"]["p50_speedup_vs_peer"] == pytest.approx(3.0)
    assert summary["pressure"]["fcfs"]["p50_speedup_vs_nonstreaming"] == pytest.approx(2.0)
    assert summary["pressure"]["lcas"]["p99_speedup_vs_nonstreaming"] == pytest.approx(2.5)
    assert summary["pressure"]["mcps"]["p95_speedup_vs_nonstreaming"] == pytest.approx(0.5)
    assert summary["completion_time_ratio_vs_peer"] == pytest.approx(100.0 / 101.0)
    assert summary["headline_qps"] == {"append": 0.5, "update": 1.0, "pressure": 2.0}
    ts = summary["token_streaming"]
    assert ts["tokps_ratio_vs_vllm_at_128"] == pytest.approx(0.95)
    assert ts["tokps_ratio_vs_rayllm_at_128"] == pytest.approx(1.9)
    assert ts["itl_p50_ratio_vs_vllm_at_32"] == pytest.approx(0.8)
    assert summary["provenance"]["commit"] == "abc123"

    assert summary["goals"][0]["met"] is False  # append median 10x < 11x
    assert summary["goals"][1]["met"] is True  # append P99 10x >= 3x
    assert summary["goals"][2]["met"] is True  # update median 3x >= 2.5x
    assert [g["met"] for g in summary["goals"] if g["goal"].startswith("pressure")] == [True, True]  # fcfs, lcas
    assert summary["goals"][-1]["met"] is True  # 0.99 >= 0.98

    names = {"ttft_ccdf_append", "ttft_ccdf_update", "ttft_ccdf_pressure", "p95_vs_qps_append", "p95_vs_qps_update"}
    assert names <= set(paths)
    for name in names:
        png = tmp_path / f"{name}.png"
        assert paths[name] == png and png.read_bytes()[:8] == PNG

    md = (tmp_path / "suite.md").read_text()
    for system in ("streaming", "on_end_only", "peer", "fcfs", "lcas", "mcps", "nonstreaming"):
        assert f"| {system} |" in md, system
    assert "## Goals" in md and "| goal | target | measured | result |" in md
    assert "short" in md and "met" in md
    for name in names:
        assert f"({name}.png)" in md
    assert "synthetic numbers for the unit test" in md and "abc123" in md


def test_missing_data_is_none(tmp_path: Path) -> None:
    raw = synthetic(None)
    raw["runs"] = [r for r in raw["runs"] if r["workload"] != "update" and r["system"] != "lcas"]
    paths = suite_report.write(raw, tmp_path, "x")
    summary = json.loads(paths["summary"].read_text())
    assert summary["token_streaming"] == dict.fromkeys(REQUIRED["token_streaming"])
    assert summary["update"]["p50_speedup_vs_peer"] is None
    assert summary["update"]["p99_speedup_vs_peer"] is None
    assert summary["pressure"]["lcas"] == dict.fromkeys(PRESSURE_KEYS)
    goals = {g["goal"]: g["met"] for g in summary["goals"]}
    assert next(v for k, v in goals.items() if k.startswith("update")) is None
    assert next(v for k, v in goals.items() if "lcas" in k) is None
    assert not (tmp_path / "ttft_ccdf_update.png").exists() and not (tmp_path / "p95_vs_qps_update.png").exists()
    assert (tmp_path / "ttft_ccdf_append.png").exists()
    assert "Not run in this suite" in paths["markdown"].read_text()


def test_token_streaming_level_missing() -> None:
    ts = suite_report.token_streaming_summary(token_path(levels=("1", "32")))
    assert ts["tokps_ratio_vs_vllm_at_128"] is None and ts["tokps_ratio_vs_rayllm_at_128"] is None
    assert ts["itl_p50_ratio_vs_vllm_at_32"] == pytest.approx(0.8)


def test_preemptive_answers_summary_and_goal(tmp_path: Path) -> None:
    def side(p50: float, delivered: float = 0.0, discarded: float = 0.0) -> dict[str, Any]:
        return {
            "p50_ms": p50,
            "p95_ms": 2 * p50,
            "p99_ms": 3 * p50,
            "delivered_share": delivered,
            "discarded_tokens_per_turn": discarded,
            "work_ratio": 1.0,
        }

    def run(lag: int, users: int, on: float, off: float) -> dict[str, Any]:
        speedup = {f"p{q}": off / on for q in (50, 95, 99)}
        summary = {"preemptive": side(on, 0.7, 3.5), "off": side(off), "speedup": speedup}
        return {"eot_lag_ms": lag, "concurrency": users, "summary": summary, "turns": []}

    raw = synthetic(token_path())
    raw["preemptive"] = {"runs": {"lag300_c1": run(300, 1, 20.0, 200.0), "lag300_c12": run(300, 12, 900.0, 800.0)}}
    suite_report.write(raw, tmp_path, "20261121T000000Z")
    summary = json.loads((tmp_path / "summary.json").read_text())
    low = summary["preemptive"]["lag300_c1"]
    assert low["p50_speedup"] == pytest.approx(10.0) and low["delivered_share"] == 0.7
    goal = next(g for g in summary["goals"] if g["goal"].startswith("preemptive"))
    assert goal["measured"] == pytest.approx(800 / 900) and goal["met"] is False  # saturating load: worse
    assert "## Preemptive answers" in (tmp_path / "suite.md").read_text()
