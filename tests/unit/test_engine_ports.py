"""The NIXL side channel's port: picked by the replica, bound later by vLLM, so it must be one the OS never
hands out meanwhile (a collision with the other engine's ZMQ/torch ports left a decode start hung)."""

from __future__ import annotations

import socket
from pathlib import Path

from serve_app.engine import _free_port


def test_side_channel_ports_come_from_below_the_ephemeral_range() -> None:
    low, _high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {_free_port() for _ in range(20)}
    assert all(port < low for port in ports), ports
    for port in ports:  # and each is free
        with socket.socket() as s:
            s.bind(("", port))


def test_a_taken_port_is_not_picked() -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        assert taken not in {_free_port() for _ in range(50)}
