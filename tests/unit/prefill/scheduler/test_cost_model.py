"""Latency models of recompute and swap (prefill/scheduler/cost_model.py)."""

from __future__ import annotations

import json

import pytest

from prefill.scheduler.cost_model import Fit, LatencyModel


def quadratic(a: float, b: float, c: float, xs: list[int], repeats: int = 1) -> dict[int, list[float]]:
    return {x: [a * x * x + b * x + c] * repeats for x in xs}


def test_fit_recovers_a_quadratic() -> None:
    fit = Fit.of(quadratic(2e-6, 3e-4, 1e-3, [16, 32, 64, 128, 256, 512], repeats=3))
    assert fit.coeffs == pytest.approx([2e-6, 3e-4, 1e-3], rel=1e-6, abs=1e-12)
    assert fit(1000) == pytest.approx(2e-6 * 1e6 + 3e-4 * 1000 + 1e-3, rel=1e-6)


def test_fit_averages_noisy_repeats() -> None:
    samples = {x: [0.001 * x - 0.0001, 0.001 * x + 0.0001] for x in (1, 2, 4, 8)}
    fit = Fit.of(samples)
    assert fit(4) == pytest.approx(0.004, abs=1e-9)
    assert fit.samples == samples


def test_fit_degree_follows_the_distinct_sizes() -> None:
    constant = Fit.of({8: [0.5, 0.7]})
    assert constant.coeffs == pytest.approx([0.0, 0.0, 0.6])
    linear = Fit.of({1: [1.0], 3: [3.0]})
    assert linear.coeffs == pytest.approx([0.0, 1.0, 0.0], abs=1e-9)
    empty = Fit.of({})
    assert empty.coeffs == [0.0, 0.0, 0.0]
    assert empty(100) == 0.0


def test_fit_never_predicts_negative_latency() -> None:
    fit = Fit([0.0, 1.0, -5.0])
    assert fit(2) == 0.0
    assert fit(10) == 5.0


def model(recompute: tuple[float, float, float], out: tuple[float, float, float], back: tuple[float, float, float]):
    return LatencyModel(Fit(list(recompute)), Fit(list(out)), Fit(list(back)), {"model": "t"})


def test_prefer_swap_compares_both_copies_with_a_prefill() -> None:
    # recompute: 1 ms / token; swap: 2 ms / block each way, 16 tokens a block -> swap is 8x cheaper.
    m = model((0, 1e-3, 0), (0, 2e-3, 0), (0, 2e-3, 0))
    assert m.prefer_swap(tokens=160, blocks=10)
    # A slow host link: 10 ms / block each way -> 200 ms vs 160 ms of recompute.
    slow = model((0, 1e-3, 0), (0, 1e-2, 0), (0, 1e-2, 0))
    assert not slow.prefer_swap(tokens=160, blocks=10)
    # Equal cost is not cheaper.
    even = model((0, 0, 0.4), (0, 0, 0.2), (0, 0, 0.2))
    assert not even.prefer_swap(tokens=1, blocks=1)


def test_quadratic_recompute_makes_swap_win_for_long_contexts() -> None:
    m = model((1e-7, 1e-5, 0), (0, 1e-3, 5e-3), (0, 1e-3, 5e-3))
    assert not m.prefer_swap(tokens=64, blocks=4)
    assert m.prefer_swap(tokens=8192, blocks=512)


def test_json_roundtrip_keeps_coefficients_samples_and_metadata() -> None:
    m = LatencyModel(
        Fit.of(quadratic(1e-6, 1e-4, 1e-3, [16, 32, 64])),
        Fit.of({1: [0.001, 0.002], 2: [0.003]}),
        Fit.of({1: [0.004], 4: [0.01]}),
        {"model": "local:tiny-llama", "block_size": 16},
    )
    data = json.loads(json.dumps(m.to_json()))  # through real JSON: sample keys become strings
    back = LatencyModel.from_json(data)
    assert back.recompute.coeffs == m.recompute.coeffs
    assert back.swap_out.samples == {1: [0.001, 0.002], 2: [0.003]}
    assert back.swap_in.coeffs == m.swap_in.coeffs
    assert back.metadata == m.metadata
    assert back.prefer_swap(100, 7) == m.prefer_swap(100, 7)


def test_save_and_load(tmp_path) -> None:
    m = model((1e-7, 1e-4, 0.0), (0, 1e-3, 0), (0, 2e-3, 0))
    path = tmp_path / "profiles" / "nested" / "model.json"
    m.save(path)
    loaded = LatencyModel.load(path)
    assert loaded.to_json() == m.to_json()
    for x in (0, 16, 1000):
        assert loaded.recompute(x) == m.recompute(x)


def test_from_json_without_samples_or_metadata() -> None:
    data = {name: {"coeffs": [0.0, 1.0, 0.0]} for name in ("recompute", "swap_out", "swap_in")}
    m = LatencyModel.from_json(data)
    assert m.metadata == {}
    assert m.swap_in.samples == {}
    assert m.recompute(3) == 3.0
