"""Ports this app picks and a process binds later (the NIXL side channel, by vLLM; HAProxy's stats and metrics and
Serve's fallback proxy, by Serve): each must be one the OS never hands out meanwhile. A port from the ephemeral
range can be: a collision with the other engine's ZMQ/torch ports left a decode start hung, and one with the Ray
dashboard agent's 52365 kept HAProxy from starting (`make test`, 2026-11-28)."""

from __future__ import annotations

import socket
from pathlib import Path

from core.ports import free_port
from serve_app import serve_env


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_side_channel_ports_come_from_below_the_ephemeral_range() -> None:
    ports = {free_port() for _ in range(20)}
    assert all(port < _ephemeral_low() for port in ports), ports
    for port in ports:  # and each is free
        with socket.socket() as s:
            s.bind(("", port))


def test_a_taken_port_is_not_picked() -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        assert taken not in {free_port() for _ in range(50)}


def test_serve_ports_come_from_below_the_ephemeral_range() -> None:
    for _ in range(10):
        env = serve_env.local_env()
        ports = [int(v) for k, v in env.items() if k.endswith("_PORT")]
        assert len(ports) == 4 and len(set(ports)) == 4, env
        assert all(port < _ephemeral_low() for port in ports), env
