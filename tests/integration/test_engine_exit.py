"""vLLM's engine processes go with their replica, however it goes: a replica killed outright, the Ray processes
killed at once (`ray stop --force`, a crash), and `make run` stopped the way a supervisor or a terminal stops it
(SIGTERM to its process group). None may be left running, re-parented to init, holding the engine's memory (on a
GPU, that memory makes the next start fail).

Each test starts its own `make run` (the real target, on a free port, with a copy of configs/config.yaml) in
its own session and under its own Ray temp dir: it neither attaches to nor disturbs the cluster of the `server`
fixture, which may be up in this process. Every process of that cluster inherits a marker in its environment:
that is how the test finds its own processes, also once they have been re-parented.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from core.ports import free_port
from tests.integration.conftest import ROOT, for_tests
from tests.integration.ingress_checks import check_ingress

pytestmark = pytest.mark.integration

MARKER = "RTPD_ENGINE_EXIT_TEST"
NO_SPEECH = "no_speech"  # a cluster param: the config without its speech role
EXIT_WITHIN_S = 30.0
STARTUP_S = 420.0


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _report(procs: list[psutil.Process]) -> str:
    rows = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            rows.append(f"pid {p.pid} ppid {p.ppid()} rss {p.memory_info().rss >> 20} MiB {_name(p)}")
    return "\n".join(rows)


@dataclass
class Cluster:
    make: subprocess.Popen
    port: int
    token: str
    log: Path

    def processes(self) -> list[psutil.Process]:
        """Every live process started for this cluster, wherever it has been re-parented to."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARKER) == self.token and _alive(proc):
                    found.append(proc)
        return found

    def engines(self) -> list[psutil.Process]:
        """What the replicas started: vLLM's engine core and model workers (and their helpers). Found by descent,
        not by their titles (`VLLM::EngineCore`, `VLLM::Worker`): in two runs out of many a decode replica's
        engine processes never showed a title (setproctitle leaves a process alone when it cannot find where
        its argv is; they stayed `python` well past a minute)."""
        return [child for replica in self.replicas() for child in _descendants(replica)]

    def replicas(self) -> list[psutil.Process]:
        return [p for p in self.processes() if _name(p).startswith("ray::ServeReplica")]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert self.make.poll() is None, f"make run exited ({self.make.returncode}):\n{self.log_tail()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            time.sleep(1)
        pytest.fail(f"not healthy after {STARTUP_S:.0f} s:\n{self.log_tail()}")

    def stop_like_a_supervisor(self, within: float = EXIT_WITHIN_S) -> float:
        """SIGTERM to `make run`'s process group (a terminal's, `timeout`'s or `kill -- -PGID`'s stop); asserts
        that every process of the cluster is gone within `within` seconds and the port is free; returns the time
        the engine processes took."""
        engines = self.engines()
        started = time.monotonic()
        os.killpg(self.make.pid, signal.SIGTERM)
        took = wait_gone(engines, "after SIGTERM to `make run`")
        deadline = started + within
        while time.monotonic() < deadline and (self.make.poll() is None or self.processes() or _port_open(self.port)):
            time.sleep(0.2)
        assert self.make.poll() is not None, "make run still running"
        assert not self.processes(), f"left running:\n{_report(self.processes())}"
        assert not _port_open(self.port), f"port {self.port} still open"
        return took


def wait_gone(procs: list[psutil.Process], after: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < EXIT_WITHIN_S:
        if not any(_alive(p) for p in procs):
            return time.monotonic() - started
        time.sleep(0.1)
    left = [p for p in procs if _alive(p)]
    pytest.fail(f"engine processes still running {EXIT_WITHIN_S:.0f} s {after}:\n{_report(left)}")


def _dashboard_url(cluster: Cluster) -> str:
    """The dashboard this cluster's head started: 8265 unless another cluster on the machine holds it, so found
    by asking each port its dashboard process listens on."""
    dashboard = next(p for p in cluster.processes() if "dashboard.py" in " ".join(p.cmdline()))
    for conn in dashboard.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            url = f"http://127.0.0.1:{conn.laddr.port}"
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(f"{url}/api/version", timeout=5)  # (its metrics port answers any path: 200)
                if answer.status_code == 401 or answer.headers.get("content-type", "").startswith("application/json"):
                    return url
    pytest.fail(f"no dashboard port among {dashboard.net_connections(kind='tcp')}")


def _gcs_address(cluster: Cluster) -> str:
    """This cluster's GCS (`ray status` finds every cluster on the machine: the test session's too)."""
    for proc in cluster.processes():  # (as `ray status` finds clusters: the flag its raylet was started with)
        for arg in proc.cmdline():
            if arg.startswith(("--gcs-address=", "--gcs_address=")):
                return arg.split("=", 1)[1]
    pytest.fail(f"no process with --gcs-address among:\n{_report(cluster.processes())}")


def check_rays_tools(cluster: Cluster) -> None:
    """Ray's own tools on the cluster `make run` started, from another shell, with the one step docs/deployment.md
    names (`RAY_AUTH_MODE=token`: Ray 2.60's new local clusters want the token in ~/.ray/auth_token)."""
    started = time.monotonic()
    dashboard = _dashboard_url(cluster)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", MARKER)}
    env.update({"RAY_AUTH_MODE": "token", "RAY_TMPDIR": str(cluster.log.parent)})  # (the test's temp dir: its own)
    bin_dir = Path(sys.executable).parent

    def run(*args: str, stdin: str = "", ok: tuple[int, ...] = (0,)) -> str:
        done = subprocess.run(
            [str(bin_dir / args[0]), *args[1:]], env=env, input=stdin, capture_output=True, text=True, timeout=120
        )
        assert done.returncode in ok, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    status = run("serve", "status", "--address", dashboard)
    assert "realtime-pd" in status and "RUNNING" in status, status
    # (`--address`: only because the test session runs a cluster of its own beside it; alone, `ray status` finds it)
    assert "Active:" in run("ray", "status", "--address", _gcs_address(cluster)), "ray status found no node"
    token = run("ray", "get-auth-token").strip().splitlines()[-1]
    assert httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).status_code == 401
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{dashboard}/api/serve/applications/", headers=headers, timeout=10).status_code == 200
    # `serve shutdown` reaches the cluster (it reads the apps before it asks); answered "no", the app stays up.
    asked = run("serve", "shutdown", "--address", dashboard, stdin="n\n", ok=(0, 1))  # (1: click's "Aborted!")
    assert "This will shut down Serve" in asked, asked
    assert httpx.get(f"http://127.0.0.1:{cluster.port}/health", timeout=10).status_code == 200
    print(f"Ray's tools checked in {time.monotonic() - started:.1f} s")


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """`make run` on a free port; `request.param` (indirect parametrization): environment to start it with, and
    `NO_SPEECH` in it to leave the config's speech role out."""
    tmp = Path(tempfile.mkdtemp(prefix="rtpd-exit-", dir="/tmp"))  # short: Ray's socket paths live under it
    port = free_port()  # (Serve binds it: core/ports.py)
    param = dict(getattr(request, "param", {}))
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    if param.pop(NO_SPEECH, None):
        config["applications"][0]["args"].pop("speech", None)
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    for_tests(config["applications"][0]["args"])
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))

    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a cluster, attach to none
    env.update({MARKER: token, "RAY_TMPDIR": str(tmp), **param})
    venv = Path(sys.prefix)
    stamps = [arg for extra in ("cpu", "cuda") for arg in ("-o", f"{venv}/.installed-{extra}")]  # no (re)install
    command = ["make", *stamps, "run", f"VENV={venv}", f"CONFIG={config_path}", f"PORT={port}"]
    log = tmp / "make-run.log"
    with open(log, "wb") as out:
        # Its own session: the process group a supervisor or a terminal signals.
        make = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)
    cluster = Cluster(make, port, token, log)
    try:
        yield cluster
    finally:
        # Whatever the outcome, nothing of this cluster outlives the test (an orphaned engine holds GBs).
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)  # a terminal's Ctrl-C: serve run's own clean stop
            with contextlib.suppress(subprocess.TimeoutExpired):
                make.wait(30)
        for p in cluster.processes():
            with contextlib.suppress(psutil.Error):
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(STARTUP_S + 120)
@pytest.mark.parametrize("cluster", [{"RAY_SERVE_ENABLE_HA_PROXY": "0"}], indirect=True, ids=["serve_proxy"])
def test_engines_exit_with_a_killed_replica_and_with_make_run(cluster: Cluster) -> None:
    cluster.wait_healthy()
    # This cluster runs behind Serve's own proxy, the documented switch back from HAProxy: every surface works
    # there too (tests/integration/ingress_checks.py; test_ingress.py checks the same behind HAProxy).
    assert "haproxy" not in {_name(p) for p in cluster.processes()}
    asyncio.run(check_ingress(f"http://127.0.0.1:{cluster.port}"))
    assert len(cluster.engines()) >= 2, f"no prefill and decode engines:\n{_report(cluster.processes())}"

    # A replica killed outright (the OOM killer, `ray.kill`): its engine processes go with it.
    # (Found by its title, which a full run once did not show at the first look, failing with a bare StopIteration:
    # looked for again for a while, then a failure that lists what was there.)
    deadline = time.monotonic() + 30
    while not (decode := [p for p in cluster.replicas() if _name(p).endswith(":decode")]):
        assert time.monotonic() < deadline, f"no decode replica:\n{_report(cluster.processes())}"
        time.sleep(0.5)
    replica = decode[0]
    engines = _descendants(replica)
    assert engines, f"the decode replica has no engine processes:\n{_report(cluster.processes())}"
    replica.kill()
    took = wait_gone(engines, "after their replica was killed")
    print(f"decode engine processes gone {took:.1f} s after their replica")

    # Serve starts a new decode replica meanwhile; a supervisor stops all of it.
    took = cluster.stop_like_a_supervisor()
    print(f"engine processes gone {took:.1f} s after SIGTERM to make run")


@pytest.mark.timeout(STARTUP_S + 120)
@pytest.mark.long  # (~90 s: `make test-long`; the other test here stops `make run` with its engines in `make test`)
# The speech engine's exit is the other test's (make run as shipped); without it here, two cores start ~40 s sooner.
@pytest.mark.parametrize("cluster", [{NO_SPEECH: True}], indirect=True, ids=["prefill_decode"])
def test_engines_exit_when_ray_dies_with_the_replicas(cluster: Cluster) -> None:
    """The raylet and the replicas killed at once, as `ray stop --force` or a crash does: no Ray process is left
    to clean up after the replicas. (SIGTERM to `make run`'s group gets near this: make forwards a second
    SIGTERM that cuts `serve run`'s Ray shutdown short, and the raylet dies before the replicas. Without
    fate-sharing the engines here ran on, re-parented to init, for good.)"""
    cluster.wait_healthy()
    check_rays_tools(cluster)  # (here: this cluster runs as `make run` ships, behind HAProxy)
    engines = cluster.engines()
    assert len(engines) >= 2, f"no prefill and decode engines:\n{_report(cluster.processes())}"
    raylet = [p for p in cluster.processes() if _name(p) == "raylet"]
    for p in [*raylet, *cluster.replicas()]:
        p.kill()
    took = wait_gone(engines, "after the raylet and the replicas were killed")
    print(f"engine processes gone {took:.1f} s after Ray")
    # With its raylet gone, Ray's own processes (the HTTP proxy among them, holding the port) notice it only
    # through their health checks, seen past 30 s on two busy cores: Ray's business, not this test's (the engines,
    # its point, went). They go with the rest of the cluster, killed by the fixture.
    os.killpg(cluster.make.pid, signal.SIGKILL)
