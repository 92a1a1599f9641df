"""The chaos run's short form (bench/chaos.py) on the faults app: REST sessions, realtime sessions, NDJSON bodies
and streamed chats flow while a prefill replica, a decode replica and the router are SIGKILLed, one after another.

Every answer equals its fault-free answer, first time or after a retry the client was told to make (a retryable
protocol error; a connection cut only while the router was dead); nothing is answered twice; afterwards nothing is
left on any engine, in the routers' admission or in the journal store. The package's first test: it runs on the
freshly started 2 + 2 replicas, and Serve's replacements of its victims start meanwhile, so that the next test
waits only for what is left of them. (The drain by scale-down is test_scale_down's, the package's last, and the
full run's: `python bench/chaos.py`.)

In `make test-long`, not `make test`: it adds about 70 s to a run near its 25-minute budget. (A realtime handshake
cut by the router's kill gets the proxy's own HTTP 500, not the app's JSON error: the client counts it as the cut
it is, which must come only across the router's kill.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.chaos import EFFECT_S, FAULTS, SURFACES, Cluster, chaos, fault_of, leftovers, markdown, tables
from tests.integration.faults.conftest import APP, SPEC, deploy, replicas, running

pytestmark = [pytest.mark.integration, pytest.mark.long]

PLAN = [(4.0, "prefill_kill"), (10.0, "decode_kill"), (16.0, "router_kill")]  # seconds after traffic starts
DURATION_S = 32.0  # (the router replaced ~5 s after its kill, every surface answering again ~8 s after)
RETRYABLE = ("http_429", "http_503", "close_1012", "close_1013", "realtime_error_", "sse_", "cut")


def counts() -> dict[str, int]:
    return {"router": 1} | {name: spec["num_replicas"] for name, spec in SPEC.items() if "num_replicas" in spec}


def test_mixed_traffic_survives_a_run_of_replica_kills(faults: str, pytestconfig: pytest.Config) -> None:
    cluster = Cluster(
        replicas=replicas, counts=counts, scale_prefill=lambda n: deploy(prefill={"num_replicas": n}), running=running
    )
    start, answers, done, drift = asyncio.run(chaos(faults, cluster, PLAN, DURATION_S, per_surface=1, seed=31))
    result = tables(answers, done, start)
    leaks = leftovers(APP, replicas, {sid for a in answers for sid in a.session_ids})
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")
    summary = {"command": "tests/integration/faults/test_chaos.py", "when": time.strftime("%F %T"), "settings": PLAN}
    for line in markdown({**summary, **result, "leaks": leaks, "drift": drift}).splitlines():
        reporter.write_line(line) if reporter is not None else print(line)

    assert [f.kind for f in done] == [kind for _, kind in PLAN]
    assert not result["failures"], result["failures"]
    assert not leaks, leaks
    assert not drift, drift
    for a in answers:  # errors only of the kinds a client acts on; a cut connection only when its router died
        assert all(kind.startswith(RETRYABLE) for kind in a.retries), (a.surface, a.retries)
        cuts = [t for kind, t in zip(a.retries, a.retry_times, strict=True) if kind == "cut"]
        for t in cuts:  # (between a router's kill and its replacement: the proxy may still send a request to it)
            killed = [f for f in done if f.kind == "router_kill" and f.at <= t <= f.at + (f.replaced_s or EFFECT_S)]
            assert killed, (a.surface, a.retries, fault_of(a, done))
    last = done[-1].at
    for surface in SURFACES:  # every surface answers again after the last fault
        assert any(a.surface == surface and a.attempt_started >= last for a in answers), surface
    assert set(result["by_fault"]) == {"none", *FAULTS}
