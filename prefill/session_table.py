"""The sessions a prefill replica holds: looked up for a caller, their input streamed to the engine within the
replica's residency limit, and closed.

The session calls (prefill/session_api.py), the hand-offs (prefill/handoff.py), failover (prefill/failover.py)
and the sweep (prefill/sweep.py) all work on this table; it knows of the rest only the preemptive answers a
closing session gives up (`PreemptiveStop`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from core import metrics
from core.config import AppConfig
from core.protocol import over_max_tokens
from core.scheduler_config import SchedulerSettings
from prefill.errors import caller
from prefill.rewrite_depth import RewriteDepth
from prefill.session import Session, SessionError, SessionState
from prefill.streaming import StreamingPrefill

if TYPE_CHECKING:
    from engine.llm import Engine

logger = logging.getLogger(__name__)
RESIDENCY_WINDOW_S = 30.0  # a session with input this recent counts as streaming (residency control)


class PreemptiveStop(Protocol):
    """What closing a session needs of its preemptive answers (prefill/preemptive.py `Preemptive`)."""

    def close(self, session: Session) -> None: ...

    def release(self, adopt: dict[str, Any]) -> None: ...


class SessionTable:
    """The replica's sessions by id, and what every part does to one: find it, stream its input, close it."""

    def __init__(
        self, sessions: dict[str, Session], engine: Engine, config: AppConfig, preemptive: PreemptiveStop
    ) -> None:
        self.sessions = sessions  # (the deployment's own dict: its routing and autoscaling figures count them)
        self.engine = engine
        self.config = config
        self.preemptive = preemptive
        # How deep this replica's sessions rewrite (prefill/rewrite_depth.py): their senders hold the rest.
        self.rewrite_depth = RewriteDepth()

    @property
    def settings(self) -> SchedulerSettings:
        return self.config.prefill.scheduler

    def streaming(self, session_id: str) -> StreamingPrefill:
        """A new session's resident prompt on the engine."""
        settings = self.settings
        return StreamingPrefill(
            self.engine,
            session_id,
            settings.admission_timeout_s,
            max_chunk_tokens=settings.partial_chunk_tokens,
            depth=self.rewrite_depth,
        )

    def get(self, session_id: str, allow_closed: bool = False) -> Session:
        session = self.sessions.get(session_id)
        if session is not None and session.tenant != caller.get():
            session = None  # another key's session does not exist for this caller
        if session is None:
            raise SessionError(404, f"session {session_id} not found", "session_id")
        if not allow_closed:
            session.check_open()
        return session

    def check_max_tokens(self, request: dict[str, Any]) -> None:
        """`max_tokens` within the server's limit (the model's context length unless set lower)."""
        if (over := over_max_tokens(request, self.config.limits.max_tokens or self.engine.max_model_len)) is not None:
            raise SessionError(400, over[1], over[0])

    async def prefill_stable(self, session: Session) -> None:
        """Stream the input's stable tokens to the engine, if the start policy allows it yet."""
        if session.answering or session.state == SessionState.CLOSED:
            return  # the conversation grows again once the answer is in; a closed session never again
        tokens = session.stable_tokens(self.engine.tokenizer)
        if len(tokens) >= self.engine.max_model_len:
            await self.close(session, "input exceeds the model's context length")
            raise SessionError(400, f"session input exceeds the context length of {self.engine.max_model_len} tokens")
        if session.streaming.active or (session.may_start(len(tokens)) and self.room_to_stream(session, tokens)):
            await session.streaming.sync(tokens)
            if tokens:
                session.state = SessionState.PREFILLING

    def room_to_stream(self, session: Session, tokens: list[int]) -> bool:
        """Residency control: whether a session not streaming yet may start, its KV and that of every session
        streaming now within `streaming_kv_fraction` of the KV cache (one session alone always may). Otherwise
        its input waits, as `on_end_only`'s does; a later chunk asks again."""
        cache = getattr(getattr(getattr(self.engine, "client", None), "vllm_config", None), "cache_config", None)
        if cache is None or not cache.num_gpu_blocks or not tokens or self.settings.policy == "vllm":
            return True  # (the `vllm` policy is the paper's streaming baseline: every session streams)
        block = cache.block_size
        # Sessions streaming now: input within the last RESIDENCY_WINDOW_S. One idle for longer is the
        # scheduler's to evict, not a reason to keep others from streaming (clients that left, say).
        now = time.monotonic()
        streaming = [
            s
            for s in self.sessions.values()
            if s is not session and s.streaming.active and now - s.last_active < RESIDENCY_WINDOW_S
        ]
        held = sum(-(-len(s.streaming.target) // block) for s in streaming)
        if (
            not streaming
            or held + -(-len(tokens) // block) <= self.settings.streaming_kv_fraction * cache.num_gpu_blocks
        ):
            return True
        if not session.buffered:
            session.buffered = True
            metrics.inc(metrics.SESSIONS_BUFFERED, 1, "sessions whose input waited for KV room to stream")
        return False

    async def promote_buffered(self) -> None:
        """Residency control's other half: a session whose input waited for room starts streaming once room frees
        (another session ended or went quiet), without waiting for its next chunk, which may be its last. Oldest
        first; the first that still does not fit waits for the next tick, and so do those behind it."""
        waiting = sorted(
            (
                s
                for s in self.sessions.values()
                if s.buffered and s.state == SessionState.OPEN and not s.streaming.active and not s.lock.locked()
            ),
            key=lambda s: s.created_at,
        )
        for session in waiting:
            try:
                async with session.lock:
                    if session.state != SessionState.OPEN or session.streaming.active:
                        continue
                    await self.prefill_stable(session)
                    if not session.streaming.active:
                        return  # no room yet (or nothing to stream): it keeps its place
                metrics.inc(metrics.SESSIONS_PROMOTED, 1, "buffered sessions that streamed once room freed")
            except Exception:
                logger.exception("promoting session %s failed", session.id)

    async def close(self, session: Session, reason: str) -> None:
        if session.state == SessionState.CLOSED:
            return
        session.state = SessionState.CLOSED
        session.close_reason = reason
        logger.info("session %s closed: %s", session.id, reason)
        session.closed_at = time.monotonic()
        if session.answering and (task := session.answers[-1].task) is not None and not task.done():
            task.cancel()  # a hand-off in progress; an answer a router streams ends on its own
        if session.preempt is not None:
            self.preemptive.close(session)
            if session.answers and (last := session.answers[-1]).adopt is not None and last.status == "ready":
                self.preemptive.release(last.adopt)  # adopted by its answer, never claimed: its decode stream goes
        await session.streaming.close()
        if session.journal is not None:  # nothing left to take over
            await session.journal.forget()
        async with session.changed:
            session.changed.notify_all()

    def open_count(self) -> int:
        """Sessions not closed (each holds a slot of the replica's capacity)."""
        return sum(s.state != SessionState.CLOSED for s in self.sessions.values())

    def connections_alive(self) -> dict[str, bool]:
        """Whether each router replica holding an open session's connection is alive (a Ray actor lookup)."""
        names = {s.connection for s in self.sessions.values() if s.connection and s.state != SessionState.CLOSED}
        return {name: _actor_alive(name) for name in names}


def _actor_alive(name: str) -> bool:
    """Whether the named Ray actor (a Serve replica: its full id is its actor's name) is alive."""
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:  # (no such live actor)
        return False
    except Exception:  # the GCS unreachable a moment: assume alive, ask again next time
        return True
    return True
