"""The HTTP ingress (serve_app/serve_env.py): HAProxy (the default) on the app's port, connected straight to the
router replicas, with timeouts past the longest session, its own ports, and dying with the Serve process that
started it; every surface works through it (the same checks run behind Serve's own proxy in test_engine_exit)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import PORT
from tests.integration.ingress_checks import check_ingress

pytestmark = pytest.mark.integration


def listener(port: int) -> psutil.Process:
    pids = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    assert len(pids) == 1, f"{len(pids)} processes listen on {port}"
    return psutil.Process(pids.pop())


HAPROXY_OFF = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "1"


def test_every_surface_works_through_the_ingress(server: str) -> None:
    asyncio.run(check_ingress(server))


@pytest.mark.skipif(HAPROXY_OFF, reason="RAY_SERVE_ENABLE_HA_PROXY=0: Serve's own proxy")
def test_haproxy_serves_the_port_with_timeouts_past_the_longest_session(server: str) -> None:
    proxy = listener(PORT)
    assert proxy.name() == "haproxy", proxy.cmdline()
    # Started through serve_app/bin/haproxy: the kernel kills it with the Serve process that started it
    # (test_engine_exit kills Ray and checks that nothing keeps the port).
    assert "RTPD_HAPROXY_BINARY" in proxy.environ() and proxy.ppid() != 1, proxy.parent().cmdline()
    args = proxy.cmdline()
    config = Path(args[args.index("-f") + 1]).read_text()
    assert re.search(r"timeout client 3660s", config), config
    assert re.search(r"hard-stop-after 3660s", config), config
    # Its own stats, metrics and fallback-proxy ports: another cluster on this machine (test_engine_exit's
    # `make run`) has others (with Serve's fixed defaults, its HAProxy sent requests to this cluster's app).
    for name in ("HAPROXY_STATS", "HAPROXY_METRICS"):
        port = int(os.environ[f"RAY_SERVE_{name}_PORT"])
        assert f":{port}" in config and listener(port).pid == proxy.pid, (name, port)
    fallback = int(os.environ["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"])
    assert f":{fallback} " in config and "ProxyActor" in " ".join(listener(fallback).cmdline()), fallback
