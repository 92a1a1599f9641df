"""The engines' stat loggers: running totals for the replica, and no Prometheus logger nothing reads."""

from __future__ import annotations

from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from engine.stats import EngineTotals, NoPrometheusStatLogger, TotalsStatLogger


def test_vllm_gets_no_prometheus_logger_beside_ours_and_ours_still_counts() -> None:
    totals = EngineTotals()
    manager = StatLoggerManager(
        vllm_config=None,  # type: ignore[arg-type]  (vLLM's own Prometheus logger would need a real one)
        custom_stat_loggers=[TotalsStatLogger.factory(totals, {"role": "decode"}), NoPrometheusStatLogger],
        enable_default_loggers=False,
    )
    prometheus = [s for s in manager.stat_loggers if isinstance(s, PrometheusStatLogger)]
    assert [type(s) for s in prometheus] == [NoPrometheusStatLogger]  # vLLM added none of its own
    iteration = IterationStats()
    iteration.num_generation_tokens = 3
    manager.record(SchedulerStats(num_running_reqs=2), iteration)
    manager.record_admission_rejection("full")
    manager.log_engine_initialized()
    assert (totals.generation_tokens, totals.num_running) == (3, 2)


def test_the_kv_usage_gauge_is_set_only_when_it_changes(monkeypatch) -> None:
    """A Ray metric call costs the replica's loop per engine step; KV usage moves a block at a time."""
    from core import metrics

    shown: list[float] = []
    monkeypatch.setattr(metrics, "set_gauge", lambda name, value, *args, **tags: shown.append(value))
    logger = TotalsStatLogger(None, 0, EngineTotals(), {"role": "decode"})  # type: ignore[arg-type]
    for usage in (0.1, 0.1, 0.1, 0.2, 0.2, 0.1):
        logger.record(SchedulerStats(kv_cache_usage=usage), None)
    assert shown == [0.1, 0.2, 0.1]
    assert logger.totals.kv_cache_usage == 0.1
