"""A prefill replica's sweep, every half second: sessions and answers that outlived their limits are closed or
given up, closed sessions are forgotten, and the engine scheduler's figures are exported."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from core import metrics
from prefill.handoff import HandOffs
from prefill.session import SessionState
from prefill.session_table import SessionTable

logger = logging.getLogger(__name__)
CLOSED_SESSION_RETENTION_S = 60.0


class Sweeper:
    """Expiry of the replica's sessions (its `run` is the replica's one background task)."""

    def __init__(self, table: SessionTable, handoffs: HandOffs, export_stats: Callable[[], Awaitable[None]]) -> None:
        self.table = table
        self.sessions = table.sessions
        self.handoffs = handoffs
        self.export_stats = export_stats  # the deployment's export of the engine scheduler's figures

    async def run(self) -> None:
        """Expire idle sessions, sessions whose chunk gap never filled and answers whose reader vanished;
        forget closed sessions; export the scheduler's figures."""
        ticks = 0
        shown: dict[SessionState, int] = {}  # the session gauges' values as last set
        while True:
            await asyncio.sleep(0.5)
            ticks += 1
            if ticks % 2 == 0:
                await self.export_stats()
            now = time.monotonic()
            counts = {state: sum(s.state == state for s in self.sessions.values()) for state in SessionState}
            if counts != shown:  # (a Ray metrics call each: only when one changed)
                shown = counts
                for state, count in counts.items():
                    metrics.set_gauge(metrics.SESSIONS_OPEN, count, "sessions by state", state=state.value)
            await self.table.promote_buffered()
            alive = self.table.connections_alive() if ticks % 10 == 0 else None  # (every 5 s: a GCS lookup each)
            for session in list(self.sessions.values()):
                if session.lock.locked():
                    continue  # a call is applying input to it: next tick
                try:
                    if session.state == SessionState.CLOSED:
                        if now - (session.closed_at or now) > CLOSED_SESSION_RETENTION_S:
                            self.sessions.pop(session.id, None)
                    elif (gap := session.expired_gap(now)) is not None:
                        await self.table.close(session, f"chunk {gap} never arrived")
                    elif (why := self.handoffs.expire_answer(session, now)) is not None:
                        await self.handoffs.give_up_answer(session, why)
                    elif not session.answering and now - session.last_active > session.limits.idle_timeout_s:
                        await self.table.close(session, "expired")
                    elif alive is not None and session.orphaned(now, alive.get(session.connection or "", True)):
                        await self.table.close(session, "its client's connection ended with its router replica")
                    elif not session.answering and now - session.created_at > session.limits.max_session_s:
                        await self.table.close(session, "expired: the session's time limit passed")
                except asyncio.CancelledError:
                    # Only the sweeper's own cancellation (shutdown) ends it: one session's close cancelled from
                    # inside must not stop every later expiry on this replica.
                    if (task := asyncio.current_task()) is not None and task.cancelling():
                        raise
                    logger.exception("sweeping session %s was cancelled", session.id)
                except Exception:
                    logger.exception("sweeping session %s failed", session.id)
