"""A session's answer, from the prefill side: hand the KV off, let a router claim it, hear how it ended.

At end of input the owner prefills what is left and makes the hand-off (a one-token request over the whole
input with `do_remote_decode`: its KV stays here for decode to pull over NIXL); a short input's answer is computed
by decode instead (`router.disaggregation.min_session_prompt_tokens`). A router that serves the
answer (`/events`, `/result`, realtime `response.create`, an NDJSON request) claims it, calls decode itself
and streams decode's frames straight to its client; when the answer ends it reports the text and usage
(`session_answer_done`), which join the conversation. No token of the answer passes through this replica.

One reader claims an answer; a second reader of the same answer waits for its end and gets it whole. A
hand-off not claimed within half the NIXL lease is made again at claim time (the prefix cache gives the KV
back), so a late reader never finds the KV gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from core import metrics
from core.config import AppConfig
from core.scheduler_config import SchedulerSettings
from prefill.answer import DONE, Answer, Prefill
from prefill.conversation import SessionError
from prefill.errors import overloaded
from prefill.preempt_state import Preemption
from prefill.session import Session, SessionState
from prefill.session_table import SessionTable

logger = logging.getLogger(__name__)
WAIT_POLL_S = 5.0  # the longest a reader's call waits here for an answer to exist or end; it then asks again
MAX_WAITERS = 8  # readers waiting on one session at once (each holds one of the replica's request slots)
CHARS_PER_TOKEN = 16  # more characters per token than any tokenizer makes of text (a cheap bound before counting)
READER_LEASE_S = 30.0  # a streamed answer whose reader gave no sign of life for this long is given up on


class AnswerPreemption(Protocol):
    """What an answer needs of the session's preemptive answers (prefill/preemptive.py `Preemptive`)."""

    async def take(self, session: Session, final: dict[str, Any]) -> Preemption | None: ...

    def release(self, adopt: dict[str, Any]) -> None: ...

    def provisional(self, session: Session) -> dict[str, Any] | None: ...


class HandOffs:
    """The answer half of a session's life on its owner: the hand-off made, claimed, reported, waited for."""

    def __init__(self, table: SessionTable, preemptive: AnswerPreemption, prefill: Prefill, config: AppConfig) -> None:
        self.table = table
        self.preemptive = preemptive
        self.prefill = prefill  # the replica's prefill, which makes the hand-off
        self.config = config

    @property
    def settings(self) -> SchedulerSettings:
        return self.config.prefill.scheduler

    # --- starting ----------------------------------------------------------------------------------
    def check_overrides(self, overrides: dict[str, Any]) -> None:
        if (overrides.get("n") or 1) != 1:
            raise SessionError(400, "n must be 1", "n")
        self.table.check_max_tokens(overrides)

    async def start_answer(self, session: Session, overrides: dict[str, Any]) -> Answer:
        self.check_overrides(overrides)
        session.commit_buffer()
        answer = Answer(turn=len(session.answers), overrides=dict(overrides))
        session.answers.append(answer)
        session.state = SessionState.ANSWERING
        recorded = session.record("answer", overrides=answer.overrides)
        answer.task = asyncio.create_task(self.hand_off(session, answer))
        await _notify(session)
        await recorded
        return answer

    async def hand_off(self, session: Session, answer: Answer) -> None:
        """Prefill what is left and leave the KV for decode; the answer is then `ready` (or `failed`)."""
        answer.status, answer.preparing_at, answer.adopt, answer.local = "preparing", time.monotonic(), None, False
        try:
            overrides = dict(answer.overrides)
            request = {**session.full_request(overrides.pop("instructions", None)), **overrides}
            answer.include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            # A preemptive answer made from exactly this input is the answer (prefill/preemptive.py).
            live = await self.preemptive.take(session, request) if session.preempt is not None else None
            if live is not None:
                session.streaming.stop_input()
                answer.input_done_at = time.monotonic()
                request.update(stream=True, stream_options={"include_usage": True}, request_id=live.stream_id)
                request["kv_transfer_params"] = live.request["kv_transfer_params"]
                answer.adopt = {"replica": live.replica, "parked": live.parked, "stream_id": live.stream_id}
                answer.request, answer.status = request, "ready"
                answer.mark_handed_off()  # (no prefill and no hand-off after the end of input: handoff_ms ~ 0)
                answer.timing["preempted_ms"] = (time.monotonic() - live.started_at) * 1e3  # started that early
                return
            # The owner learns the usage from the router's report, whatever the client asked for.
            request.update(stream=True, stream_options={"include_usage": True})
            answer.handoffs += 1
            request["request_id"] = f"{session.id}-t{answer.turn}-h{answer.handoffs}"
            if self._short(session, request):
                # A short input: decode computes the prompt, as a short whole prompt's (moving its few blocks of KV
                # costs more than computing them); the request goes to decode without `kv_transfer_params`, and
                # nothing is waited for here.
                session.streaming.stop_input()
                answer.input_done_at = time.monotonic()
                answer.request, answer.status, answer.local = request, "ready", True
                answer.mark_handed_off()
                return
            if session.streaming.active:
                # Nothing more streams (the hand-off computes the rest as complete work); a useful chunk in flight
                # is waited for, ranked complete meanwhile, so that the hand-off finds its blocks cached.
                await session.streaming.finish_input()
            answer.input_done_at = time.monotonic()
            handoff = await self.prefill(session.endpoint, request, session.streaming)
            if "error" in handoff:
                answer.finish("failed", handoff["error"])
            else:
                request["kv_transfer_params"] = handoff["kv_transfer_params"]
                answer.request, answer.status = request, "ready"
                answer.mark_handed_off()
        except asyncio.CancelledError:
            answer.finish("cancelled")
        except TimeoutError:  # the session's input could not be prefilled in time
            answer.finish("failed", overloaded(self.settings.retry_after_s)["error"])
        except Exception as e:
            logger.exception("session %s: hand-off failed", session.id)
            answer.finish("failed", {"message": f"hand-off failed: {e}", "type": "InternalServerError", "code": 500})
        finally:
            if answer.done:
                await self._answer_ended(session, answer)
            await _notify(session)

    def _short(self, session: Session, request: dict[str, Any]) -> bool:
        """Whether the session's input (`request`: the answer's) is under `min_session_prompt_tokens` (what streamed
        already says so when it is not; a session that has not streamed, `on_end_only`, is counted)."""
        limit = self.config.router.disaggregation.min_session_prompt_tokens
        if not limit or len(session.streaming.target) >= limit:
            return False
        if len(json.dumps(request.get("messages") or request.get("prompt") or "")) > limit * CHARS_PER_TOKEN:
            return False  # (too long to be short, whatever the tokenizer says: not tokenized on this event loop)
        return len(session.stable_tokens(self.table.engine.tokenizer)) < limit

    async def _answer_ended(self, session: Session, answer: Answer) -> None:
        """The answer joins the conversation, and the conversation stays resident for the next turn."""
        if answer.status == "failed":
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="session_answer")
        session.conversation.add_answer(answer.text, failed=answer.status == "failed", tool_calls=answer.tool_calls)
        recorded = session.record("ended", turn=answer.turn, summary=answer.summary())
        if session.state == SessionState.CLOSED:
            return
        if (
            session.ephemeral or session.close_after_answer
        ):  # its one turn is over: its KV goes now, and is not prefilled again
            await self.table.close(session, "its answer ended")
            return
        # The session is open again before any await: a caller cancelled from here on (a cancel whose client
        # left) must not leave it answering.
        session.state = SessionState.OPEN
        session.touch()
        try:
            await self.table.prefill_stable(session)
        except Exception:
            logger.exception("session %s: re-prefill after the answer failed", session.id)
        await recorded

    # --- the router's side -------------------------------------------------------------------------
    async def claim(
        self,
        *,
        session_id: str,
        turn: int | None = None,
        fresh: bool = False,
        adopts: bool = True,
        reclaim: bool = False,
        holding: str | None = None,
    ) -> dict[str, Any]:
        """Take the answer to stream it: `{"request": <decode request>, ...}` for its one reader, or
        `{"answer": summary}` when it is over, failed, or already being read by another. `fresh`: hand the KV
        off anew (a reader whose decode stream ended before its first frame may have spent the last one).
        `holding` (a streaming reader, waiting for the turn to end): the preemptive answer whose frames it holds
        ("" for none); while there is no answer the reply says which one there is now (`provisional`), and
        comes as soon as that changes."""
        session = self.table.get(session_id, allow_closed=True)

        def provisional_changed() -> bool:
            live = self.preemptive.provisional(session)
            return holding is not None and (live["stream_id"] if live else "") != holding

        answer = await self._wait_answer(session, turn, provisional_changed)
        if answer is None:  # no answer yet: the router asks again (its client's wait is its own)
            if holding is None:
                return {"pending": True}
            return {"pending": True, "provisional": self.preemptive.provisional(session)}
        if reclaim and answer.status == "streaming" and answer.adopt is not None:
            # Its reader could not adopt the preemptive answer's stream (gone): it takes an ordinary hand-off.
            answer.status, answer.claimed_at, fresh = "ready", None, True
        wait_s = 2 * self.settings.admission_timeout_s + 5  # the hand-off's own waits are bounded by the first
        await _wait_for(session, lambda: answer.status != "preparing", wait_s)
        if answer.status == "ready" and answer.handed_off_at is not None:
            lease = self.config.kv_transfer.lease_s
            # (an answer decode computes itself holds no KV here to go stale; asked `fresh`, it gets a new request id)
            stale = not answer.local and time.monotonic() - answer.handed_off_at > max(lease / 2, lease - 10)
            if fresh or stale or (answer.adopt is not None and not adopts):
                if answer.adopt is not None:  # a preemptive answer nobody adopts: its decode stream goes
                    self.preemptive.release(answer.adopt)
                # NIXL may have freed it: hand the KV off again (as the answer's task, so that a cancel or a
                # close reaches it; shielded, so that this claim's caller leaving does not stop it).
                answer.status = "preparing"
                answer.task = asyncio.create_task(self.hand_off(session, answer))
                await asyncio.shield(answer.task)
        reply: dict[str, Any] = {"turn": answer.turn, "endpoint": session.endpoint}
        reply["include_usage"] = answer.include_usage
        reply["timing"] = answer.timing  # (the reader's Server-Timing: where the time after end of input went)
        if answer.adopt is not None and answer.status == "ready":
            reply["adopt"] = answer.adopt  # a preemptive answer: the router takes its decode stream over
        if answer.status != "ready":
            return {**reply, "answer": answer.summary()}
        answer.status, answer.claimed_at = "streaming", time.monotonic()
        answer.alive_at = answer.claimed_at
        # Journaled, not awaited: between the claim and its reply nothing may be cancelled (a reader whose client
        # left is cancelled with its request, recursively, and the answer would be claimed by nobody).
        session.record("claimed", turn=answer.turn)
        # Wall clock, for the router's last-chunk-to-first-token histogram.
        if session.last_chunk_at is not None:
            reply["last_chunk_time"] = time.time() - (time.monotonic() - session.last_chunk_at)
        return {**reply, "request": answer.request}

    async def answer_done(self, *, session_id: str, turn: int, outcome: dict[str, Any]) -> dict[str, Any]:
        """The claiming router's report of how the answer ended (idempotent; also cancels an unclaimed one).
        `released`: its reader left before any output, and the answer waits for the next one."""
        session = self.table.get(session_id, allow_closed=True)
        if not 0 <= turn < len(session.answers):
            raise SessionError(404, f"session {session_id} has no answer {turn}", "turn")
        answer = session.answers[turn]
        status = outcome.get("status")
        if status not in (*DONE, "released"):
            raise SessionError(400, f"an answer ends completed, cancelled or failed, not {status!r}", "status")
        if answer.done:
            return answer.summary()
        if answer.cancel_requested and status in ("failed", "released"):  # stopped on decode by a cancel
            status = "cancelled"
        if status == "released" and session.ephemeral:  # its one reader left: nobody else will read it
            status = "cancelled"
        if status == "released":  # its reader left before any output: the next reader streams it
            if answer.status == "streaming":
                answer.status, answer.claimed_at, answer.decode = "ready", None, None
                await session.record("released", turn=answer.turn)
                await _notify(session)
            return answer.summary()
        if answer.task is not None and not answer.task.done():  # cancelled before its hand-off was claimed
            answer.task.cancel()
            await asyncio.gather(answer.task, return_exceptions=True)
            if answer.done:
                return answer.summary()
        answer.text = outcome.get("text") or ""
        answer.finish_reason, answer.usage = outcome.get("finish_reason"), outcome.get("usage")
        answer.response = outcome.get("response") or {}
        answer.tool_calls = _whole_calls(outcome.get("tool_calls"))
        answer.finish(status, None if status == "cancelled" else outcome.get("error"))
        await self._answer_ended(session, answer)
        await _notify(session)
        return answer.summary()

    async def streaming_from(self, *, session_id: str, turn: int, decode: dict[str, Any]) -> dict[str, Any]:
        """The reader of answer `turn` says where it streams it from, so that a cancel through any router can
        stop it there. `{"stop": decode}` when a cancel came first."""
        session = self.table.get(session_id, allow_closed=True)
        answer = session.answers[turn] if 0 <= turn < len(session.answers) else None
        if answer is None or answer.status != "streaming":
            return {}
        answer.decode, answer.alive_at = decode, time.monotonic()
        return {"stop": decode} if answer.cancel_requested else {}

    async def reader_alive(self, *, session_id: str, turn: int) -> dict[str, Any]:
        """The reader of answer `turn` is still streaming it (sent every READER_ALIVE_S while it streams)."""
        session = self.table.get(session_id, allow_closed=True)
        if 0 <= turn < len(session.answers) and session.answers[turn].status == "streaming":
            session.answers[turn].alive_at = time.monotonic()
        return {}

    async def cancel(self, *, session_id: str) -> dict[str, Any]:
        """Stop the answer in progress: one not yet streamed ends cancelled now; for one being streamed,
        `stop` says where (the router that got the cancel stops it on its decode replica; its reader then
        reports it cancelled, with the text it had)."""
        session = self.table.get(session_id, allow_closed=True)
        answer = session.answers[-1] if session.answers else None
        if answer is None or answer.done:
            raise SessionError(409, f"session {session_id} has no answer in progress")
        if answer.task is not None and not answer.task.done():  # the hand-off is being made
            answer.task.cancel()
            await asyncio.gather(answer.task, return_exceptions=True)
        if answer.status in ("ready", "preparing"):  # not claimed (or cancelled before its task ever ran)
            if answer.adopt is not None and answer.status == "ready":
                self.preemptive.release(answer.adopt)  # a preemptive answer's decode stream, parked: it goes
            answer.finish("cancelled")  # NIXL frees a hand-off nobody reads after the lease
            await self._answer_ended(session, answer)
            await _notify(session)
        if answer.done:
            return {**session.describe(), "answer": answer.summary()}
        answer.cancel_requested = True
        return {**session.describe(), "answer": answer.summary(), "stop": answer.decode}

    async def result(self, *, session_id: str, turn: int | None = None, wait: bool = True) -> dict[str, Any]:
        """The session and its answer (`wait`: once the answer is over)."""
        session = self.table.get(session_id, allow_closed=True)
        answer = await self._wait_answer(session, turn) if wait else (session.answers or [None])[-1]
        if answer is None and wait:
            return {"pending": True}
        if answer is not None and wait and not answer.done:
            await self._waiting(session, lambda: answer.done)
            if not answer.done:
                return {"pending": True}
        return {**session.describe(), "answer": answer.summary() if answer else None}

    async def _wait_answer(
        self, session: Session, turn: int | None, changed: Callable[[], bool] = lambda: False
    ) -> Answer | None:
        """The answer `turn` (default: the next or current one), once it exists; None if it does not yet
        after a short wait (the router asks again: a replica's request slots are not held for long), or as soon
        as `changed()`."""
        if turn is not None and (not isinstance(turn, int) or turn < 0):
            raise SessionError(400, "turn: must be an answer's number, from 0", "turn")
        if turn is not None and turn > len(session.answers):  # only the next answer may be waited for
            raise SessionError(404, f"session {session.id} has no answer {turn}", "turn")

        def exists() -> bool:
            if turn is not None:
                return turn < len(session.answers)
            return bool(session.answers) and (session.input_ended or session.answering)

        await self._waiting(session, lambda: exists() or session.state == SessionState.CLOSED or changed())
        if not exists():
            if session.state == SessionState.CLOSED:
                raise SessionError(409, f"session {session.id} has no answer ({session.close_reason})")
            return None
        return session.answers[-1 if turn is None else turn]

    async def _waiting(self, session: Session, predicate: Callable[[], bool]) -> None:
        """Wait at most WAIT_POLL_S for `predicate`; at most MAX_WAITERS readers wait on one session (429)."""
        if predicate():
            return
        if session.waiters >= MAX_WAITERS:
            raise SessionError(429, f"{MAX_WAITERS} readers already wait on session {session.id}")
        session.waiters += 1
        try:
            with contextlib.suppress(TimeoutError):
                await _wait_for(session, predicate, WAIT_POLL_S)
        finally:
            session.waiters -= 1

    def expire_answer(self, session: Session, now: float) -> str | None:
        """Why the answer in progress is given up on (its reader vanished), or None."""
        answer = session.answers[-1] if session.answers else None
        if answer is None or answer.done:
            return None
        if answer.status == "ready" and now - (answer.handed_off_at or now) > session.limits.idle_timeout_s:
            return "no reader claimed the answer"
        if answer.status == "streaming" and now - (answer.claimed_at or now) > session.limits.answer_timeout_s:
            return "the answer's reader never reported its end"
        if answer.status == "streaming" and now - (answer.alive_at or now) > READER_LEASE_S:
            # Its router stopped moving it (e.g. its client vanished without the router noticing): the
            # session must not stay answering, holding its KV, until the answer timeout.
            return "the answer's reader stopped streaming it"
        return None

    async def give_up_answer(self, session: Session, why: str) -> None:
        answer = session.answers[-1]
        answer.finish("failed", {"message": why, "type": "TimeoutError", "code": 408})
        await self._answer_ended(session, answer)
        await _notify(session)


def _whole_calls(calls: Any) -> list[dict[str, Any]] | None:
    """The calls a router reported, those with an id and a name (a call cut off before its name is no call)."""
    if not isinstance(calls, list):
        return None
    whole = [c for c in calls if isinstance(c, dict) and c.get("id") and (c.get("function") or {}).get("name")]
    return whole or None


async def _notify(session: Session) -> None:
    async with session.changed:
        session.changed.notify_all()


async def _wait_for(session: Session, predicate: Callable[[], bool], timeout: float) -> None:
    """Wait, bounded, until `predicate()` holds; `TimeoutError` past `timeout`."""
    async with session.changed:
        await asyncio.wait_for(session.changed.wait_for(predicate), timeout)
