"""bench/cost.py's fit and bench/cost_report.py's serving totals and goals, on synthetic levels."""

from __future__ import annotations

from typing import Any

import cost
import cost_report
import pytest


def level(max_tokens: int, requests: int, per_request: dict[str, float], per_token: dict[str, float]) -> dict:
    tokens = requests * max_tokens
    used = {role: requests * per_request[role] + tokens * per_token[role] for role in per_request}
    return {"max_tokens": max_tokens, "requests": requests, "tokens": tokens, "cpu_s": used, "req_s": 100.0}


def test_the_fit_recovers_each_processs_cost_per_request_and_per_token() -> None:
    per_request = {"router": 1.5e-3, "decode_replica": 2.0e-3}
    per_token = {"router": 25e-6, "decode_replica": 40e-6}
    levels = [level(m, n, per_request, per_token) for m, n in ((1, 640), (32, 256), (128, 128), (512, 64))]
    fitted = cost.fit(levels)
    assert fitted["router"]["per_request_ms"] == pytest.approx(1.5)
    assert fitted["router"]["per_token_us"] == pytest.approx(25)
    assert fitted["decode_replica"]["per_request_ms"] == pytest.approx(2.0)
    assert fitted["decode_replica"]["per_token_us"] == pytest.approx(40)


def test_one_length_is_not_fitted() -> None:
    fitted = cost.fit([level(1, 10, {"router": 1e-3}, {"router": 0.0})])
    assert fitted["router"] == {"per_request_ms": None, "per_token_us": None}


def system(token_us: dict[str, dict[str, float]], per_request: dict[str, float], idle: dict[str, float]) -> dict:
    chat = {
        c: {
            "output_tok_s": 1000.0,
            "ttft_p90_ms": 100.0,
            "cpu": {"roles": {r: {"ms_per_1k_tokens": v} for r, v in by.items()}},
        }
        for c, by in token_us.items()
    }
    fit = {r: {"per_request_ms": v, "per_token_us": 10.0} for r, v in per_request.items()}
    levels = [{"max_tokens": 1, "requests": 640, "req_s": 200.0}]
    return {
        "chat": chat,
        "cost": {"per_request_1tok_ms": per_request, "fit": fit, "idle_pct_core": idle, "levels": levels},
    }


def test_the_goals_compare_the_apps_serving_processes_with_plain_vllms_api_server() -> None:
    results: dict[str, Any] = {
        "app": system(
            {"32": {"router": 20.0, "proxy": 10.0, "decode_replica": 30.0, "engines": 500.0}},
            {"router": 1.0, "proxy": 0.2, "prefill_replica": 0.1, "decode_replica": 1.5, "engines": 9.0},
            {"router": 1.0, "decode_replica": 1.0, "engines": 2.0, "ray": 6.0},
        ),
        "plain": system(
            {"32": {"frontend": 50.0, "engines": 400.0}}, {"frontend": 1.0, "engines": 3.0}, {"frontend": 0.5}
        ),
    }
    goals = {g["goal"]: g for g in cost_report.goals(results)}
    token = goals["serving CPU/token <= 1.5x plain at c=32"]
    assert token["value"] == pytest.approx(60 / 50) and token["met"]  # engines are not serving processes
    request = goals["serving CPU/request (1-token) <= 2x plain"]
    assert request["value"] == pytest.approx(2.8) and not request["met"]
    idle = goals["idle: the app's own processes < 5% of a core"]
    assert idle["value"] == pytest.approx(4.0) and idle["met"]  # Ray's own are beside, not in it
    assert "Where the CPU goes" in cost_report.section(results)


def test_a_levels_summary_says_how_many_tokens_its_frames_carried() -> None:
    """A server whose loop lags writes many tokens a frame (plain vLLM has run both ways): the report says so."""
    import clients

    one_a_frame, bursts = clients.Sample(ttft=0.01, itls=[0.001] * 7, tokens=8), clients.Sample(ttft=0.1, tokens=8)
    assert clients.summarise([one_a_frame], 1.0)["tokens_per_frame"] == pytest.approx(1.0)
    assert clients.summarise([bursts], 1.0)["tokens_per_frame"] == pytest.approx(8.0)
    assert clients.summarise([], 1.0)["tokens_per_frame"] is None
