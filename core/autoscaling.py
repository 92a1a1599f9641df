"""Load-aware autoscaling: open sessions for the prefill pool, active streams for the decode pool.

Ray Serve's default policy scales on ongoing requests, but a streaming session holds a prefill replica's
KV (and is real load) between its chunks, when no request is in flight. Each prefill replica reports its open
sessions (`PrefillServer.record_autoscaling_stats`); this policy counts them as ongoing work:

    desired replicas = (ongoing requests + open sessions) / target_ongoing_requests

Ray Serve applies min/max replicas, up/downscale delays and factors around it. Configure it with

    autoscaling_config:
      policy: {policy_function: core.autoscaling:session_aware_policy}

A decode replica's answers stream to routers through long-lived feeds (decode/feed.py), so Serve counts only
the short calls that start them; each decode replica reports its active streams
(`DecodeServer.record_autoscaling_stats`) and `stream_aware_policy` scales on them the same way.
"""

from __future__ import annotations

from typing import Any

OPEN_SESSIONS = "open_sessions"
ACTIVE_STREAMS = "active_streams"


def _with_reported(ctx: Any, metric: str) -> tuple[float, dict[str, Any]]:
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(metric, {})
    load = float(sum(per_replica.values()))
    target = ctx.config.get_target_ongoing_requests()
    return (ctx.total_num_requests + load) / target, {metric: load}


def session_aware_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    return _with_reported(ctx, OPEN_SESSIONS)


def stream_aware_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    return _with_reported(ctx, ACTIVE_STREAMS)
