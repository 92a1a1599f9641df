"""bench/workloads.py: seeded Stream2LLM-like traces (no model, no server)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from workloads import PAPER, QUESTION_PREFIX, TEMPLATE, Trace, generate

ROOT = Path(__file__).resolve().parents[2]


def fake_tokens(text: str) -> int:
    return int(len(text.split()) * 1.3)


@pytest.fixture(scope="module")
def append() -> Trace:
    return generate("append", queries=300, qps=1.0, seed=3)


@pytest.fixture(scope="module")
def update() -> Trace:
    return generate("update", queries=400, qps=1.0, seed=3)


def gaps(trace: Trace) -> list[float]:
    return [b.at_s - a.at_s for q in trace.queries for a, b in zip(q.chunks, q.chunks[1:], strict=False)]


def common_prefix(a: str, b: str) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


@pytest.mark.parametrize("kind", ["append", "update"])
def test_same_seed_same_trace_other_seed_differs(kind: str, tmp_path: Path) -> None:
    paths = [tmp_path / f"{i}.json" for i in range(3)]
    for path, seed in zip(paths, [7, 7, 8], strict=True):
        generate(kind, queries=20, qps=2.0, seed=seed).save(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()


@pytest.mark.parametrize("kind", ["append", "update"])
def test_save_load_round_trip(kind: str, tmp_path: Path) -> None:
    trace = generate(kind, queries=15, qps=1.0, seed=1, count_tokens=fake_tokens)
    path = tmp_path / "sub" / "dir" / "trace.json"  # save creates parent dirs
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded == trace
    assert loaded.stats() == trace.stats()


def test_append_shape(append: Trace) -> None:
    qs = append.queries
    for q in qs:
        assert all(c.mode == "append" for c in q.chunks)
        ats = [c.at_s for c in q.chunks]
        assert ats == sorted(ats) and ats[0] > 0
        assert 2 <= len(q.chunks) <= 17
        assert q.chunks[0].text.startswith(TEMPLATE)
        assert all(c.text.endswith("\n") for c in q.chunks[:-1])
        assert QUESTION_PREFIX in q.chunks[-1].text and q.chunks[-1].text.endswith("?")
        assert all("Question:" not in c.text for c in q.chunks[:-1])
        assert q.final_text == "".join(c.text for c in q.chunks)
        assert q.ready_s == pytest.approx(q.arrival_s + q.chunks[-1].at_s)
        assert q.prompt_tokens is None and q.invalidated_tokens is None  # no tokenizer given
    assert statistics.median(len(q.chunks) for q in qs) == pytest.approx(8, abs=1)
    assert statistics.mean(len(q.chunks) for q in qs) == pytest.approx(7.86, abs=0.6)
    g = gaps(append)
    assert statistics.median(g) == pytest.approx(0.70, rel=0.12)
    assert statistics.mean(g) == pytest.approx(1.05, rel=0.2)


def test_append_queries_share_no_prefix_beyond_template(append: Trace) -> None:
    heads = [q.final_text[len(TEMPLATE) : len(TEMPLATE) + 200] for q in append.queries]
    assert len(set(heads)) == len(heads)
    # not even a few words in common: a prefix cache cannot help one query with another's text
    starts = [h[:30] for h in heads]
    assert len(set(starts)) == len(starts)


def test_update_shape(update: Trace) -> None:
    shared = updates = 0
    for q in update.queries:
        assert 2 <= len(q.chunks) <= 26
        ats = [c.at_s for c in q.chunks]
        assert ats == sorted(ats)
        for c in q.chunks:
            assert c.mode == "replace"
            assert c.text.startswith(TEMPLATE)
            assert QUESTION_PREFIX in c.text and c.text.endswith("?")
        question = q.chunks[0].text.rsplit(QUESTION_PREFIX, 1)[1]
        assert all(c.text.endswith(QUESTION_PREFIX + question) for c in q.chunks)  # the question never changes
        assert q.final_text == q.chunks[-1].text
        for a, b in zip(q.chunks, q.chunks[1:], strict=False):
            updates += 1
            assert a.text != b.text
            shared += common_prefix(a.text, b.text) > len(TEMPLATE) + 100
    assert shared >= 0.9 * updates
    assert statistics.median(len(q.chunks) for q in update.queries) == 4
    assert statistics.median(gaps(update)) == pytest.approx(0.0367, rel=0.2)


def test_poisson_arrivals() -> None:
    qps = 2.5
    trace = generate("append", queries=600, qps=qps, seed=11)
    arrivals = [q.arrival_s for q in trace.queries]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    inter = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert statistics.mean(inter) == pytest.approx(1 / qps, rel=0.1)
    # exponential: the standard deviation equals the mean
    assert statistics.stdev(inter) == pytest.approx(1 / qps, rel=0.15)


@pytest.mark.parametrize("kind", ["append", "update"])
def test_delay_multiplier_scales_within_query_times_only(kind: str) -> None:
    base = generate(kind, queries=30, qps=1.0, seed=5)
    slow = generate(kind, queries=30, qps=1.0, seed=5, delay_multiplier=10)
    for a, b in zip(base.queries, slow.queries, strict=True):
        assert b.arrival_s == a.arrival_s
        assert b.ready_s - b.arrival_s == pytest.approx(10 * (a.ready_s - a.arrival_s), abs=1e-4)
        assert [c.text for c in b.chunks] == [c.text for c in a.chunks]


def test_qps_changes_arrivals_only() -> None:
    a = generate("append", queries=20, qps=1.0, seed=2)
    b = generate("append", queries=20, qps=4.0, seed=2)
    for x, y in zip(a.queries, b.queries, strict=True):
        assert y.arrival_s == pytest.approx(x.arrival_s / 4, abs=1e-5)
        assert y.chunks == x.chunks


@pytest.mark.parametrize("kind", ["append", "update"])
def test_token_targets_with_a_tokenizer(kind: str) -> None:
    trace = generate(kind, queries=120, qps=1.0, seed=4, count_tokens=fake_tokens)
    tokens = [q.prompt_tokens for q in trace.queries]
    assert all(t is not None and 600 <= t <= 3400 * 1.05 for t in tokens)
    assert all(q.prompt_tokens == fake_tokens(q.final_text) for q in trace.queries)
    assert statistics.median(tokens) == pytest.approx(1800, rel=0.2)
    assert max(tokens) >= 3300 and min(tokens) <= 700  # the heavy tail reaches both clips
    stats = trace.stats()
    assert {"tokens_mean", "tokens_p50", "tokens_p95"} <= set(stats)
    if kind == "update":
        assert all(q.invalidated_tokens and q.invalidated_tokens > 0 for q in trace.queries)
        assert stats["invalidated_total"] == sum(q.invalidated_tokens or 0 for q in trace.queries)
    else:
        assert "invalidated_total" not in stats


def test_custom_token_range() -> None:
    trace = generate(
        "append", queries=40, qps=1.0, tokens_median=400, tokens_min=200, tokens_max=800, count_tokens=fake_tokens
    )
    assert all(200 <= (q.prompt_tokens or 0) <= 840 for q in trace.queries)


def test_stats_in_the_papers_terms(append: Trace, update: Trace) -> None:
    for trace in (append, update):
        stats = trace.stats()
        for key in ("chunks_mean", "chunks_median", "gap_p50_s", "gap_p95_s", "collect_mean_s", "collect_p50_s"):
            assert key in stats and key in PAPER[trace.kind]
        assert stats["queries"] == len(trace.queries)
        assert stats["duration_s"] == max(q.ready_s for q in trace.queries)
        assert stats["chunks_min"] >= 2
        assert "tokens_mean" not in stats  # unknown without a tokenizer


def test_pressure_kind_and_errors() -> None:
    trace = generate("pressure", queries=5, qps=1.0, delay_multiplier=10)
    assert trace.kind == "pressure" and trace.params["delay_multiplier"] == 10
    assert all(c.mode == "append" for q in trace.queries for c in q.chunks)
    with pytest.raises(ValueError):
        generate("nope", queries=1, qps=1.0)
    with pytest.raises(ValueError):
        generate("append", queries=1, qps=1.0, tokens_median=100, tokens_min=200)


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    cmd = [sys.executable, str(ROOT / "bench" / "workloads.py"), "append", "--queries", "20", "--qps", "0.5"]
    res = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=60, check=True)
    assert "chunks_median" in res.stdout and "paper" in res.stdout
    assert len(Trace.load(out).queries) == 20
