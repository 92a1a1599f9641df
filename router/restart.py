"""Knowing that this router replica is stopping (redeploy, scale-down) while its WebSockets can still be closed.

Ray Serve 2.60 stops a replica by draining it (`ray/serve/_private/replica.py` `_perform_graceful_shutdown`): it
waits while any request is ongoing (an open WebSocket is one) for up to `graceful_shutdown_timeout_s`, then calls
the user's `__del__`, then the controller kills the actor. A `__del__` hook therefore runs only once every
WebSocket has been cut by the kill (clients see 1006). The drain's first step sets the replica's `_shutting_down`
flag; Serve has no public hook for it, so `RestartWatch` polls that flag (private: read defensively; on a Ray
without it, nothing is closed early and nothing fails). The realtime connections then close themselves with 1012
(router/realtime/socket.py), the drain finds nothing ongoing, and the replica stops well before its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)
# Serve holds a stopping replica open for its draining period first (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S:
# 30 s by default, 3 s in the tests): a second's delay here closes the connections well within it, and costs an idle
# replica one wake a second instead of four.
POLL_S = 1.0


class Restartable(Protocol):
    def restart(self) -> None: ...


def replica_shutting_down() -> bool:
    """Whether Serve has begun to stop this replica (False outside a replica, or if Ray changed)."""
    try:
        from ray._private.worker import global_worker

        actor = global_worker.actors.get(global_worker.actor_id)  # this process's actor: Serve's ReplicaActor
        return bool(getattr(getattr(actor, "_replica_impl", None), "_shutting_down", False))
    except Exception:
        return False


class RestartWatch:
    """The connections to close when this replica stops; `stopping` once it does (new ones are then turned away)."""

    def __init__(self, probe: Callable[[], bool] = replica_shutting_down, period_s: float = POLL_S) -> None:
        self.probe, self.period_s = probe, period_s
        self.stopping = False
        self.connections: set[Restartable] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self.probe():
            await asyncio.sleep(self.period_s)
        logger.info("this router replica is stopping: closing %d realtime connections (1012)", len(self.connections))
        self.stop()

    def stop(self) -> None:
        self.stopping = True
        for connection in list(self.connections):
            connection.restart()

    def register(self, connection: Any) -> bool:
        """Track `connection` (False once stopping: it should close at once)."""
        if self.stopping:
            return False
        self.connections.add(connection)
        return True

    def unregister(self, connection: Any) -> None:
        self.connections.discard(connection)
