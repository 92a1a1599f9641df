"""Session-aware autoscaling for the prefill pool.

Ray Serve's default policy scales on ongoing requests, but a streaming session holds a prefill replica's
KV (and is real load) between its chunks, when no request is in flight. Each prefill replica reports its open
sessions (`PrefillServer.record_autoscaling_stats`); this policy counts them as ongoing work:

    desired replicas = (ongoing requests + open sessions) / target_ongoing_requests

Ray Serve applies min/max replicas, up/downscale delays and factors around it. Configure it with

    autoscaling_config:
      policy: {policy_function: serve_app.autoscaling:session_aware_policy}
"""

from __future__ import annotations

from typing import Any

OPEN_SESSIONS = "open_sessions"


def session_aware_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(OPEN_SESSIONS, {})
    sessions = float(sum(per_replica.values()))
    target = ctx.config.get_target_ongoing_requests()
    return (ctx.total_num_requests + sessions) / target, {"open_sessions": sessions}
