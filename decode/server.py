"""Decode replica: pulls a prompt's KV from the prefill replica over NIXL and streams the answer.

A streaming answer's frames reach the router that asked for it through that router's feed (decode/feed.py):
one long-lived stream per router replica carrying every one of its requests' frames, each item everything
ready at that moment. Non-streaming requests are answered by `start` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray import serve

from core import logs, metrics
from core.autoscaling import ACTIVE_STREAMS
from core.config import AppConfig
from core.protocol import PREEMPTIVE_CAP, error_body, error_payload, error_status
from core.tasks import detached
from decode import pacing, sse
from decode.feed import Outbox, ShownIds
from decode.hold import Hold, install, starting, tokens_fed_again
from decode.wire import Address, Call, Connection, Listener, direct_allowed
from engine.llm import Activity, Endpoint, Engine

logger = logging.getLogger(__name__)
UNCLAIMED_OUTBOX_S = 30.0  # a router that started requests but never opened its feed (it died) loses them
FEED_IDLE_S = 5.0  # a feed with no stream ends after this (so that a draining replica can stop)
STATS_EXPORT_S = 5.0  # how often the engine scheduler's counters (KV load failures) go to Prometheus
# What the router asked for with a stream's token ids (router/streams/resume.py): "strip" them from the frames (the
# router added `return_token_ids`, the client did not ask) or "keep" them (the client asked); both send them
# beside the frames, in the feed's batch.
IdsMode = Literal["strip", "keep"]
PARKED_KEPT_S = 3600.0  # a preemptive answer's record, if neither stopped nor confirmed (its owner died)


@dataclass
class ParkedStream:
    """A preemptive answer's stream (prefill/preemptive.py): it stops at `cap` tokens until its turn is confirmed."""

    cap: int | None  # (None: made whole, as a continuation could not reproduce it; or held by the engine)
    request_id: str  # its engine request (raised to an ordinary answer's priority when confirmed)
    parked: str  # the consumer its owner parked it under (only the owner's stop ends its record)
    made: int = 0
    confirmed: bool = False
    started_at: float = field(default_factory=time.monotonic)


@serve.deployment(name="decode", max_ongoing_requests=1024, health_check_period_s=10)
class DecodeServer:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        logs.setup()
        self.config = AppConfig.model_validate(app_config)
        self.engine = Engine(self.config, "decode")
        await self.engine.start()
        install(self.engine)
        pacing.install(self.engine)
        if self.config.decode.text_encoder == "decode":
            sse.install(self.engine.serving_layers[0])  # (text-only chat streams: decode/sse.py)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.outboxes: dict[str, Outbox] = {}
        self._starting = 0  # `start` calls in flight (the pacing decision counts them: decode/pacing.py)
        self.routes: dict[str, Outbox] = {}  # stream id -> the outbox its frames go to (an adopted one moves)
        # Preemptive answers' streams (`start(preemptive=True)`): tokens made so far (the owner counts what it
        # discards), and whether the turn is confirmed yet (a tentatively adopted one keeps its cap and rank).
        self.parked: dict[str, ParkedStream] = {}
        # Stream id -> its answer held at its cap by the engine (decode/hold.py), for as long as its stream runs:
        # released when confirmed, closed before it is stopped.
        self.holds: dict[str, Hold] = {}
        self._reaper = asyncio.create_task(self._reap())
        self._stats: dict[str, Any] = {}
        self._exporter = asyncio.create_task(self._export_stats())
        self.listener = Listener(ray.util.get_node_ip_address())  # feeds' direct connections (decode/wire.py)
        await self.listener.start()

    async def start(
        self,
        *,
        consumer: str,
        stream_id: str,
        endpoint: Endpoint,
        body: dict[str, Any],
        ids: IdsMode | None = None,
        avoid: list[str] | None = None,
        prefer: str | None = None,
        park_tokens: int | None = None,
        hold_tokens: int | None = None,
        preemptive: bool = False,
    ) -> dict[str, Any]:
        """Start one OpenAI request (its `kv_transfer_params` point at a prefill replica's KV, or it has none
        and this engine prefills it). A stream's frames go to `consumer`'s feed: `{"replica": <this one>}`.
        Otherwise the answer itself: `{"response": ...}`, or `{"error": ...}`. `avoid` is for the request
        router (router/placement.py: the replica an answer is resumed from), `ids` for the frames' token ids.
        `preemptive`: a preemptive answer, parked under `consumer` (prefill/preemptive.py); it stops after
        `park_tokens` (if given) unless its turn is confirmed first (then its router goes on from its ids,
        router/streams/resume.py); `hold_tokens`: instead, the engine holds it there with its KV and it goes on when
        confirmed, if its sampling allows (decode/hold.py)."""
        hold = Hold(hold_tokens) if hold_tokens is not None else None
        paced = self.config.decode.pacing
        busy = paced.min_streams is not None and self._active_streams() + self._starting + 1 >= paced.min_streams
        answer = not (preemptive or park_tokens is not None or hold is not None)  # (a preemptive one counts its tokens)
        tokens = paced.tokens if busy and answer else 1
        self._starting += 1  # (a burst of starts: each counts the others, not yet streams)
        try:  # (the serving layer starts its engine request within this call)
            with starting(hold), sse.ids_mode(ids), pacing.pacing(tokens):
                result = await self.engine.openai(endpoint, body)
        finally:
            self._starting -= 1
        held = hold if hold is not None and hold.used else None
        if hasattr(result, "error") and not hasattr(result, "__aiter__"):
            payload = error_payload(result)
            if error_status(payload) >= 500:  # this engine failed, not the request: the router tries another
                payload["replica"] = self.replica
            return payload
        if not hasattr(result, "__aiter__"):
            return {"response": result.model_dump(mode="json")}
        outbox = self.routes[stream_id] = self.outboxes.setdefault(consumer, Outbox())
        parked = None
        if preemptive or park_tokens is not None or held is not None:
            cap = None if held is not None else park_tokens
            parked = ParkedStream(cap, body.get("request_id") or stream_id, consumer)
            self.parked[stream_id] = parked
            if held is not None:
                self.holds[stream_id] = held
        skip_special = body.get("skip_special_tokens", True) is not False  # (vLLM's default: skipped)
        outbox.tasks[stream_id] = asyncio.create_task(self._pump(result, stream_id, ids, parked, skip_special))
        return {"replica": self.replica}

    async def release(self, *, request_id: str, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """Free the KV a prefill replica holds for a hand-off nobody will read (a preemptive answer given up before
        its decode started, prefill/preemptive.py): this engine's connector tells that replica to release it, as
        vLLM's serving layer does for a request it rejects. Otherwise NIXL holds it for the whole lease. (Sent on this
        engine's next step; a replica that never read from that prefill replica sends it once their handshake is
        done, at the step after.)"""
        await self.engine.client.notify_kv_transfer_request_rejected(request_id, kv_transfer_params)
        return {}

    async def adopt(
        self,
        *,
        consumer: str,
        stream_id: str,
        parked: str,
        request_id: str,
        replica: str | None = None,
        tentative: bool = False,
    ) -> dict[str, Any]:
        """Take over a stream started for another consumer (a preemptive answer its owner parked under
        `parked`, prefill/preemptive.py): what it produced so far and everything after go to `consumer`'s
        feed. Unless `tentative`, the turn is confirmed (see `confirm`). A tentative adopter (a router whose
        reader waits for the turn to end) holds the frames before the owner confirms the turn: the stream
        keeps its cap and its rank until then. `{"replica": ...}`, or an error (404) when the stream is gone
        (cancelled, or reaped unadopted)."""
        source = self.outboxes.get(parked)
        target = self.outboxes.setdefault(consumer, Outbox())
        if source is None or not source.hand_over(stream_id, target):
            return error_body(404, f"no parked stream {stream_id}")
        if stream_id in self.routes:
            self.routes[stream_id] = target
        if source.idle and self.outboxes.get(parked) is source:
            del self.outboxes[parked]
        if not tentative:
            await self.confirm(stream_id=stream_id, request_id=request_id)
        return {"replica": self.replica}

    async def confirm(self, *, stream_id: str, request_id: str | None = None, replica: str | None = None) -> None:
        """The preemptive answer became the answer: no cap any more, and an ordinary answer's priority."""
        state = self.parked.get(stream_id)
        if state is not None:
            state.confirmed = True  # (its record stays until its owner's stop or the reaper: what it made counts)
        if (held := self.holds.get(stream_id)) is not None:
            held.release()  # (not once its stream is being stopped: Hold.close)
        request_id = request_id or (state.request_id if state is not None else stream_id)
        with contextlib.suppress(Exception):  # (it still streams; only its rank on a busy engine is lower)
            await self.engine.utility("rtpd_set_priority", request_id, 0)

    async def _pump(
        self,
        stream: AsyncGenerator[str, None],
        stream_id: str,
        ids: IdsMode | None = None,
        parked: ParkedStream | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        """Engine output into the stream's outbox; `parked`: a preemptive answer's (see `start`);
        `skip_special_tokens`: the request's (how its text shows them: `ShownIds`)."""
        error: dict[str, Any] | None = None
        shown = None
        if ids is not None:
            shown = ShownIds(ids == "keep", self.engine.tokenizer, skip_special_tokens)
        held = self.holds.get(stream_id)
        try:
            async for text in stream:
                capped = parked is not None and parked.cap is not None and not parked.confirmed
                expired = held is not None and held.expired  # (a hold that expired ended at its cap)
                if (capped and parked.made >= parked.cap) or expired:
                    message = f"the preemptive answer stopped at {held.cap if expired else parked.cap} tokens"
                    error = error_body(503, message, type_=PREEMPTIVE_CAP)["error"]
                    break
                if text.startswith('data: {"error"') and (failed := _server_error(text)) is not None:
                    # vLLM writes an engine failure (its engine died) into the stream: end the stream with it
                    # instead, so that the router resumes the answer on another replica.
                    logger.error("decode stream %s failed in the engine: %s", stream_id, failed.get("message"))
                    error = failed
                    break
                if shown is None:
                    self.routes[stream_id].put(stream_id, text)
                else:
                    if isinstance(text, sse.Frame):  # its ids beside it (decode/sse.py)
                        prompt, tokens = shown.take_frame(text)
                    else:
                        text, prompt, tokens = shown.take(text)
                    if parked is not None:
                        parked.made += len(tokens)
                    self.routes[stream_id].put(stream_id, text, prompt, tokens)
        except asyncio.CancelledError:  # stopped: the client left, or its router did
            error = error_body(499, "stopped")["error"]
        except Exception as e:
            logger.exception("decode stream %s failed", stream_id)
            error = error_body(500, f"decode failed mid-stream: {e}")["error"]
        finally:
            if parked is not None and parked.confirmed:  # the answer now: nobody counts what it made
                self.parked.pop(stream_id, None)
            self.holds.pop(stream_id, None)
            try:
                await stream.aclose()  # closing vLLM's generator aborts the engine request
            finally:
                self.routes.pop(stream_id).end(stream_id, error)  # whatever happens, the router learns it ended

    async def feed(self, *, consumer: str, replica: str, direct: bool = False) -> AsyncGenerator[Any, None]:
        """`consumer`'s frames from every one of its streams on this replica, for as long as it listens and
        has streams here (an idle feed ends after FEED_IDLE_S; the router opens a new one when it needs it).
        `direct`: the call's one item is where the router connects (decode/wire.py); the batches go there."""
        if replica != self.replica:  # routed elsewhere: the replica it wants is gone
            raise RuntimeError(f"decode replica {replica} is gone")
        outbox = self.outboxes.setdefault(consumer, Outbox())
        token = outbox.owner = object()
        idle_end = False
        connection: Connection | None = None
        address: Address | None = None
        try:
            if direct and direct_allowed():
                address = self.listener.expect()
                yield address
                if (connection := await self.listener.accept(address["ticket"])) is None:
                    logger.warning("router %s did not connect to its feed: its batches go as items", consumer)
                else:  # (the router left: this feed's streams stop, as when its call is cancelled)
                    connection.on_lost = asyncio.current_task().cancel
                    connection.answer_calls(functools.partial(self._direct_call, connection, consumer))
            while outbox.owner is token:
                if (batch := await outbox.take(FEED_IDLE_S)) is None:
                    if outbox.idle and (connection is None or not connection.calls):  # (a start may be coming)
                        idle_end = True
                        return
                    continue
                if outbox.owner is not token:  # a newer feed of this router took over: it delivers this
                    outbox.restore(batch)
                    return
                if connection is None:
                    yield batch
                else:
                    await connection.send(batch)
        finally:
            if address is not None:
                self.listener.forget(address["ticket"])  # (closed before it came: Serve cancelled the call)
            if connection is not None:
                connection.close()  # (after the last batch: the router then reads how the call ended)
            if outbox.owner is token:
                outbox.owner = None
                if not idle_end:  # the router stopped listening (it left or died): nobody reads these streams
                    self._cancel_all(outbox)
                if self.outboxes.get(consumer) is outbox and (outbox.idle or not idle_end):
                    del self.outboxes[consumer]

    def _direct_call(self, connection: Connection, consumer: str, call: Call) -> None:
        """A call of `consumer`'s over its feed's connection (decode/wire.py): `start`, for that router."""
        detached(self._answer(connection, consumer, call))

    async def _answer(self, connection: Connection, consumer: str, call: Call) -> None:
        reply = error_body(500, "decode start was cancelled (the replica is stopping)")
        try:
            reply = await self.start(**{**call["kwargs"], "consumer": consumer})
        except Exception as e:  # (as the Serve call would raise it: the request fails)
            logger.exception("decode start over %s's feed failed", consumer)
            reply = error_body(500, f"decode start failed: {e}")
        finally:
            delivered = connection.reply(call["call"], reply)
        if not delivered and "replica" in reply and "error" not in reply:
            # Nobody learns it started (the router starts it again elsewhere, under a new id): it stops here.
            await self.stop(consumer=consumer, stream_id=call["kwargs"]["stream_id"])

    async def stop(self, *, consumer: str, stream_id: str, replica: str | None = None) -> dict[str, Any]:
        """The client left (or a preemptive answer was given up): abort its request. `{"tokens": n}`: what a
        preemptive answer had made, for its owner's accounting. A preemptive answer is found by its stream id
        also once a router adopted it tentatively (its frames go to that router now)."""
        state = self.parked.get(stream_id)
        owners = state is not None and state.parked == consumer  # its owner's stop: what it made is reported once
        if owners:
            del self.parked[stream_id]
        outbox = self.outboxes.get(consumer)
        if (outbox is None or stream_id not in outbox.tasks) and state is not None:
            outbox = self.routes.get(stream_id, outbox)
        if outbox is None:
            return {"tokens": state.made if state is not None else 0}
        if (task := outbox.tasks.get(stream_id)) is not None:
            if (held := self.holds.get(stream_id)) is not None:
                held.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        tokens = state.made if state is not None and owners else 0
        if not outbox.attached:  # parked: nobody will take what it made
            outbox.frames.pop(stream_id, None)
            outbox.ids.pop(stream_id, None)
            outbox.ended.pop(stream_id, None)
            if outbox.idle and self.outboxes.get(consumer) is outbox:
                del self.outboxes[consumer]
        return {"tokens": tokens}

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(5)
            now = time.monotonic()
            for stream_id, state in list(self.parked.items()):  # (a stream nobody stopped or confirmed)
                if now - state.started_at > PARKED_KEPT_S:
                    del self.parked[stream_id]
            for consumer, outbox in list(self.outboxes.items()):
                if not outbox.attached and now - outbox.drained_at > UNCLAIMED_OUTBOX_S:
                    logger.warning("router %s never read its %d streams: aborting them", consumer, len(outbox.tasks))
                    self._cancel_all(outbox)
                    del self.outboxes[consumer]

    def _cancel_all(self, outbox: Outbox) -> None:
        for stream_id in outbox.tasks:
            if (held := self.holds.get(stream_id)) is not None:
                held.close()
        outbox.cancel_all()

    def _active_streams(self) -> int:
        return sum(len(o.tasks) for o in self.outboxes.values())

    def record_routing_stats(self) -> dict[str, Any]:
        """Streams running here: the request router spreads new requests by it (router/placement.py), and the
        routers' admission control (router/admission/gate.py) compares them with what the engine runs at once."""
        return {ACTIVE_STREAMS: self._active_streams(), "stream_capacity": self.engine.max_num_seqs}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Streams are the load (Serve sees only the short calls that start them, and the feeds):
        core/autoscaling.py `stream_aware_policy`."""
        return {ACTIVE_STREAMS: float(self._active_streams())}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def stats(self, request_id_prefix: str | None = None, replica: str | None = None) -> dict[str, Any]:
        """The engine's figures (`replica` routes the call to that replica: router/placement.py)."""
        stats = await self.engine.compute_stats(request_id_prefix)
        if request_id_prefix is None:  # (a process-wide count: not one request's)
            stats["held_tokens_fed_again"] = tokens_fed_again()
        else:  # what its preemptive answers' streams passed on (ids with their text: behind the engine's own count)
            mine = [p.made for stream_id, p in self.parked.items() if request_id_prefix in stream_id]
            stats["parked_tokens_made"] = sum(mine)
        return {**stats, "replica": self.replica}

    def pid(self, replica: str | None = None) -> dict[str, Any]:
        """This replica's id and process id (fault-injection tests kill it)."""
        return {"replica": self.replica, "pid": os.getpid()}

    async def _export_stats(self) -> None:
        """The engine scheduler's KV load failures as Prometheus counters (deltas since the last export); not read
        again while the engine is idle (`Engine.activity`: a read wakes the engine core)."""
        read_at: Activity | None = None
        while True:
            await asyncio.sleep(STATS_EXPORT_S)
            try:
                read = await self.engine.stats_since(read_at)
            except Exception as e:
                if type(e).__name__ == "EngineDeadError":  # shutting down (or dead: check_health says so)
                    return
                logger.exception("reading engine stats failed")
                continue  # (read again next round)
            if read is None:
                continue
            read_at, stats = read
            previous, self._stats = self._stats, stats
            metrics.export_kv_load_failures(stats, previous, self.replica)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        if (listener := getattr(self, "listener", None)) is not None:
            listener.close()
        if (engine := getattr(self, "engine", None)) is not None:
            engine.shutdown()


def _server_error(frame: str) -> dict[str, Any] | None:
    """The error of a vLLM error frame when it is the server's (5xx); None for a client's error or non-JSON."""
    try:
        error = json.loads(frame[len("data: ") :])["error"]
    except (ValueError, KeyError, TypeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return error if isinstance(code, int) and code >= 500 else None
