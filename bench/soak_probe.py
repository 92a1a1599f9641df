"""What the soak samples each minute: every process's RSS, open file descriptors and threads, and the app's own state
(open sessions, KV blocks in use, work in flight, journal records in the GCS store).

Processes are this run's own descendants (bench/cpu.py), named by role from their command line: Ray's process
titles (`ray::ServeReplica:<app>:router`, `ray::ServeController`, `ray::ProxyActor`), `gcs_server`, `raylet`,
`haproxy`, and vLLM's engine processes (`VLLM::EngineCore`, its worker), which are named after the replica that
started them (`prefill VLLM::EngineCore`). Several processes of one name get `#1`, `#2` by pid.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil
from cpu import _cmdline, descendants

from prefill.store import NAMESPACE

ROLES = {  # first match wins
    "router": "ServeReplica:{app}:router",
    "prefill": "ServeReplica:{app}:prefill",
    "decode": "ServeReplica:{app}:decode",
    "speech": "ServeReplica:{app}:speech",
    "controller": "ServeController",
    "serve proxy": "ProxyActor",
    "haproxy": "haproxy",
    "gcs_server": "gcs_server",
    "raylet": "raylet",
}
REPLICAS = ("prefill", "decode", "speech")
ENGINES = "VLLM::"
MIB = 2**20


def _role(line: str, app: str) -> str | None:
    return next((role for role, pattern in ROLES.items() if pattern.format(app=app) in line), None)


def _engine_name(p: psutil.Process, line: str, app: str) -> str:
    """`<replica role> <vLLM process title>`: the replica is the nearest ancestor with a role."""
    title = next((part for part in line.split() if ENGINES in part), line[:40])
    with contextlib.suppress(psutil.Error):
        for parent in p.parents():
            if (role := _role(_cmdline(parent), app)) in REPLICAS:
                return f"{role} {title}"
    return f"? {title}"


def processes(app: str) -> dict[str, psutil.Process]:
    """name -> process, for every process of the app's stack among this run's descendants."""
    named: dict[str, list[psutil.Process]] = {}
    for p in descendants():
        line = _cmdline(p)
        name = _engine_name(p, line, app) if ENGINES in line else _role(line, app)
        if name is not None:
            named.setdefault(name, []).append(p)
    out = {}
    for name, procs in named.items():
        procs.sort(key=lambda p: p.pid)
        out |= {name if len(procs) == 1 else f"{name} #{i + 1}": p for i, p in enumerate(procs)}
    return out


def process_figures(procs: dict[str, psutil.Process]) -> dict[str, dict[str, Any]]:
    """name -> {pid, rss_mib, fds, threads}; a process gone since it was found is left out."""
    out = {}
    for name, p in procs.items():
        with contextlib.suppress(psutil.Error), p.oneshot():
            out[name] = {
                "pid": p.pid,
                "rss_mib": round(p.memory_info().rss / MIB, 1),
                "fds": p.num_fds(),
                "threads": p.num_threads(),
            }
    return out


def journal_records() -> dict[str, int]:
    """Journal records and sessions with any key in the GCS store (prefill/store.py's key layout)."""
    from ray.experimental.internal_kv import _internal_kv_list

    keys = [k.decode() for k in _internal_kv_list(b"s/", namespace=NAMESPACE)]
    return {"journal_records": sum("/r/" in k for k in keys), "journal_sessions": len({k.split("/")[1] for k in keys})}


def app_state(app: str) -> dict[str, float]:
    """The app's own gauges, from its deployments' `stats` / `admission_state` (as the integration tests read them)."""
    from ray import serve

    def call(role: str, method: str) -> dict[str, Any]:
        handle = serve.get_deployment_handle(role, app_name=app)
        return getattr(handle, method).remote().result(timeout_s=60)

    out: dict[str, float] = {}
    for role in ("prefill", "decode"):
        s = call(role, "stats")
        out[f"{role}_kv_blocks_used"] = s["kv_blocks_total"] - s["kv_blocks_free"]
        out[f"{role}_requests"] = s.get("num_requests", 0)
        if role == "prefill":
            out["sessions_open"] = s["sessions_open"]
    with contextlib.suppress(Exception):  # (no speech role in this config)
        out["speech_in_flight"] = call("speech", "stats")["in_flight"]
    out["router_in_flight"] = call("router", "admission_state")["in_flight"]
    return out | journal_records()
