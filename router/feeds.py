"""This router's side of the decode feeds (decode/feed.py): one stream per decode replica, demultiplexed.

`Feeds.open()` starts a request on a decode replica (Serve picks it) and returns a `DecodeStream`, the
request's own frames: everything ready at each step, joined. Its decode replica's feed is opened on first use
and read by one task for as long as the router lives; the frames of all its requests arrive in one Ray item
per engine step instead of one item per request per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from ray.serve.handle import DeploymentHandle

from router.tasks import detached
from serve_app.protocol import Endpoint, error_body

logger = logging.getLogger(__name__)


class DecodeFailed(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "decode failed"))
        self.error = error


class _End:
    def __init__(self, error: dict[str, Any] | None) -> None:
        self.error = error


class DecodeStream:
    """One request's SSE text from its decode replica: async-iterate it; `cancel()` when the client leaves."""

    def __init__(self, feeds: Feeds, stream_id: str) -> None:
        self.feeds, self.stream_id = feeds, stream_id
        self.replica: str | None = None
        self.queue: asyncio.Queue[str | _End] = asyncio.Queue()
        self._end: _End | None = None

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> str:
        if self._end is None:
            parts: list[str] = []
            item = await self.queue.get()
            while True:
                if isinstance(item, _End):
                    self._end = item
                    break
                parts.append(item)
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            if parts:
                return "".join(parts)
        if self._end.error is not None:  # (a stream this router stopped is gone from `streams` before its end)
            error, self._end.error = self._end.error, None  # raised once
            raise DecodeFailed(error)
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop the request on decode (a no-op once it has ended)."""
        if self.feeds.streams.pop(self.stream_id, None) is not None and self.replica is not None:
            self.feeds.stop(self)


class Feeds:
    def __init__(self, decode: DeploymentHandle, consumer: str) -> None:
        self.decode = decode.options(stream=False)
        self.consumer = consumer
        self.streams: dict[str, DecodeStream] = {}
        self.readers: dict[str, asyncio.Task[None]] = {}

    async def open(self, endpoint: Endpoint, body: dict[str, Any]) -> DecodeStream | dict[str, Any]:
        """A stream (for `stream: true`), or the answer itself: `{"response": ...}` or `{"error": ...}`."""
        stream = DecodeStream(self, uuid.uuid4().hex)
        self.streams[stream.stream_id] = stream  # before start: its first frames may come before start returns
        call = asyncio.ensure_future(
            self.decode.start.remote(consumer=self.consumer, stream_id=stream.stream_id, endpoint=endpoint, body=body)
        )
        try:
            started = await asyncio.shield(call)
        except asyncio.CancelledError:  # the client left: once it has started, stop it
            self.streams.pop(stream.stream_id, None)
            call.add_done_callback(lambda done: self._stop_started(stream, done))
            raise
        except BaseException:
            self.streams.pop(stream.stream_id, None)
            raise
        if "replica" not in started:
            self.streams.pop(stream.stream_id, None)
            return started
        stream.replica = started["replica"]
        self._read(stream.replica)
        return stream

    def _stop_started(self, stream: DecodeStream, call: asyncio.Future[Any]) -> None:
        if not call.cancelled() and call.exception() is None and "replica" in (started := call.result()):
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
            feed = self.decode.options(stream=True).feed.remote(consumer=self.consumer, replica=replica)
            async for frames, ended in feed:
                for stream_id, text in frames.items():
                    if (stream := self.streams.get(stream_id)) is not None:
                        stream.queue.put_nowait(text)
                for stream_id, end in ended.items():
                    if (stream := self.streams.pop(stream_id, None)) is not None:
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
            elif mine:  # the replica failed: its streams end with the error
                for stream_id, stream in mine:
                    self.streams.pop(stream_id, None)
                    stream.queue.put_nowait(_End(error))

    def stop(self, stream: DecodeStream) -> None:
        """Abort the stream's request on decode (detached: its client's request is being cancelled)."""
        detached(self._stop(stream.stream_id, stream.replica))

    async def _stop(self, stream_id: str, replica: str | None) -> None:
        with contextlib.suppress(Exception):
            await self.decode.stop.remote(consumer=self.consumer, stream_id=stream_id, replica=replica)
