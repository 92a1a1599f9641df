"""One second application for every fault test: two prefill and two decode replicas beside the main app, deployed
once for the package and changed the way an operator changes it (`serve deploy` of a new config).

The tests run in file order, each leaving the app with what the next needs: a decode replica killed
(test_decode_death), a prefill replica killed (test_prefill_death; Serve replaces each), the router redeployed
(test_router_restart), and prefill scaled down to one replica (test_scale_down, last). Every test first waits
until the replicas it needs run. One app instead of one each keeps `make test` within its time budget: an app's
engines take minutes to start on two cores.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.integration.conftest import app_args, deploy_app

APP, PREFIX = "faults", "/faults"
LEASE_S = 12  # the NIXL lease (kv_transfer.lease_s): a failed transfer's prefill blocks are freed after it
START_S = 420  # engines starting on two busy cores

# What is deployed now: each change keeps the rest (a deployment left out would fall back to its default).
SPEC: dict[str, dict[str, Any]] = {
    "prefill": {"name": "prefill", "num_replicas": 2},
    "decode": {"name": "decode", "num_replicas": 2},
}


def args() -> dict[str, Any]:
    config = copy.deepcopy(app_args())
    config.setdefault("kv_transfer", {})["lease_s"] = LEASE_S
    return config


def deploy(**changes: dict[str, Any]) -> None:
    """Redeploy with `changes` to deployments (e.g. `router={"ray_actor_options": ...}`) on top of the current
    spec; the same args, so only what changed is restarted or rescaled."""
    for name, change in changes.items():
        SPEC.setdefault(name, {"name": name}).update(change)
    deploy_app(APP, PREFIX, args(), list(copy.deepcopy(SPEC).values()))


def replicas(role: str) -> dict[str, int]:
    """The live replicas of a deployment of the app: replica id -> process id (the GCS actor table)."""
    prefix = f"SERVE_REPLICA::{APP}#{role}#"
    actors = ray._private.state.actors(actor_state_name="ALIVE").values()
    return {a["Name"][len(prefix) :]: a["Pid"] for a in actors if a["Name"].startswith(prefix) and a["Pid"]}


def running(role: str) -> int:
    """The replicas of a deployment of the app that Serve runs (RUNNING: started and serving, not only alive)."""
    status = serve.status().applications.get(APP)
    deployment = status.deployments.get(role) if status is not None else None
    return deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0


def wait_running(timeout: float = START_S) -> None:
    """Until the app runs as deployed: every deployment at its replica count, and no other replica alive."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            counts = {name: spec["num_replicas"] for name, spec in SPEC.items() if "num_replicas" in spec}
            running = {name: status.deployments[name].replica_states.get("RUNNING", 0) for name in counts}
            if running == counts and all(len(replicas(name)) == n for name, n in counts.items()):
                return
        time.sleep(1)
    raise AssertionError(f"{APP} did not reach {SPEC}: {serve.status()}")


def handle(role: str) -> Any:
    return serve.get_deployment_handle(role, app_name=APP)


def prefill_stats(replica: str) -> dict[str, Any]:
    """One prefill replica's engine and session figures."""
    return handle("prefill").stats.remote(route_to=replica).result(timeout_s=60)


@pytest.fixture(scope="package")
def faults_app(server: str) -> Iterator[str]:
    """The app's base URL, once it runs as deployed (and again at the start of every test that asks for it)."""
    deploy()
    base = f"{server}{PREFIX}"
    wait_running()
    deadline = time.time() + 120
    while httpx.get(f"{base}/health", timeout=10).status_code != 200:
        assert time.time() < deadline, f"{APP} never became healthy"
        time.sleep(1)
    yield base
    serve.delete(APP, _blocking=False)  # (its replicas finish stopping beside the next tests)


@pytest.fixture
def faults(faults_app: str) -> str:
    """The app's base URL, the app as deployed: replacements for replicas killed by an earlier test started."""
    wait_running()
    return faults_app
