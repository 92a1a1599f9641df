"""Prometheus metrics of the router and the engine replicas, exported through Ray's metrics agent.

Ray serves every process's application metrics on each node's metrics port, prefixed `ray_` (so
`rtpd_ttft_seconds` is scraped as `ray_rtpd_ttft_seconds`); k8s/grafana-dashboard.json charts them.
Metrics are created on first use, inside the process that records them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BYTES_BUCKETS = [2**k for k in range(10, 34, 2)]


@functools.cache
def _metric(kind: str, name: str, description: str, tags: tuple[str, ...], buckets: tuple[float, ...] = ()) -> Any:
    from ray.util import metrics

    if kind == "counter":
        return metrics.Counter(name, description, tag_keys=tags)
    if kind == "gauge":
        return metrics.Gauge(name, description, tag_keys=tags)
    return metrics.Histogram(name, description, boundaries=list(buckets), tag_keys=tags)


def _safe(fn: Any) -> Any:
    """Metrics never break serving (e.g. outside a Ray worker in unit tests)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(Exception):
            fn(*args, **kwargs)

    return wrapper


@_safe
def inc(name: str, value: float = 1.0, description: str = "", **tags: str) -> None:
    if value:
        _metric("counter", name, description, tuple(sorted(tags))).inc(value, tags=tags or None)


@_safe
def set_gauge(name: str, value: float, description: str = "", **tags: str) -> None:
    _metric("gauge", name, description, tuple(sorted(tags))).set(value, tags=tags or None)


@_safe
def observe(
    name: str, value: float, description: str = "", buckets: list[float] = LATENCY_BUCKETS, **tags: str
) -> None:
    _metric("histogram", name, description, tuple(sorted(tags)), tuple(buckets)).observe(value, tags=tags or None)


# The metric names, in one place (the dashboard and the metrics test use the same list).
SESSIONS_OPEN = "rtpd_sessions_open"
SESSION_CHUNKS = "rtpd_session_chunks_total"
SESSION_INPUT_BYTES = "rtpd_session_input_bytes_total"
TTFT = "rtpd_ttft_seconds"
ITL = "rtpd_inter_token_latency_seconds"
LAST_CHUNK_TO_FIRST_TOKEN = "rtpd_last_chunk_to_first_token_seconds"
KV_TRANSFERS = "rtpd_kv_transfers_total"
KV_TRANSFER_BYTES = "rtpd_kv_transfer_bytes_total"
KV_TRANSFER_SECONDS = "rtpd_kv_transfer_seconds"
SCHEDULER_ADMISSIONS = "rtpd_scheduler_admissions_total"
SCHEDULER_EVICTIONS = "rtpd_scheduler_evictions_total"
KV_CACHE_USAGE = "rtpd_kv_cache_usage"
ERRORS = "rtpd_errors_total"

ALL = [
    SESSIONS_OPEN,
    SESSION_CHUNKS,
    SESSION_INPUT_BYTES,
    TTFT,
    ITL,
    LAST_CHUNK_TO_FIRST_TOKEN,
    KV_TRANSFERS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_SECONDS,
    SCHEDULER_ADMISSIONS,
    SCHEDULER_EVICTIONS,
    KV_CACHE_USAGE,
    ERRORS,
]
