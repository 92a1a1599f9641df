"""A streamed answer's SSE bytes, written to its client by the feed reader itself (router/streams/feeds.py).

The feed reader takes one item per decode step with every stream's frames. Relaying each frame through a queue,
a task wake of the request's own task, a relay generator and Starlette's StreamingResponse (which also starts a
task group and a disconnect listener per request) cost the router more per token than the write itself. Here
the reader hands a stream's frames to its `Sink`, which starts the ASGI `send` at once: it completes without
suspending unless the client's transport is paused (uvicorn's flow control). Only then is the rest of that send
finished in a task, and the stream's later frames wait in the sink's backlog, to leave joined in one write once
the client reads again. The request's own task (the `ForwardResponse`) writes what the reader does not: frames
that came while it writes, a resumed stream's frames (router/streams/resume.py), its end, and a mid-stream failure's
error frame.

A client that stops reading is not buffered without bound: past `MAX_BACKLOG_BYTES` queued for it
(router/streams/feeds.py), its stream is stopped on decode and its response ends, while every other stream goes on.
(This needs the client's flow control to reach the router: behind HAProxy, the default, it does; behind Serve's own
proxy `send` never waits, and Serve buffers as before.) A write that fails ends that stream alone, with the error.
A client that leaves is seen by Serve, which cancels the request's task (the `finally` stops the stream).
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from starlette.responses import Response

from core import metrics
from core.protocol import SSE_DONE, sse
from router.streams.feeds import DecodeFailed, DecodeStream

logger = logging.getLogger(__name__)
Send = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]


@types.coroutine
def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Generator[Any, Any, Any]:
    """Go on with a coroutine started by hand (its first `send(None)` yielded `waiting`), inside a task: what the
    task sends or throws (a cancel) goes into the coroutine, as if the task had run it from the start."""
    while True:
        try:
            sent = yield waiting
        except BaseException as e:
            try:
                waiting = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waiting = coro.send(sent)
            except StopIteration as stop:
                return stop.value


async def _finish(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    return await _resume(coro, waiting)


class Sink:
    """One response's writer. `offer` (the feed reader) writes at once, or, while a write is paused by the client's
    transport, keeps the frame to leave with the others in one write when it drains. `write` (the response's
    task) writes after all of that."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.pending: asyncio.Future[Any] | None = None  # a write the client's transport paused
        self.backlog: list[str] = []  # offered while it is paused
        self.backlog_bytes = 0
        self.writing: asyncio.Task[Any] | None = None  # the response's task, while it writes
        self.stalled = False
        self.failed: BaseException | None = None  # what a paused write raised: raised again by the next call

    def offer(self, text: str) -> int:
        """Write now, or after the paused write; the bytes waiting for the client."""
        if self.failed is not None:
            raise self.failed
        if self.pending is not None:
            self.backlog.append(text)
            self.backlog_bytes += len(text)
            return self.backlog_bytes
        self._start(text)
        return 0

    def _start(self, text: str) -> None:
        coro = self.send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        try:
            waiting = coro.send(None)
        except StopIteration:
            return
        except Exception as e:
            self.failed = e
            raise
        self.pending = asyncio.ensure_future(_finish(coro, waiting))
        self.pending.add_done_callback(self._written)

    def _written(self, done: asyncio.Future[Any]) -> None:
        self.pending = None
        if done.cancelled() or done.exception() is not None:
            self.backlog.clear()  # (no frame after a lost one: the stream ends with the error instead)
            if not done.cancelled():
                self.failed = done.exception()
            return
        if self.backlog:
            text = "".join(self.backlog)
            self.backlog.clear()
            self.backlog_bytes = 0
            self._start(text)

    async def drain(self) -> None:
        """Wait until every offered frame is written (what comes meanwhile joins the backlog's write)."""
        while self.pending is not None:
            await asyncio.wait({self.pending})
        if self.failed is not None:
            raise self.failed

    async def write(self, text: str) -> None:
        self.writing = asyncio.current_task()  # (the reader queues what comes now: it goes after this)
        try:
            await self.drain()
            await self.send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        except Exception as e:
            self.failed = e
            raise
        finally:
            self.writing = None

    def stall(self) -> None:
        """The client stopped reading: stop writing to it (its response's task ends)."""
        self.stalled = True
        if self.writing is not None:
            self.writing.cancel()
        self.close()

    def close(self) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()


class ForwardResponse(Response):
    """The SSE response of one decode stream, from its first frame on (a Starlette response: FastAPI sends it)."""

    def __init__(self, first: str, stream: DecodeStream, headers: dict[str, str], on_close: Callable[[], None]) -> None:
        self.first, self.stream, self.on_close = first, stream, on_close
        self.status_code, self.background = 200, None
        headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache", **headers}
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sink = Sink(send)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await sink.write(self.first)
            self.stream.sink = sink
            try:
                while True:  # what the reader did not write: a paused client's backlog, resumed frames, the end
                    await sink.drain()
                    try:
                        text = await anext(self.stream)
                    except StopAsyncIteration:
                        break
                    await sink.write(text)
            except DecodeFailed as e:  # the decode replica failed mid-stream and it could not be resumed
                if sink.stalled:
                    raise asyncio.CancelledError from None
                if sink.failed is not None:  # (ended because its client's write failed: not decode's fault)
                    raise sink.failed from None
                logger.error("decode stream failed: %s", e)
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="mid_stream")
                await sink.write(sse({"error": e.error}) + SSE_DONE)
            await sink.drain()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as e:
            if sink.failed is None:
                raise
            logger.warning("stream %s: writing to its client failed (%s); its response ended", self.stream.stream_id, e)
        except asyncio.CancelledError:
            if not sink.stalled:
                raise  # (the client left: Serve cancelled the request)
            if (task := asyncio.current_task()) is not None:
                task.uncancel()  # (the cancel was the stall's own, `Sink.stall`)
            logger.warning("stream %s: its client stopped reading; its response ended", self.stream.stream_id)
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="client_stalled")
        finally:
            self.stream.sink = None
            sink.close()
            self.stream.cancel()  # client gone or stream over: nothing may keep running on the decode engine
            self.on_close()
