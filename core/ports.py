"""Ports this app picks and another process binds later: the NIXL side channel's (vLLM binds it), HAProxy's stats
and metrics ports and Serve's fallback proxy's (Serve binds them).

They come from below Linux's ephemeral range (32768-60999). A port from that range can be handed out by the OS
meanwhile to another socket, or be a fixed port a process binds later: one collision with the other engine's ZMQ
and torch ports left a decode engine's handshake listener dead and its start hung; one with the Ray dashboard
agent's 52365 kept HAProxy from starting."""

from __future__ import annotations

import contextlib
import random
import socket

PICKED_PORTS = range(20000, 32768)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now (each held until all are picked), from `PICKED_PORTS`; any free port if those
    are all taken."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        candidates = iter(random.sample(PICKED_PORTS, 64 + n))
        while len(ports) < n:
            s = held.enter_context(socket.socket())
            try:
                s.bind(("", next(candidates, 0)))  # (0, once the candidates are spent: the OS picks)
            except OSError:
                continue
            ports.append(s.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]
