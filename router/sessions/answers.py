"""A session's answer, from the router: claim it, stream it from decode straight to the client, report its end.

The session's owner prefill replica hands the KV off at end of input and gives the decode request to the one
router that claims the answer (prefill/handoff.py). That router calls decode itself, so the answer's tokens
take the same path as a chat completion's (decode → router → client), each SSE frame parsed once here (for
the conversation's text and usage, and for Realtime events), then reports the outcome to the owner. A second
reader of an answer already claimed waits for its end and gets it whole, in the same OpenAI frames
(router/sessions/outcome.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from core import metrics
from core.protocol import SSE_DONE, error_body, error_status, sse
from core.tasks import detached
from router.openai import tool_calls
from router.sessions import owner
from router.sessions.outcome import Outcome, completion_object, replay_frames
from router.sessions.provisional import Held, Provisional, Watch
from router.streams.feeds import DecodeFailed, DecodeStream

logger = logging.getLogger(__name__)
_END = object()
READER_ALIVE_S = 5.0  # how often a reader streaming a long answer tells its owner it still does (READER_LEASE_S)
REPORT_WAIT_S = 2.0  # how long the end of a stream waits for the owner to have the outcome
REPORT_ATTEMPTS, REPORT_RETRY_S = 8, 2.0


class AnswerReader:
    """One reader of one session answer. `open()`, then `frames()` (SSE) or `whole()` (one object)."""

    def __init__(
        self,
        ingress: Any,
        session_id: str,
        turn: int | None = None,
        surface: str = "session",
        provisional: asyncio.Queue[Provisional] | None = None,
        watch: Watch | None = None,
    ) -> None:
        self.ingress, self.session_id, self.turn = ingress, session_id, turn
        # A preemptive answer's text before the turn ends (router/sessions/provisional.py): to the client, and to
        # `watch` (Realtime's early speech: its first sentence synthesized while it is held).
        self.provisional, self.watch = provisional, watch
        self.surface = surface  # where its tool calls are counted (router/openai/tool_calls.py)
        self.claim: dict[str, Any] = {}
        self.outcome = Outcome()
        self.summary: dict[str, Any] | None = None  # a replay: the answer as the owner knows it
        self._stream: DecodeStream | None = None
        self._first: Any = None
        self._reported: asyncio.Task[Any] | None = None
        self._confirmed: asyncio.Task[bool] | None = None  # a released answer's claim (router/sessions/provisional.py)
        self._withdrawn: dict[str, Any] | None = None  # why a released answer is not the owner's (then an error)
        self._streamed = False  # whether any of the answer reached the client
        self._created_at = time.monotonic()  # (Realtime: at response.create, its end of input)
        self._registered: str | None = None  # the decode replica the owner was told this answer streams from
        self.held: Held | None = None  # its hold on the preemptive answer while the turn goes on (Realtime releases it)
        self.server_timing: dict[str, float] = {}  # ms, once open (a live answer's, not a replay's)

    def requested(self) -> None:
        """The answer is asked for now (a reader opened before, Realtime's `EarlyRead`): its wait starts here."""
        self._created_at = time.monotonic()

    @property
    def endpoint(self) -> str:
        return self.claim.get("endpoint", "chat")

    async def open(self, stream: bool = True, retried: bool = False, reclaim: bool = False) -> dict[str, Any] | None:
        """Claim the answer and start decode (or wait for another reader's to end). An error payload if the
        answer cannot be read (no such session or answer, or an answer that failed before any output)."""
        limits = getattr(getattr(self.ingress, "config", None), "limits", None)
        wait_s = limits.idle_timeout_s if limits else 300.0  # (for the input to end; for a release's confirmation)
        deadline = time.monotonic() + wait_s
        feeds = getattr(self.ingress, "feeds", None)
        held = (
            Held(feeds, self.session_id, self.provisional, self.watch)
            if stream and not retried and feeds is not None
            else None
        )
        self.held = held or self.held
        early: asyncio.Future[Any] | None = None  # the claim still on its way when the answer was released here
        try:
            while True:  # the owner holds each call a few seconds at most: the long wait is this router's
                call = self._claim_call(stream, retried, reclaim, held.stream_id if held is not None else None)
                try:
                    await asyncio.wait({call, *([held.released] if held else [])}, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:  # the client left: an answer claimed meanwhile goes back to its owner
                    call.add_done_callback(self._claimed_after_leaving)
                    raise
                if held is not None and held.released.done() and not call.done():
                    # Its end chunk came here first: the held answer is the answer; the owner's reply follows.
                    claim, early = held.early_claim(), call
                    break
                claim = call.result()
                if not claim.get("pending"):
                    break
                if held is not None:
                    await held.follow(claim.get("provisional"))
                if time.monotonic() > deadline:
                    return error_body(408, f"session {self.session_id} has no answer yet (its input has not ended)")
            adopted = (claim.get("adopt") or {}).get("stream_id") if "request" in claim else None
            kept = held.take(adopted) if held is not None else None
            if early is not None and held is not None and kept is not None:
                self._confirmed = detached(self._confirm_early(early, held, kept, time.monotonic() + wait_s))
        finally:
            if held is not None:
                held.drop()
        if "error" in claim:
            return claim
        self.claim, self.turn = claim, claim["turn"]
        if "request" not in claim:  # over, failed, or being read by another: it is replayed whole
            summary = claim["answer"]
            if summary["status"] not in ("completed", "cancelled", "failed"):
                deadline = time.monotonic() + (limits.answer_timeout_s if limits else 600.0)
                while (result := await owner.session_result(self.ingress, self.session_id, turn=self.turn)).get(
                    "pending"
                ):
                    if time.monotonic() > deadline:
                        return error_body(408, f"answer {self.turn} did not end in time")
                if "error" in result:
                    return result
                summary = result["answer"]
            config = getattr(self.ingress, "config", None)
            meta = {k: v for k, v in (summary.get("response") or {}).items() if v}
            summary["response"] = {"model": getattr(config, "model_name", ""), **meta}
            self.summary = summary
            if summary["status"] == "failed" and not summary.get("text"):
                return {"error": summary.get("error") or error_body(500, "the answer failed")["error"]}
            return None
        request = dict(claim["request"])
        claimed_at = time.perf_counter()
        if not stream:
            request["stream"] = False
            request.pop("stream_options", None)
        first: Any
        try:
            if kept is not None:  # a preemptive answer this reader held: what decode made of it is here already
                kept.body = {**request, "return_token_ids": True}
                if kept.ids is not None:
                    kept.ids = "keep" if request.get("return_token_ids") else "strip"
                opened = kept
                self.ingress.feeds.confirm(kept)
                how = "released" if early is not None else "held"
                metrics.inc(metrics.PREEMPTIVE_READ, 1, "preemptive answers read, by how", how=how)
            elif "adopt" in claim:  # a preemptive answer: what decode made of it comes at once
                opened = await self.ingress.feeds.adopt(claim["adopt"], self.endpoint, request)
                metrics.inc(metrics.PREEMPTIVE_READ, 1, "preemptive answers read, by how", how="adopted")
                if isinstance(opened, dict):  # gone (reaped, its replica died): this reader takes an ordinary hand-off
                    if reclaim:
                        return opened
                    return await self.open(stream, retried=True, reclaim=True)
            else:
                opened = await self.ingress.feeds.open(self.endpoint, request)
            if isinstance(opened, dict):  # not a stream: the whole response, or an error
                first = opened if "error" in opened else opened["response"]
            else:
                self._stream = opened
                self._registered = getattr(opened, "replica", None)
                detached(self._register(opened))
                first = await anext(opened)
        except StopAsyncIteration:  # decode ended the stream before any frame (a guard: see core/tasks.py)
            if not retried and await self._claimed():
                # Give the answer back to its owner and claim it anew: the owner hands the KV off again if
                # need be (the prefix cache has it), so the client gets its answer rather than an error.
                await asyncio.shield(self.report("released"))
                self._reported, self._stream = None, None
                return await self.open(stream, retried=True)
            first = error_body(502, "decode ended the answer's stream before its first token")
        except DecodeFailed as e:
            if kept is not None and not reclaim and e.error.get("code") == 499 and await self._claimed():
                # The held preemptive answer was stopped before its first frame (its router's client left, say):
                # this reader takes an ordinary hand-off, as when it is gone at adoption.
                self._stream = None
                return await self.open(stream, retried=True, reclaim=True)
            first = {"error": e.error}
        except asyncio.CancelledError:
            if self._stream is not None:
                self._stream.cancel()
            self.report("cancelled")
            raise
        except Exception as e:
            logger.exception("session %s: decode failed", self.session_id)
            first = error_body(500, f"decode failed: {e}")
        if isinstance(first, dict) and "error" in first:
            self.outcome.error = first["error"]
            await self.settle("failed")
            return first
        self._first = first
        # Where the time went (W3C Server-Timing): the owner's settling of the last chunk and hand-off after end of
        # input (about 0 for a preemptive answer, whose `preempted` says how long before the end it started), and
        # decode's first item after the claim (about 0 for a preemptive answer this reader held).
        timing = {k.removesuffix("_ms"): v for k, v in (claim.get("timing") or {}).items()}
        self.server_timing = {**timing, "decode": (time.perf_counter() - claimed_at) * 1e3}
        if kept is not None:
            self.server_timing["held"] = 0.0
        if early is not None:
            self.server_timing["released"] = 0.0  # at its end chunk, by this router: no call to the owner before it
        return None

    def _withdrawal(self) -> str:
        """The end of a released answer the owner did not confirm: its error frame, then `[DONE]`."""
        self.outcome.status, self.outcome.error = "failed", self._withdrawn
        return sse({"error": self._withdrawn}) + SSE_DONE

    async def _claimed(self) -> bool:
        """Whether the answer is this reader's (a released one: once the owner's reply says so)."""
        return self._confirmed is None or await asyncio.shield(self._confirmed)

    def _claim_call(self, stream: bool, retried: bool, reclaim: bool, holding: str | None) -> asyncio.Future[Any]:
        return asyncio.ensure_future(
            owner.session_claim(
                self.ingress,
                self.session_id,
                turn=self.turn,
                adopts=stream,  # (a reader of a whole answer takes an ordinary hand-off, not a preemptive one)
                fresh=retried,
                reclaim=reclaim,
                holding=holding,
            )
        )

    async def _confirm_early(
        self, call: asyncio.Future[Any], held: Held, stream: DecodeStream, deadline: float
    ) -> bool:
        """A released answer (router/sessions/provisional.py) streams while its claim goes on: the owner's reply
        must name its stream. Anything else (the owner refused the end chunk, or ended the turn otherwise) stops it."""
        stream_id = held.live["stream_id"]
        error: dict[str, Any] | None = None
        while error is None:
            await asyncio.wait({call, held.revoked}, return_when=asyncio.FIRST_COMPLETED)
            if held.revoked.done():
                call.add_done_callback(self._give_back)  # (claimed meanwhile: given back)
                error = held.revoked.result()
                break
            try:
                claim = call.result()
            except Exception as e:
                error = error_body(500, f"the answer's claim failed: {e}")["error"]
                break
            if not claim.get("pending"):
                if claim.get("error") or (claim.get("adopt") or {}).get("stream_id") != stream_id:
                    if "request" in claim:  # another answer than the one streamed: it goes back to its owner
                        self._give_back(call)
                    error = claim.get("error") or error_body(409, "the turn ended with other input")["error"]
                    break
                self.claim = {**claim, "last_chunk_time": self.claim.get("last_chunk_time")}
                self.turn = claim["turn"]
                return True
            if (claim.get("provisional") or {}).get("stream_id") != stream_id or time.monotonic() > deadline:
                error = error_body(409, "the preemptive answer was given up before the turn ended")["error"]
                break
            call = self._claim_call(True, False, False, stream_id)
        logger.warning("session %s: an answer released at its end chunk was revoked: %s", self.session_id, error)
        self._withdrawn = {**error, "message": f"the answer was withdrawn: {error.get('message')}"}
        stream.abort(self._withdrawn)
        return False

    async def items(self) -> AsyncGenerator[tuple[str, list[str]], None]:
        """(SSE text to forward, text deltas) per decode item; the outcome is reported when it ends."""
        if self.summary is not None:
            text = self.summary.get("text") or ""
            yield replay_frames(self.endpoint, self.summary, self.claim.get("include_usage", False)), [text]
            return
        assert self._stream is not None and isinstance(self._first, str)
        status = "cancelled"  # the client left, unless the stream ends
        keep_usage = bool(self.claim.get("include_usage"))
        alive_at = time.monotonic()
        try:
            item: Any = self._first
            while item is not _END:
                forward, deltas = self._absorb(item, keep_usage)
                end = ""
                if SSE_DONE in forward:
                    # Only the stream's end waits for the owner, never its text: a preemptive answer made whole
                    # before the turn ended (its max_tokens, or a stop) comes in one item, [DONE] included.
                    at = forward.index(SSE_DONE)
                    forward, end = forward[:at], forward[at:]
                self._streamed = self._streamed or bool(deltas) or bool(self.outcome.tool_calls)
                if (replica := getattr(self._stream, "replica", None)) != self._registered:
                    self._registered = replica  # resumed on another decode replica (router/streams/resume.py)
                    detached(self._register(self._stream))
                if forward or deltas:
                    yield forward, deltas
                if end:
                    if not await self._claimed():  # a released answer the owner did not confirm: not the answer
                        end = end.replace(SSE_DONE, "") + self._withdrawal()
                    # The outcome is whole: the owner hears it before the client does, so that the client's
                    # next input never finds the answer still in progress.
                    await self.settle(self.outcome.status)
                    yield end, []
                if (now := time.monotonic()) - alive_at > READER_ALIVE_S:  # a long answer: still being read
                    alive_at = now
                    detached(self._alive())
                item = await anext(self._stream, _END)
            status = self.outcome.status
        except DecodeFailed as e:
            if e.error.get("code") == 499:  # stopped on decode: a cancel (POST .../cancel) reached it
                status = "cancelled"
                if not await self._claimed():  # (stopped because it was not the answer)
                    yield self._withdrawal(), []
                    return
                await self.settle(status)
                yield SSE_DONE, []
                return
            # the decode replica failed mid-stream
            logger.error("session %s: decode stream failed: %s", self.session_id, e)
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="mid_stream")
            self.outcome.error = e.error
            status = "failed"
            await self.settle(status)
            yield sse({"error": self.outcome.error}) + SSE_DONE, []
        finally:
            self._stream.cancel()
            # A client that left before any text: the answer goes back to its owner for the next reader.
            self.report("released" if status == "cancelled" and not self._streamed else status)

    async def _alive(self) -> None:
        with contextlib.suppress(Exception):
            await owner.session_alive(self.ingress, self.session_id, turn=self.turn)

    async def _register(self, stream: DecodeStream) -> None:
        """Tell the owner where this answer streams from (a cancel through any router then stops it there)."""
        decode = {"consumer": stream.feeds.consumer, "stream_id": stream.stream_id, "replica": stream.replica}
        if not await self._claimed():
            return
        try:
            reply = await owner.session_streaming(self.ingress, self.session_id, turn=self.turn, decode=decode)
        except Exception:  # the answer still streams; only a cancel from another router could not reach it
            logger.warning("session %s: could not register answer %s's stream", self.session_id, self.turn)
            return
        if isinstance(reply, dict) and reply.get("stop"):  # a cancel came before this
            self.cancel()

    def _absorb(self, item: str, keep_usage: bool) -> tuple[str, list[str]]:
        first = not self.outcome.text and not self.outcome.tool_calls
        forward, deltas = self.outcome.absorb(item, keep_usage)
        if first and (deltas or self.outcome.tool_calls):
            self._observe_first_token()
        return forward, deltas

    def _observe_first_token(self) -> None:
        if (at := self.claim.get("last_chunk_time")) is not None:
            waited = max(0.0, time.time() - at)
            metrics.observe(metrics.LAST_CHUNK_TO_FIRST_TOKEN, waited, "last input chunk to first token")
        else:  # input that came as items (Realtime) ends with the request for this answer
            waited = time.monotonic() - self._created_at
        if (admission := getattr(self.ingress, "admission", None)) is not None:
            admission.observe_first_token(waited)  # the latency admission adapts its limit to

    async def whole(self) -> dict[str, Any]:
        """The answer as one non-streaming response object (`open(stream=False)` first)."""
        if self.summary is not None:
            return completion_object(self.endpoint, self.summary)
        assert isinstance(self._first, dict)
        self.outcome.absorb_response(self._first)
        self._observe_first_token()  # (the whole answer is its first token, for this reader)
        await self.settle("completed")
        return self._first

    def report(self, status: str) -> asyncio.Task[Any]:
        """Tell the owner how the answer ended, once; in a task of its own (core/tasks.py), so that a client
        that left (a cancelled request) cannot stop it. Returns the report's task (await it to know the owner
        has it)."""
        if self._reported is not None or self.summary is not None or self.turn is None:
            return self._reported or _done_task()
        if status == "released" and not self.claim:  # nothing claimed, nothing to give back (an early reader)
            return _done_task()  # (a cancel is reported claimed or not: it cancels an answer not yet claimed)
        self.outcome.status = status
        if status == "completed":
            tool_calls.count(self.surface, len(self.outcome.tool_calls))
        if status != "released" and (charge := getattr(self.ingress, "charge", None)) is not None:
            charge(self.outcome.usage)  # the caller's key pays for the answer (router/keys/quota.py)
        self._reported = detached(self._deliver_claimed(self.outcome.as_dict()))
        return self._reported

    async def _deliver_claimed(self, outcome: dict[str, Any]) -> dict[str, Any] | None:
        if not await self._claimed():  # a released answer the owner did not confirm: nothing of it is the owner's
            return None
        assert self.turn is not None
        return await self._deliver(self.turn, outcome)

    async def _deliver(self, turn: int, outcome: dict[str, Any]) -> dict[str, Any] | None:
        """Retried a while: when the owner drains, its adopter becomes known to routers within seconds."""
        for attempt in range(REPORT_ATTEMPTS):
            try:
                result = await owner.session_answer_done(self.ingress, self.session_id, turn=turn, outcome=outcome)
                if not isinstance(result.get("error"), dict) or error_status(result) not in (404, 503):
                    return result
            except Exception:
                logger.exception("session %s: reporting answer %d failed", self.session_id, turn)
            if attempt + 1 < REPORT_ATTEMPTS:
                await asyncio.sleep(REPORT_RETRY_S)
        logger.warning("session %s: the end of answer %d could not be reported", self.session_id, turn)
        return None

    async def settle(self, status: str) -> None:
        """Report, and wait a little for the owner to have it (the client's next input then finds the answer
        over); never long, and never failing the client's stream."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.report(status)), REPORT_WAIT_S)

    def release(self) -> None:
        """The client left (or the response ended). Before any output the answer goes back to its owner
        (`released`: the next reader streams it); after some, it is cancelled with the text it had."""
        if self._stream is not None:
            self._stream.cancel()
        self.report("cancelled" if self.outcome.text or self.outcome.tool_calls or self._streamed else "released")

    def cancel(self) -> None:
        """Realtime `response.cancel`: the answer ends cancelled with whatever text it had."""
        if self._stream is not None:
            self._stream.cancel()
        self.report("cancelled")

    def _give_back(self, call: asyncio.Future[Any]) -> None:
        """A claim that came back after its reader stopped needing it: the answer it claimed goes back."""
        if not call.cancelled() and call.exception() is None and "request" in (claim := call.result()):
            detached(self._deliver(claim["turn"], Outcome(status="released").as_dict()))

    def _claimed_after_leaving(self, call: asyncio.Future[Any]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        claim = call.result()
        if isinstance(claim, dict) and "request" in claim:
            self.claim, self.turn = claim, claim["turn"]
            self.report("released")


def _done_task() -> asyncio.Task[Any]:
    async def nothing() -> None:
        return None

    return asyncio.ensure_future(nothing())
