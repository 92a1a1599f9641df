"""k8s/grafana-dashboard.json: valid JSON; every query uses a metric the application or Ray Serve exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[3] / "k8s" / "grafana-dashboard.json"

# Ray exports application metrics with a `ray_` prefix.
GAUGES_AND_COUNTERS = {
    "ray_rtpd_sessions_open",
    "ray_rtpd_session_chunks_total",
    "ray_rtpd_session_input_bytes_total",
    "ray_rtpd_kv_transfers_total",
    "ray_rtpd_kv_transfer_bytes_total",
    "ray_rtpd_scheduler_admissions_total",
    "ray_rtpd_scheduler_evictions_total",
    "ray_rtpd_kv_cache_usage",
    "ray_rtpd_errors_total",
    "ray_rtpd_prefill_admissions_total",
    "ray_rtpd_prefill_evictions_total",
    "ray_rtpd_prefill_swap_blocks_total",
    "ray_rtpd_prefill_swap_bytes_total",
    "ray_rtpd_prefill_swap_fallbacks_total",
    "ray_rtpd_prefill_invalidated_tokens_total",
    "ray_rtpd_prefill_recomputed_tokens_total",
    "ray_rtpd_prefill_prefix_cache_returned_tokens_total",
    "ray_rtpd_prefill_queue",
    "ray_rtpd_audio_out_seconds_total",
    "ray_rtpd_tts_audio_seconds_total",
    "ray_rtpd_tts_in_flight",
    "ray_rtpd_tts_errors_total",
}
HISTOGRAMS = {
    "ray_rtpd_ttft_seconds",
    "ray_rtpd_inter_token_latency_seconds",
    "ray_rtpd_last_chunk_to_first_token_seconds",
    "ray_rtpd_kv_transfer_seconds",
    "ray_rtpd_first_audio_seconds",
    "ray_rtpd_tts_realtime_factor",
}
METRIC = re.compile(r"\bray_[A-Za-z0-9_]+")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def metric_of(name: str) -> str | None:
    """The known metric a series name belongs to (histograms: `_bucket`, `_sum`, `_count`), else None."""
    if name in GAUGES_AND_COUNTERS or name.startswith("ray_serve_"):
        return name
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if base in HISTOGRAMS else None


def test_dashboard_is_valid_json() -> None:
    dashboard = load()
    assert dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_expr_uses_known_metrics() -> None:
    used: set[str] = set()
    for panel in panels(load()["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"{panel['title']}: no queries"
        for target in panel["targets"]:
            names = METRIC.findall(target["expr"])
            assert names, f"{panel['title']}: {target['expr']!r} references no ray_ metric"
            for name in names:
                metric = metric_of(name)
                assert metric, f"{panel['title']}: unknown metric {name}"
                used.add(metric)
            for name in names:
                if name.endswith("_bucket"):
                    assert "histogram_quantile" in target["expr"], f"{panel['title']}: buckets need a quantile"
    missing = (GAUGES_AND_COUNTERS | HISTOGRAMS) - used
    assert not missing, f"no panel for {sorted(missing)}"
    assert any(m.startswith("ray_serve_") for m in used)
