"""Preemptive answers: the answer starts while the user may still be talking, and is delivered at once when the
turn ends unchanged.

An end-of-turn detector says "done" late (300-800 ms of silence, or a model's verdict), and only then is the
answer asked for. A session created with `preemptive` options does not wait for it: once its input has been idle
for `after_idle_ms`, its owner hands the current input off as it would at end of input, ranked below all other
work of the prefill engine (prefill/scheduler/policy.py), and starts decode on it, parked: decode generates at
its lowest priority and keeps the frames for whoever adopts them (decode/server.py `adopt`). New input cancels it
on both engines. When the turn ends and the input is what the preemptive answer was made from, that answer
becomes the answer: the router that claims it adopts the parked stream, so what it made is delivered at once and
the rest streams on. Otherwise the ordinary hand-off runs.

No token passes through this replica: decode keeps them until a router adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from core import metrics
from core.config import AppConfig
from core.protocol import continuation_refusal
from core.scheduler_config import SchedulerSettings
from core.tasks import detached
from decode.client import DecodeClient
from prefill.answer import Prefill
from prefill.preempt_state import Preemption, PreemptState, fingerprint, input_tag
from prefill.session import Session

if TYPE_CHECKING:
    from engine.llm import Engine

logger = logging.getLogger(__name__)
PREEMPTIVE_PRIORITY = 1  # on decode (priority scheduling): behind every ordinary answer (0)
# Refusals that pass with the load (the engine's queue, the replica's cap, both read from stats up to 1 s old):
# the answer is looked at again, from after_idle_ms up to RETRY_MAX_S apart, while the input stays idle.
BUSY, AT_CAP = "the engine is busy", "the replica's preemptive work is at its cap"
PASSING = (BUSY, AT_CAP)
RETRY_MAX_S = 2.0
# The session's request computes the input before the hand-off is made (at most this long): the hand-off reuses it.
CATCH_UP_S = 1.0
# A hand-off given up while it was made runs on this long at most, then is aborted as before: queued below all other
# work, it would otherwise keep its place in the engine's queue (and in `queue_waiting`) up to the admission timeout.
GIVEN_UP_WAIT_S = 2.0


async def _notify(session: Session) -> None:
    async with session.changed:
        session.changed.notify_all()


class Preemptive:
    """A replica's preemptive answers: started while a session's input idles or pauses, given up on new input,
    and handed to the session's answer when the turn ends unchanged (`take`)."""

    def __init__(
        self,
        sessions: Mapping[str, Session],
        engine: Engine,
        config: AppConfig,
        scheduler_stats: Callable[[], Mapping[str, Any]],
        prefill: Prefill,
        decode: DecodeClient | None,
    ) -> None:
        self.sessions = sessions  # the replica's (read only: the preemptive work in flight is capped across them)
        self.engine = engine
        self.config = config
        self.scheduler_stats = scheduler_stats  # the engine scheduler's last figures (their queue defers answers)
        self.prefill = prefill  # the replica's prefill, which makes the hand-off
        self.decode = decode  # (None: no decode pool given, as in some unit tests)

    @property
    def settings(self) -> SchedulerSettings:
        return self.config.prefill.scheduler

    # --- input changes -----------------------------------------------------------------------------
    def rearm(self, session: Session) -> None:
        """The session's input changed: a preemptive answer made from the old input is given up, and the idle
        timer starts again."""
        state: PreemptState | None = getattr(session, "preempt", None)
        if state is None:
            return
        now = fingerprint(session.full_request())
        if now == state.fingerprint and (state.live is not None or state.timer is not None):
            return  # nothing changed (a realtime commit turns the typed text into a message: the same request)
        state.fingerprint = now
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if state.live is not None:
            self._discard(session, "new input")
        if session.input_ended or session.answering or state.options.after_idle_ms is None:
            return
        loop = asyncio.get_running_loop()
        state.timer = loop.call_later(state.options.after_idle_ms / 1000, self._due, session)

    def start_now(self, session: Session) -> bool:
        """The input may be whole now (a pause in a spoken turn: router/realtime/audio.py): its preemptive
        answer starts without waiting for the input to idle. Asked for at pauses only, so not held to
        `max_attempts` (the turn's last pause is the one that counts). Whether one is live or starting."""
        state: PreemptState | None = getattr(session, "preempt", None)
        if state is None:
            return False
        self.rearm(session)  # (the input it was made from, if it changed: given up)
        if state.live is not None:
            return True  # made from this input
        if state.timer is not None:
            state.timer.cancel()
        self._due(session, asked=True)
        return state.live is not None

    def _due(self, session: Session, waited_s: float = 0.0, asked: bool = False) -> None:
        state: PreemptState = session.preempt
        state.timer = None
        if (why := self._refusal(session, asked)) is not None:
            if why in PASSING:  # load passes, the pause may not: look again later (never queued in the engine)
                idle_s = (state.options.after_idle_ms or 0) / 1000
                delay = min(RETRY_MAX_S, max(waited_s * 2, idle_s, 0.05))
                state.timer = asyncio.get_running_loop().call_later(delay, self._due, session, delay, asked)
                logger.debug("session %s: preemptive answer deferred %.2f s (%s)", session.id, delay, why)
                return
            logger.debug("session %s: no preemptive answer (%s)", session.id, why)
            metrics.inc(metrics.PREEMPTIVE, 1, "preemptive answers, by outcome", outcome="skipped")
            return
        state.attempts += 1
        turn = len(session.answers)
        live = Preemption(
            turn=turn,
            attempt=state.attempts,
            fingerprint=fingerprint(session.full_request()),
            parked=f"preempt:{session.id}:{turn}:{state.attempts}",
            stream_id=f"{session.id}-t{turn}-p{state.attempts}",
            state=state,
        )
        state.live = live
        live.task = asyncio.create_task(self._start(session, live))
        metrics.inc(metrics.PREEMPTIVE, 1, "preemptive answers, by outcome", outcome="started")

    def _refusal(self, session: Session, asked: bool = False) -> str | None:
        """Why no preemptive answer starts now (None: it may). `asked`: at a pause (`start_now`)."""
        state: PreemptState = session.preempt
        if session.input_ended or session.answering or session.state.value == "closed":
            return "the turn is over"
        if state.live is not None:
            return "one is in progress"
        if state.attempts >= state.options.max_attempts and not asked:
            return "max_attempts"
        if session.pending:
            return "chunks are missing"  # (its input is known to be incomplete)
        limit = state.options.max_input_tokens
        if limit is not None and len(session.stable_tokens(self.engine.tokenizer)) > limit:
            return "max_input_tokens"
        in_flight = sum(s.preempt.live is not None for s in self.sessions.values() if getattr(s, "preempt", None))
        if in_flight >= self.settings.max_preemptive_in_flight:
            return AT_CAP
        if self.scheduler_stats().get("queue_waiting", 0) > 0 and not asked:
            # Under load, an answer the input's idling started waits for the load to pass, never queued. A spoken
            # pause's (`asked`) is due within the VAD's window, and the figures may be a second old (at four voices
            # the other voices' input was often queued then, and 16% of pauses had no answer): it goes, at the
            # lowest priority, within max_preemptive_in_flight.
            return BUSY
        return None

    async def _start(self, session: Session, live: Preemption) -> None:
        """Hand the input off (below all other work) and start decode on it, parked."""
        state: PreemptState = session.preempt
        try:
            request = dict(session.full_request())
            request.update(stream=True, stream_options={"include_usage": True}, request_id=live.stream_id)
            if session.streaming.active:  # the input may still grow: its tokens are the session's to compute, once
                await session.streaming.catch_up(CATCH_UP_S)
            hand = asyncio.ensure_future(self.prefill(session.endpoint, request, session.streaming, preemptive=True))
            try:
                handoff = await asyncio.shield(hand)
            except asyncio.CancelledError:
                # Given up meanwhile: the hand-off goes on for a while rather than being cancelled (an engine request
                # that had finished already would keep its KV for decode, unread, the whole NIXL lease, its engine
                # stepping every ms), and decode releases what it made.
                detached(self._release_when_made(hand, live.stream_id))
                raise
            if "error" in handoff:
                raise RuntimeError(handoff["error"].get("message"))
            body = {**request, "kv_transfer_params": handoff["kv_transfer_params"], "priority": PREEMPTIVE_PRIORITY}
            ids = live.ids = "keep" if body.get("return_token_ids") else "strip"  # (as the adopting router reads it)
            body["return_token_ids"] = (
                True  # (the router resumes it past the cap from its ids: router/streams/resume.py)
            )
            live.request = body
            # Decode holds it at `max_tokens`, its KV kept, until its turn is confirmed (decode/hold.py); where its
            # sampling does not allow that, it stops there and a router goes on from its ids, and an answer a
            # continuation cannot reproduce exactly (tools, stop strings: `continuation_refusal`) is made whole
            # instead, still at the lowest priority.
            cap = None if continuation_refusal(session.endpoint, body) else state.options.max_tokens
            call = asyncio.ensure_future(
                self.decode.start(
                    consumer=live.parked,
                    stream_id=live.stream_id,
                    endpoint=session.endpoint,
                    body=body,
                    ids=ids,
                    park_tokens=cap,
                    hold_tokens=state.options.max_tokens,
                    preemptive=True,
                )
            )
            live.start_call = call  # (given up meanwhile: the stop waits for it, so that it stops what started)
            started = await asyncio.shield(call)
            if "replica" not in started:
                raise RuntimeError((started.get("error") or {}).get("message", "decode refused it"))
            live.replica = started["replica"]
            await _notify(session)  # (a reader waiting for the turn to end holds its frames from now on)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("session %s: preemptive answer %d failed: %s", session.id, live.attempt, e)
            if state.live is live:
                state.live = None
            metrics.inc(metrics.PREEMPTIVE, 1, "preemptive answers, by outcome", outcome="failed")

    async def _release_when_made(self, hand: asyncio.Future[dict[str, Any]], stream_id: str) -> None:
        """A preemptive hand-off whose answer was given up before its decode started: once made (within
        GIVEN_UP_WAIT_S, else it is cancelled: its engine request aborted), decode frees its KV on this replica
        (vLLM's `notify_kv_transfer_request_rejected`), as it does for a request it rejects."""
        try:
            handoff = await asyncio.wait_for(hand, GIVEN_UP_WAIT_S)
        except Exception:  # (not made in time, or failed: no KV is held for it)
            return
        if not (params := handoff.get("kv_transfer_params")):
            return
        try:
            await self.decode.release(request_id=f"{stream_id}-released", kv_transfer_params=params)
        except Exception as e:  # (the lease frees the KV in the end)
            logger.warning("releasing a preemptive hand-off on decode failed: %s", e)

    def _discard(self, session: Session, why: str) -> None:
        """Give the live preemptive answer up: its decode request stops; a hand-off still being made is released
        once made, or aborted (`_start`)."""
        state: PreemptState = session.preempt
        live, state.live = state.live, None
        if live is None:
            return
        state.discarded += 1
        metrics.inc(metrics.PREEMPTIVE, 1, "preemptive answers, by outcome", outcome="discarded")
        logger.debug("session %s: preemptive answer %d discarded (%s)", session.id, live.attempt, why)
        if live.task is not None and not live.task.done():
            live.task.cancel()
        asyncio.create_task(self._stop(live))
        asyncio.create_task(_notify(session))  # (a reader holding its frames lets them go)

    def provisional(self, session: Session) -> dict[str, Any] | None:
        """The live preemptive answer of the session's next turn, once decode makes it: what a reader waiting for
        the turn to end adopts tentatively (router/sessions/answers.py), so that its frames are at hand when it is
        confirmed. None: there is none."""
        state: PreemptState | None = getattr(session, "preempt", None)
        live = state.live if state is not None else None
        if live is None or live.replica is None or live.turn != len(session.answers):
            return None
        return {
            "replica": live.replica,
            "parked": live.parked,
            "stream_id": live.stream_id,
            "turn": live.turn,
            "endpoint": session.endpoint,
            "request": {**live.request, "return_token_ids": live.ids == "keep"},
            "include_usage": bool((session.request.get("stream_options") or {}).get("include_usage")),
            "stream": state.options.stream,  # (whether its text goes to the client, marked provisional)
            # An empty end chunk with this sequence id ends the turn with this input: the router that has it
            # may release the answer before this replica does (router/sessions/provisional.py). None: chunks are
            # missing.
            "end_sequence_id": None if session.pending else session.next_seq,
            # A realtime `response.create` that changes nothing releases it likewise when the input its connection
            # last heard of (each call's reply: `summary`'s `input`) is this one.
            "input": input_tag(live.fingerprint),
        }

    def release(self, adopt: dict[str, Any]) -> None:
        """A preemptive answer that became an answer but was not adopted (its reader wants it whole, or it was
        stale): its parked decode stream is stopped."""
        asyncio.create_task(self._stop_parked(adopt["parked"], adopt["stream_id"], adopt["replica"]))

    async def _stop(self, live: Preemption) -> None:
        if live.task is not None:
            await asyncio.gather(live.task, return_exceptions=True)
        if live.replica is None and live.start_call is not None:  # a decode start in flight when it was given up
            with contextlib.suppress(Exception):
                live.replica = (await live.start_call).get("replica")
        if live.replica is not None:
            await self._stop_parked(live.parked, live.stream_id, live.replica, live.state)

    async def _stop_parked(self, parked: str, stream_id: str, replica: str, state: PreemptState | None = None) -> None:
        """Stop a parked decode stream; what it had made counts as discarded (the session's, if `state`)."""
        with contextlib.suppress(Exception):
            stopped = await self.decode.stop(consumer=parked, stream_id=stream_id, replica=replica)
            tokens = int((stopped or {}).get("tokens", 0))
            if state is not None:
                state.discarded_tokens += tokens
            metrics.inc(metrics.PREEMPTIVE_DISCARDED_TOKENS, tokens, "tokens preemptive answers made and discarded")

    def close(self, session: Session) -> None:
        """The session closed: its timer and any preemptive answer go."""
        state: PreemptState = session.preempt
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if state.live is not None:
            self._discard(session, "the session closed")

    # --- the turn ends -----------------------------------------------------------------------------
    async def take(self, session: Session, final: dict[str, Any]) -> Preemption | None:
        """At end of input: the live preemptive answer if it was made from exactly the answer's request `final`
        (it becomes the answer), else None (it is given up, and the ordinary hand-off runs)."""
        state: PreemptState | None = getattr(session, "preempt", None)
        if state is None:
            return None
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        state.attempts, state.fingerprint = 0, ""  # (the next turn has its own attempts)
        live = state.live
        if live is None:
            return None
        if live.fingerprint != fingerprint(final):
            self._discard(session, "the turn ended with other input")
            return None
        if not live.request:
            # Its hand-off is still being prefilled, ranked below all other work: the ordinary hand-off, ranked as
            # complete work, goes on from what it computed (the prefix cache keeps its full blocks).
            self._discard(session, "its hand-off was not made yet")
            return None
        if live.task is not None:  # (its decode start is in flight)
            await asyncio.gather(live.task, return_exceptions=True)
        state.live = None
        if live.replica is None:  # its hand-off or decode start failed
            return None
        state.delivered += 1
        metrics.inc(metrics.PREEMPTIVE, 1, "preemptive answers, by outcome", outcome="delivered")
        return live
