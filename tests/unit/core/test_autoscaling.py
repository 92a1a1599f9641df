"""The session-aware prefill autoscaling policy, with Ray Serve's own context and bounds."""

from __future__ import annotations

from types import SimpleNamespace

from ray.serve.config import AutoscalingConfig

from core.autoscaling import OPEN_SESSIONS, session_aware_policy


def ctx(replicas: int, requests: float, sessions: list[float]) -> SimpleNamespace:
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=4)
    return SimpleNamespace(
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        total_num_requests=requests,
        aggregated_metrics={OPEN_SESSIONS: {f"r{i}": s for i, s in enumerate(sessions)}},
        config=config,
    )


def test_open_sessions_count_as_load():
    desired, state = session_aware_policy(ctx(1, requests=0, sessions=[12]))
    assert desired == 3 and state["open_sessions"] == 12  # idle sessions alone ask for more replicas
    assert session_aware_policy(ctx(2, requests=4, sessions=[2, 2])) == (2, {"open_sessions": 4})


def test_no_sessions_is_the_default_policy():
    assert session_aware_policy(ctx(2, requests=8, sessions=[]))[0] == 2
    assert session_aware_policy(ctx(0, requests=8, sessions=[]))[0] == 0  # cold start is Serve's to handle
