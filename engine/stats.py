"""A vLLM stat logger that keeps running totals a replica can report (tests, metrics, /stats)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from core import metrics


@dataclass
class EngineTotals:
    kv_transfers: int = 0  # NIXL reads this engine completed (decode side)
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_expired_requests: int = 0  # prefill side: blocks freed because decode never read them
    finished_requests: int = 0
    preemptions: int = 0
    generation_tokens: int = 0
    engine_itl_seconds_sum: float = 0.0  # inter-token latency as the engine core saw it
    engine_itl_count: int = 0
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    steps: int = 0  # engine outputs handled (a step each): an idle engine's stay the same

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TotalsStatLogger(StatLoggerBase):
    """Accumulates into a shared `EngineTotals` (vLLM instantiates loggers itself, hence the factory)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_index: int = 0,
        totals: EngineTotals | None = None,
        tags: dict[str, str] | None = None,
    ):
        self.totals = totals if totals is not None else EngineTotals()
        self.tags = tags or {}  # role and replica, for the Prometheus metrics
        self._kv_usage_shown: float | None = None  # the gauge's last value (set again only when it changes)

    @classmethod
    def factory(cls, totals: EngineTotals, tags: dict[str, str]):
        return lambda vllm_config, engine_index=0: cls(vllm_config, engine_index, totals, tags)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        t = self.totals
        t.steps += 1
        if scheduler_stats is not None:
            t.kv_cache_usage = scheduler_stats.kv_cache_usage
            t.num_running = scheduler_stats.num_running_reqs
            t.num_waiting = scheduler_stats.num_waiting_reqs
            data = scheduler_stats.kv_connector_stats or {}
            t.kv_transfers += len(data.get("transfer_duration", ()))
            t.kv_transfer_seconds += float(sum(data.get("transfer_duration", ())))
            t.kv_transfer_bytes += int(sum(data.get("bytes_transferred", ())))
            t.kv_transfer_failures += len(data.get("num_failed_transfers", ()))
            t.kv_expired_requests += len(data.get("num_kv_expired_reqs", ()))
            role = {"role": self.tags.get("role", "")}
            if t.kv_cache_usage != self._kv_usage_shown:  # (a block at a time: not every step; a Ray call each)
                self._kv_usage_shown = t.kv_cache_usage
                metrics.set_gauge(metrics.KV_CACHE_USAGE, t.kv_cache_usage, "KV cache usage (0-1)", **self.tags)
            metrics.inc(metrics.KV_TRANSFERS, len(data.get("transfer_duration", ())), "NIXL KV reads", **role)
            metrics.inc(metrics.KV_TRANSFER_BYTES, sum(data.get("bytes_transferred", ())), "NIXL KV bytes", **role)
            for seconds in data.get("transfer_duration", ()):
                metrics.observe(metrics.KV_TRANSFER_SECONDS, seconds, "NIXL KV read time", **role)
        if iteration_stats is not None:
            t.finished_requests += len(iteration_stats.finished_requests)
            t.preemptions += iteration_stats.num_preempted_reqs
            t.generation_tokens += iteration_stats.num_generation_tokens
            t.engine_itl_seconds_sum += sum(iteration_stats.inter_token_latencies_iter)
            t.engine_itl_count += len(iteration_stats.inter_token_latencies_iter)
            role = {"role": self.tags.get("role", "")}
            admitted = len(iteration_stats.time_to_first_tokens_iter)
            metrics.inc(metrics.SCHEDULER_ADMISSIONS, admitted, "requests the scheduler admitted", **role)
            metrics.inc(metrics.SCHEDULER_EVICTIONS, iteration_stats.num_preempted_reqs, "preemptions", **role)
            # Once per step and distinct latency, not per token: the requests a step continues all waited the same
            # time since their last token (one timestamp per engine output), and at 128 streams the per-token
            # observations were ~5% of a decode replica's CPU (py-spy).
            for itl in set(iteration_stats.inter_token_latencies_iter):
                metrics.observe(metrics.ITL, itl, "inter-token latency at the engine, per step", **role)

    def log_engine_initialized(self) -> None:
        pass


class NoPrometheusStatLogger(PrometheusStatLogger):
    """Takes the place of vLLM's Prometheus stat logger, which vLLM adds to every engine unless it is given one.
    That logger records every step into the process's `prometheus_client` registry, which nothing reads in a Ray
    replica (Ray exports `ray.util.metrics`; this app's engine metrics are `TotalsStatLogger`'s): 2-6% of a
    replica's CPU at 32 streams (measured 2026-11-26, docs/benchmarks.md), for nothing. Records
    nothing."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass
