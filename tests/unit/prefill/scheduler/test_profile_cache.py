"""A node's saved latency profiles (prefill/scheduler/profile_cache.py) and their use at a replica's start
(prefill/scheduler/profile.py `load_or_profile`). The engine is a stand-in: profiling itself runs in the
integration tests, on real engines."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.scheduler_config import SchedulerSettings
from prefill.scheduler import profile, profile_cache
from prefill.scheduler.cost_model import Fit, LatencyModel

STATS = {"block_bytes": 65536, "host_slots": 512}


class Engine:
    def __init__(self, block_size: int = 128, model: str = "/models/tiny") -> None:
        self.client = SimpleNamespace(model_config=SimpleNamespace(model=model, dtype="torch.float32"))
        self.max_model_len, self.block_size = 2048, block_size
        self.app = SimpleNamespace(model=model)

    async def compute_stats(self) -> dict[str, Any]:
        return {"scheduler": dict(STATS)}


def latency(c: float) -> LatencyModel:
    return LatencyModel(Fit([c]), Fit([c]), Fit([c]), {"profiled_at": "then"})


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RTPD_PROFILE_CACHE", str(tmp_path))
    return tmp_path


def test_the_key_changes_with_what_latency_depends_on(monkeypatch: pytest.MonkeyPatch) -> None:
    base = profile_cache.key(Engine(), STATS)
    assert profile_cache.key(Engine(), dict(STATS)) == base
    assert profile_cache.key(Engine(block_size=16), STATS) != base
    assert profile_cache.key(Engine(model="/models/other"), STATS) != base
    assert profile_cache.key(Engine(), {**STATS, "host_slots": 0}) != base
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")  # other cores: another machine, as far as latency goes
    assert profile_cache.key(Engine(), STATS) != base


def test_a_saved_profile_reads_back_until_it_is_a_day_old(cache: Path) -> None:
    assert profile_cache.load("k") is None
    profile_cache.save("k", latency(0.5))
    assert profile_cache.load("k").recompute.coeffs == [0.5]
    assert [p.name for p in cache.iterdir()] == ["k.json"]  # (no temporary file left)
    old = time.time() - profile_cache.MAX_AGE_S - 10
    os.utime(cache / "k.json", (old, old))
    assert profile_cache.load("k") is None


def test_a_damaged_profile_is_profiled_again(cache: Path) -> None:
    (cache / "k.json").write_text('{"recompute": ')
    assert profile_cache.load("k") is None


def test_no_cache_when_the_variable_is_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RTPD_PROFILE_CACHE", "")
    profile_cache.save("k", latency(0.5))
    assert profile_cache.load("k") is None


async def test_a_second_replica_loads_the_first_ones_profile(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[float] = []

    async def profiling(engine: Any, repeats: int = 3) -> LatencyModel:
        made.append(0.1 * (len(made) + 1))
        return latency(made[-1])

    monkeypatch.setattr(profile, "profile", profiling)
    settings = SchedulerSettings(eviction="cost")
    first = await profile.load_or_profile(Engine(), settings)
    second = await profile.load_or_profile(Engine(), settings)
    assert made == [0.1] and second.recompute.coeffs == first.recompute.coeffs == [0.1]
    # Another engine profiles for itself; `profile_on_start` always profiles, and its profile is kept.
    await profile.load_or_profile(Engine(block_size=16), settings)
    fresh = await profile.load_or_profile(Engine(), settings.model_copy(update={"profile_on_start": True}))
    assert len(made) == 3 and fresh.recompute.coeffs == [made[-1]]
    assert (await profile.load_or_profile(Engine(), settings)).recompute.coeffs == [made[-1]]
