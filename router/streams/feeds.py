"""This router's side of the decode feeds (decode/feed.py): one stream per decode replica, demultiplexed.

`Feeds.open()` starts a request on a decode replica (Serve picks it) and returns a `DecodeStream`, the
request's own frames: everything ready at each step, joined. Its decode replica's feed is opened on first use
and read by one task for as long as the router lives; the frames of all its requests arrive in one Ray item
per engine step instead of one item per request per token.

A stream outlives its replica: when the replica dies (its feed fails, or the stream ends with a server error)
the answer goes on on another replica from the tokens already forwarded (router/streams/resume.py), under the same
stream id, and the consumer reads on. A `start` that fails because its replica died is sent to another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from core import metrics
from core.protocol import PREEMPTIVE_CAP, Endpoint, error_body, error_status
from core.tasks import detached
from decode.client import DecodeClient, TokenIds
from router import placement
from router.streams import resume

logger = logging.getLogger(__name__)
START_ATTEMPTS = 3  # a start whose replica died (or whose engine did) goes to another replica, this many times
START_RETRY_S = 0.5  # doubled each time: Serve learns of a dead replica from the failed call itself
MAX_BACKLOG_BYTES = 4 * 2**20  # frames waiting for a client whose transport stays paused, before it is ended


class Sink(Protocol):
    """Where the feed reader writes a stream's frames itself (router/streams/forward.py)."""

    writing: Any  # the response's own task while it writes (then frames queue behind it), or None

    # Written now or after a paused write: the bytes still waiting (raises what an earlier write raised).
    def offer(self, text: str) -> int: ...

    def stall(self) -> None: ...  # the client stopped reading: end its response


class DecodeFailed(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "decode failed"))
        self.error = error


class _End:
    def __init__(self, error: dict[str, Any] | None) -> None:
        self.error = error


class DecodeStream:
    """One request's SSE text from its decode replica: async-iterate it; `cancel()` when the client leaves."""

    def __init__(
        self, feeds: Feeds, stream_id: str, endpoint: Endpoint = "chat", body: dict[str, Any] | None = None
    ) -> None:
        self.feeds, self.stream_id = feeds, stream_id
        self.endpoint, self.body = endpoint, body or {}  # the request as first sent: a resume starts from it
        self.replica: str | None = None
        self.queue: asyncio.Queue[tuple[str, TokenIds | None] | _End] = asyncio.Queue()
        self._end: _End | None = None
        self.ids: str | None = None  # decode's `ids` mode; None: not resumable
        self.progress = resume.Progress()
        self.failed: list[str] = []  # replicas it left: avoided, and their late frames dropped
        self.rewrite: resume.Rewriter | None = None  # a continuation's frames into this stream's shape
        self.cancelled = False
        self.prefer: str | None = None  # where a continuation goes if it can (the replica whose cache has it)
        self.tap: Callable[[str], None] | None = None  # sees its frames as they arrive (router/sessions/provisional.py)
        self.sink: Sink | None = None  # its client's writer, once streaming (router/streams/forward.py)
        self.backlog = 0  # bytes queued while its sink was busy (a paused client)

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> str:
        while True:
            if self._end is None:
                parts: list[str] = []
                item = await self.queue.get()
                self.backlog = 0
                while True:
                    if isinstance(item, _End):
                        self._end = item
                        break
                    parts.append(self.rewrite(item[0]) if self.rewrite is not None else item[0])
                    if item[1] is not None:
                        self.progress.add_ids(*item[1])
                    if self.queue.empty():
                        break
                    item = self.queue.get_nowait()
                if parts:
                    text = "".join(parts)
                    if self.ids is not None:
                        self.progress.saw(text)
                    return text
            if self._end.error is not None:  # (a stream this router stopped is gone from `streams` before its end)
                error, self._end.error = self._end.error, None  # raised once
                if await self.feeds.resume(self, error):
                    self._end = None
                    continue
                raise DecodeFailed(error)
            raise StopAsyncIteration

    def forward(self, text: str, ids: TokenIds | None) -> bool:
        """The feed reader's fast path: hand `text` to the client's sink now, if nothing waits before it (False: it
        goes through the queue, to the response's own task)."""
        sink = self.sink
        if sink is None or self.rewrite is not None or self._end is not None:
            return False
        if sink.writing is not None or not self.queue.empty():
            self.backlog += len(text)
            if self.backlog > MAX_BACKLOG_BYTES:
                self._stall()
            return False
        if ids is not None:
            self.progress.add_ids(*ids)
        if self.ids is not None:
            self.progress.saw(text)
        try:
            waiting = sink.offer(text)
        except Exception as e:  # this client's write failed: its stream ends, the feed's others go on
            logger.warning("stream %s: writing to its client failed: %s", self.stream_id, e)
            self.abort(error_body(500, f"writing to the client failed: {e}")["error"])
            return True
        if waiting > MAX_BACKLOG_BYTES:
            self._stall()
        return True

    def _stall(self) -> None:
        """Its client stopped reading with more than MAX_BACKLOG_BYTES waiting: it ends, the others go on."""
        self.abort(error_body(408, f"the client stopped reading with over {MAX_BACKLOG_BYTES} bytes waiting")["error"])
        if self.sink is not None:
            self.sink.stall()

    def abort(self, error: dict[str, Any]) -> None:
        """Stop it, and end it for its reader with `error` (not resumed: a 4xx)."""
        self.cancel()
        self.queue.put_nowait(_End(error))

    def cancel(self) -> None:
        """Stop the request on decode (a no-op once it has ended)."""
        self.cancelled = True
        if self.feeds.streams.pop(self.stream_id, None) is not None and self.replica is not None:
            self.feeds.stop(self)


class Feeds:
    def __init__(self, decode: DeploymentHandle, consumer: str, direct: bool = True, direct_start: bool = True) -> None:
        self.decode = DecodeClient(decode, direct)  # (`direct`: feeds over their own connection, decode/wire.py)
        self.direct_start = direct_start  # starts over an open feed connection (`decode.start: direct`)
        self._starting: Counter[str] = Counter()  # replica -> starts this router placed there, not yet answered
        self.consumer = consumer
        self.streams: dict[str, DecodeStream] = {}
        self.readers: dict[str, asyncio.Task[None]] = {}
        # Session id -> the reader holding its preemptive answer (router/sessions/provisional.py).
        self.held: dict[str, Any] = {}

    async def open(self, endpoint: Endpoint, body: dict[str, Any]) -> DecodeStream | dict[str, Any]:
        """A stream (for `stream: true`), or the answer itself: `{"response": ...}` or `{"error": ...}`."""
        stream = DecodeStream(self, uuid.uuid4().hex, endpoint, body)
        if body.get("stream") and resume.refusal(endpoint, body) is None:
            stream.ids = "keep" if body.get("return_token_ids") else "strip"
            stream.body = {**body, "return_token_ids": True}
        started = await self._start(stream, endpoint, stream.body)
        if "replica" not in started:
            return started
        stream.replica = started["replica"]
        self._read(stream.replica)
        return stream

    async def adopt(
        self,
        adopt: dict[str, Any],
        endpoint: Endpoint,
        body: dict[str, Any],
        tentative: bool = False,
        tap: Callable[[str], None] | None = None,
    ) -> DecodeStream | dict[str, Any]:
        """Take over a preemptive answer's decode stream (prefill/preemptive.py): `adopt` names its replica, the
        consumer it was parked under and its stream id; `body` is the answer's request (what a resume goes on
        from). The stream, or `{"error": ...}` (404: it is gone; the caller asks for an ordinary hand-off).
        `tentative`: its turn is not confirmed yet (router/sessions/provisional.py); `tap` sees its frames as they
        come."""
        if adopt["stream_id"] in self.streams:  # another reader here holds it: this one takes an ordinary hand-off
            return error_body(409, f"the preemptive answer {adopt['stream_id']} is another reader's")
        stream = DecodeStream(self, adopt["stream_id"], endpoint, {**body, "return_token_ids": True})
        stream.tap = tap
        if resume.refusal(endpoint, body) is None:  # (else it is not resumed: a continuation would differ)
            stream.ids = "keep" if body.get("return_token_ids") else "strip"
        self.streams[stream.stream_id] = stream  # before the call: the adopted frames may come before it returns
        call = asyncio.ensure_future(
            self.decode.adopt(
                consumer=self.consumer,
                stream_id=stream.stream_id,
                parked=adopt["parked"],
                request_id=stream.stream_id,
                replica=adopt["replica"],
                tentative=tentative,
            )
        )
        try:
            reply = await asyncio.shield(call)
        except asyncio.CancelledError:  # the client left: once adopted, it is stopped
            self._forget(stream)
            call.add_done_callback(lambda done: self._stop_started(stream, done))
            raise
        except Exception as e:  # (its replica died: the owner hands the KV off anew)
            reply = error_body(404, f"the preemptive answer's decode replica is gone: {e}")
        if "replica" not in reply:
            self._forget(stream)
            return reply
        stream.replica = reply["replica"]
        self._read(stream.replica)
        return stream

    def _forget(self, stream: DecodeStream) -> None:
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]

    def confirm(self, stream: DecodeStream) -> None:
        """A held preemptive answer is the answer (router/sessions/provisional.py): decode lifts its cap and ranks
        it as an ordinary answer (detached: its frames are here already)."""
        detached(self._confirm(stream.stream_id, stream.replica))

    async def _confirm(self, stream_id: str, replica: str | None) -> None:
        with contextlib.suppress(Exception):
            await self.decode.confirm(stream_id=stream_id, request_id=stream_id, replica=replica)

    async def _start(self, stream: DecodeStream, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
        """`start` on a replica chosen here by the pool's policy (over its feed's connection, if one is open) or by
        Serve, none of those the stream failed on; if that one turns out dead (or its engine does), the request
        again, elsewhere, without its KV."""
        lost = 0  # starts whose feed connection closed before their reply
        attempt = 0
        while True:
            self.streams[stream.stream_id] = stream  # before start: its first frames may come before it returns
            via = None
            if self.direct_start and self.decode.connections:  # (none open: no need to choose, Serve places it)
                via = placement.choose_decode(stream.failed, stream.prefer, self._local_streams)
            try:
                started = await self._start_once(stream, endpoint, body, via)
            except ConnectionError as e:  # (its feed's connection ended: an idle feed closing, or its replica gone)
                self.streams.pop(stream.stream_id, None)
                lost += 1
                if lost > START_ATTEMPTS:
                    raise RayActorError(error_msg=f"decode start of {stream.stream_id} lost: {e}") from e
                # The replica may have taken it (and read its KV): it is stopped there if it did, and its frames
                # never reach this stream. Again at once, without the KV: through Serve if the connection is gone,
                # which fails fast with the replica if that is gone too.
                detached(self._stop(stream.stream_id, via))
                stream.stream_id = uuid.uuid4().hex
                body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                continue
            except RayActorError as e:
                self.streams.pop(stream.stream_id, None)
                if attempt + 1 == START_ATTEMPTS:
                    raise
                logger.warning("decode start of %s failed (%s): trying another replica", stream.stream_id, e)
                # A replica that was only unreachable may have started it: its frames must not reach this stream.
                stream.stream_id = uuid.uuid4().hex
            except BaseException:
                self.streams.pop(stream.stream_id, None)
                raise
            else:
                failed_on = started.pop("replica", None) if "error" in started else None
                if failed_on is None or attempt + 1 == START_ATTEMPTS:
                    if "replica" not in started:
                        self.streams.pop(stream.stream_id, None)
                    return started
                stream.failed.append(failed_on)  # its engine failed (a 5xx before any output)
                logger.warning("decode replica %s failed to start %s: trying another", failed_on, stream.stream_id)
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            await asyncio.sleep(START_RETRY_S * 2**attempt)
            attempt += 1

    async def _start_once(
        self, stream: DecodeStream, endpoint: Endpoint, body: dict[str, Any], via: str | None
    ) -> dict[str, Any]:
        """One `start` (`via`: on that replica, over its feed's connection if open); a client that leaves meanwhile
        stops the stream once it has started."""
        if via is not None:
            self._starting[via] += 1  # (a burst's starts count each other)
        try:
            call = asyncio.ensure_future(
                self.decode.start(
                    consumer=self.consumer,
                    stream_id=stream.stream_id,
                    endpoint=endpoint,
                    body=body,
                    ids=stream.ids,
                    avoid=list(stream.failed),
                    prefer=stream.prefer,
                    via=via,
                )
            )
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:  # the client left: once it has started, stop it
                self.streams.pop(stream.stream_id, None)
                call.add_done_callback(lambda done: self._stop_started(stream, done))
                raise
        finally:
            if via is not None:
                self._starting[via] -= 1
                if not self._starting[via]:
                    del self._starting[via]

    def _local_streams(self) -> dict[str, int]:
        """This router's streams on each decode replica, and its starts placed there still in flight."""
        counts = self._starting.copy()
        counts.update(stream.replica for stream in self.streams.values() if stream.replica is not None)
        return counts

    async def resume(self, stream: DecodeStream, error: dict[str, Any]) -> bool:
        """Go on with `stream` on another replica after its own failed with `error`; False: it cannot."""
        if stream.cancelled:  # stopped here (`abort`: withdrawn), not failed: nothing goes on
            return False
        if error_status({"error": error}) < 500 or stream.ids is None:  # (499: stopped, not failed)
            return False
        why = "resumed too often" if len(stream.failed) >= resume.MAX_RESUMES else None
        progress = stream.progress
        if why is None and progress.sent and progress.prompt is None:
            why = "no token ids were seen"
        if why is not None:
            logger.error("decode stream %s failed and cannot be resumed (%s): %s", stream.stream_id, why, error)
            metrics.inc(metrics.DECODE_RESUMES, 1, "decode answers resumed elsewhere", outcome="refused")
            return False
        # No stop to the failed replica: a call for a replica that is gone goes to another one, which may be
        # where this stream id is about to go on.
        dead, stream.replica = stream.replica, None
        if error.get("type") == PREEMPTIVE_CAP:
            # Not a failure: an adopted preemptive answer stopped at its cap (decode/server.py). It goes on where
            # its KV is cached, from its ids.
            stream.prefer, dead = dead, None
        elif dead is not None:
            stream.failed.append(dead)
        attempt = len(stream.failed)
        if progress.finished:  # every token went out: only the end is missing
            stream.rewrite = None
            if not progress.done:
                stream.queue.put_nowait((resume.tail(stream.endpoint, stream.body, progress), None))
            stream.queue.put_nowait(_End(None))
            return self._resumed(stream, dead, "finished", error)
        if progress.prompt is not None:
            endpoint: Endpoint = "completion"
            body = resume.continuation(stream.body, progress, attempt)
            rewrite: resume.Rewriter | None = resume.Rewriter(stream.endpoint, progress, stream.ids == "keep")
            outcome = "resumed"
        else:
            endpoint, body, rewrite, outcome = stream.endpoint, resume.restart(stream.body, attempt), None, "restarted"
        try:
            started = await self._start(stream, endpoint, body)
        except RayActorError as e:
            started = error_body(503, f"no decode replica could take the answer over: {e}")
        if "replica" not in started:
            logger.error("decode stream %s could not be resumed: %s", stream.stream_id, started.get("error"))
            metrics.inc(metrics.DECODE_RESUMES, 1, "decode answers resumed elsewhere", outcome="failed")
            return False
        stream.replica, stream.rewrite = started["replica"], rewrite
        if stream.cancelled:  # cancelled while it was being resumed (Realtime `response.cancel`)
            self.stop(stream)
            stream.queue.put_nowait(_End(None))
            return True
        self._read(stream.replica)
        return self._resumed(stream, dead, outcome, error)

    def _resumed(self, stream: DecodeStream, dead: str | None, outcome: str, error: dict[str, Any]) -> bool:
        if error.get("type") == PREEMPTIVE_CAP:  # not a failure: an adopted preemptive answer goes on
            metrics.inc(metrics.DECODE_RESUMES, 1, "decode answers resumed elsewhere", outcome="preemptive_continued")
            return True
        logger.warning(
            "decode stream %s %s on replica %s after %d tokens (replica %s failed: %s)",
            stream.stream_id,
            outcome,
            stream.replica,
            len(stream.progress.generated),
            dead,
            error.get("message"),
        )
        metrics.inc(metrics.DECODE_RESUMES, 1, "decode answers resumed elsewhere", outcome=outcome)
        return True

    def _stop_started(self, stream: DecodeStream, call: asyncio.Future[Any]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        if "replica" in (started := call.result()) and "error" not in started:
            stream.replica = started["replica"]
            self.stop(stream)

    def _read(self, replica: str) -> None:
        reader = self.readers.get(replica)
        if reader is None or reader.done():
            self.readers[replica] = detached(self._reader(replica))  # no request's: it carries them all

    async def _reader(self, replica: str) -> None:
        error: dict[str, Any] | None = None
        cancelled = False
        try:
            async with contextlib.aclosing(self.decode.feed(consumer=self.consumer, replica=replica)) as batches:
                async for batch in batches:
                    frames, ended, ids = batch if len(batch) == 3 else (*batch, {})
                    for stream_id, text in frames.items():
                        if (stream := self.streams.get(stream_id)) is not None and replica not in stream.failed:
                            if not stream.forward(text, step_ids := ids.get(stream_id)):
                                stream.queue.put_nowait((text, step_ids))
                            if stream.tap is not None:
                                stream.tap(text)
                    for stream_id, end in ended.items():
                        if (stream := self.streams.get(stream_id)) is not None and replica not in stream.failed:
                            del self.streams[stream_id]
                            stream.queue.put_nowait(_End(end))
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as e:
            logger.exception("feed from decode replica %s failed", replica)
            error = error_body(500, f"decode replica {replica} failed: {e}")["error"]
        finally:
            mine = [(sid, s) for sid, s in self.streams.items() if s.replica == replica]
            if error is None and mine and not cancelled:  # it ended idle just as a stream started: read anew
                self.readers[replica] = detached(self._reader(replica))
            elif mine:  # the replica failed: its streams end with the error (and are resumed elsewhere)
                for stream_id, stream in mine:
                    self.streams.pop(stream_id, None)
                    stream.queue.put_nowait(_End(error))

    def stop(self, stream: DecodeStream) -> None:
        """Abort the stream's request on decode (detached: its client's request is being cancelled)."""
        detached(self._stop(stream.stream_id, stream.replica))

    async def _stop(self, stream_id: str, replica: str | None) -> None:
        with contextlib.suppress(Exception):
            await self.decode.stop(consumer=self.consumer, stream_id=stream_id, replica=replica)
