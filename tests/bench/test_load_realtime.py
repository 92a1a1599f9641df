"""bench/load_realtime.py's statistics, without a server: percentiles, errors by kind, refusals, the router's RSS."""

from __future__ import annotations

import random
from collections import Counter

from load_realtime import PhaseStats, parse_phase, parse_setting, rss_summary, summarize, turn_chunks


def test_summarize_reports_latency_percentiles_and_errors_by_kind() -> None:
    stats = PhaseStats("over", clients=300, duration_s=60.0, sessions=90, refused=40, turns=200)
    stats.latencies_s = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    stats.errors = Counter({"server_overloaded": 40, "timeout": 1})
    stats.refusal_s = [0.01] * 39 + [0.5]
    report = summarize(stats)
    assert report["first_delta_ms"] == {"n": 100, "p50": 50.5, "p99": 99.0, "max": 100.0}
    assert report["refusal_ms"]["p50"] == 10.0 and report["refusal_ms"]["p99"] > 10.0  # how quickly excess is told
    assert report["errors"] == {"server_overloaded": 40, "timeout": 1}
    assert report["unexpected_errors"] == 1  # refusals above capacity are expected, a timeout is not
    assert (report["sessions"], report["refused"], report["turns"]) == (90, 40, 200)


def test_an_empty_phase_has_no_percentiles() -> None:
    report = summarize(PhaseStats("under", clients=1, duration_s=1.0))
    assert report["first_delta_ms"]["p50"] is None and report["unexpected_errors"] == 0
    assert report["refusal_ms"] == {"p50": None, "p99": None}


def test_rss_summary() -> None:
    assert rss_summary([]) == {"samples": []}
    summary = rss_summary([(0.0, 300.0), (2.0, 340.5), (4.0, 320.0)])
    assert (summary["first_mb"], summary["max_mb"], summary["last_mb"]) == (300.0, 340.5, 320.0)


def test_a_turn_is_split_into_the_chunks_asked_for() -> None:
    chunks = turn_chunks(random.Random(1), 6)
    assert len(chunks) == 6 and all(chunks) and "".join(chunks).endswith(".")


def test_parse_phase() -> None:
    assert parse_phase("over:300:150") == ("over", 300, 150.0)
    assert parse_setting("min_sessions=8") == ("min_sessions", 8)
    assert parse_setting("target_first_token_s=0.5") == ("target_first_token_s", 0.5)
