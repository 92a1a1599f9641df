"""The Serve settings of one machine's cluster (serve_app/serve_env.py)."""

from __future__ import annotations

import pytest

from serve_app import serve_env


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (4, 1), (8, 2), (12, 3), (16, 4), (96, 4)])
def test_haproxy_gets_a_thread_per_four_cores_up_to_rays_four(cpus: int, threads: int) -> None:
    assert serve_env.haproxy_threads(cpus) == threads


def test_a_machines_cluster_sets_haproxys_threads_unless_the_environment_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_HAPROXY_NBTHREAD", raising=False)
    assert serve_env.local_env()["RAY_SERVE_HAPROXY_NBTHREAD"] == str(serve_env.haproxy_threads())
    monkeypatch.setenv("RAY_SERVE_HAPROXY_NBTHREAD", "3")
    assert serve_env.local_env()["RAY_SERVE_HAPROXY_NBTHREAD"] == "3"
    assert "RAY_SERVE_HAPROXY_NBTHREAD" not in serve_env.SERVE_ENV  # (the manifests' pods keep Ray's default)


@pytest.mark.parametrize(("cpus", "interval"), [(1, 0.5), (2, 0.5), (7, 0.5), (8, None), (64, None)])
def test_small_machines_run_serves_control_loop_every_half_second(cpus: int, interval: float | None) -> None:
    assert serve_env.control_loop_interval_s(cpus) == interval


def test_a_machines_cluster_sets_the_control_loop_unless_the_environment_does(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    monkeypatch.delenv(key, raising=False)
    for cpus, expected in ((2, "0.5"), (16, None)):  # (whatever cores this machine has)
        monkeypatch.setattr(serve_env.os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)), raising=False)
        for haproxy in ("1", "0"):  # (with Serve's own proxy too)
            monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", haproxy)
            assert serve_env.settings().get(key) == expected
    monkeypatch.setenv(key, "0.2")
    assert serve_env.settings()[key] == "0.2"
    assert key not in serve_env.SERVE_ENV  # (the manifests' pods keep Ray's default)


def test_a_machines_cluster_turns_rays_event_stats_off_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "RAY_event_stats"
    monkeypatch.delenv(key, raising=False)
    for haproxy in ("1", "0"):
        monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", haproxy)
        assert serve_env.settings()[key] == "0"
    monkeypatch.setenv(key, "1")
    assert serve_env.settings()[key] == "1"
    assert key not in serve_env.SERVE_ENV  # (the manifests' pods keep Ray's default)
