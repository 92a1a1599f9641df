"""vLLM's async scheduling (on by default on CUDA, off on CPU) and the prefill role: the prefill engine runs it
off, so that the streaming scheduler's block edits between steps (swap, truncation) never race a step in flight;
under it, swap and cost eviction cannot swap, and the scheduler says so instead of falling back silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from core.config import AppConfig
from engine.llm import build_engine_args
from local_models.llm import make_local_model

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def app() -> AppConfig:
    return AppConfig.model_validate({"model": str(make_local_model())})


def test_the_prefill_engine_runs_without_async_scheduling_and_decode_keeps_vllms_default(app: AppConfig) -> None:
    assert build_engine_args(app, "prefill").async_scheduling is False
    assert build_engine_args(app, "decode").async_scheduling is None  # vLLM decides (on for CUDA decode)


def test_an_operator_may_turn_it_back_on_for_prefill(app: AppConfig) -> None:
    config = app.model_copy(deep=True)
    config.prefill.engine.engine_kwargs["async_scheduling"] = True
    assert build_engine_args(config, "prefill").async_scheduling is True


@pytest.mark.parametrize("name", ["llama-3.1-8b.yaml", "llama-3.1-70b-tp4.yaml"])
def test_the_gpu_configs_state_the_choice(name: str) -> None:
    args = yaml.safe_load((ROOT / "configs" / "gpu" / name).read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(args)
    assert config.engine_for("prefill").engine_kwargs["async_scheduling"] is False


def test_under_async_scheduling_the_scheduler_says_evictions_recompute(make, caplog) -> None:
    """The configuration a CUDA prefill engine gets if async scheduling is left on: the host pool cannot be
    used (a step in flight would read blocks being copied), and the start-up log says every eviction
    recomputes. With it off (the prefill default) the same settings swap (tests/unit/prefill/scheduler/test_swap.py)."""
    from prefill.scheduler import core

    with caplog.at_level(logging.WARNING, logger=core.logger.name):
        h = make(eviction="swap", swap_slots=8, async_scheduling=True)
    assert h.sched.vllm_config.scheduler_config.async_scheduling
    assert h.attach_info["host_slots"] == 0
    assert "every eviction recomputes" in caplog.text
    synchronous = make(eviction="swap", swap_slots=8)
    assert synchronous.attach_info["host_slots"] == 8
