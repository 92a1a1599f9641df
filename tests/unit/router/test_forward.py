"""router/streams/forward.py: the feed reader writes a stream's frames to its client itself; a paused client gets its
backlog in order and joined; one that stops reading is ended past the bound while other streams go on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.streams import feeds as feeds_module
from router.streams.feeds import DecodeStream, Feeds
from router.streams.forward import ForwardResponse
from tests.unit.router.test_feeds import FakeDecode


class Client:
    """An ASGI `send` that records the body; `pause()` makes every later write wait until `resume()` (as uvicorn's
    send waits for a paused transport to drain)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.writes: list[str] = []
        self.readable = asyncio.Event()
        self.readable.set()
        self.in_task: list[bool] = []  # per write: whether it ran in the response's own task

    def pause(self) -> None:
        self.readable.clear()

    def resume(self) -> None:
        self.readable.set()

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message["body"]:
            self.writes.append(message["body"].decode())
            self.in_task.append(asyncio.current_task() is getattr(self, "task", None))
            if not self.readable.is_set():
                await self.readable.wait()

    @property
    def ended(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body") for m in self.messages)


async def _open(decode: FakeDecode, feeds: Feeds) -> tuple[DecodeStream, Client, asyncio.Task[None], list[str]]:
    stream = await feeds.open("chat", {"stream": True})
    assert isinstance(stream, DecodeStream)
    closed: list[str] = []
    client = Client()
    response = ForwardResponse("data: first\n\n", stream, {"X-Request-Id": "r1"}, lambda: closed.append("closed"))
    task = asyncio.ensure_future(response({"type": "http"}, None, client.send))
    client.task = task  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return stream, client, task, closed


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_feed_reader_writes_each_frame_itself_in_order() -> None:
    async def run() -> tuple[Client, list[str], DecodeStream]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        stream, client, task, closed = await _open(decode, feeds)
        for i in range(3):
            await decode.batches.put(({stream.stream_id: f"data: {i}\n\n"}, {}, {}))
            await _settle()
        await decode.batches.put(({stream.stream_id: "data: [DONE]\n\n"}, {stream.stream_id: None}, {}))
        await asyncio.wait_for(task, 2)
        return client, closed, stream

    client, closed, stream = asyncio.run(run())
    assert client.messages[0]["type"] == "http.response.start" and client.messages[0]["status"] == 200
    headers = dict(client.messages[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and headers[b"x-request-id"] == b"r1"
    assert client.writes == ["data: first\n\n", "data: 0\n\n", "data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"]
    # The frames of each step were written by the feed reader, not by the response's own task (woken per frame).
    assert client.in_task[1:4] == [False, False, False]
    assert client.ended and closed == ["closed"] and stream.progress.done


def test_a_paused_client_gets_its_backlog_in_order_in_one_write_and_the_others_go_on() -> None:
    async def run() -> tuple[Client, Client]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        slow, slow_client, slow_task, _ = await _open(decode, feeds)
        fast, fast_client, fast_task, _ = await _open(decode, feeds)
        slow_client.pause()
        for i in range(4):
            await decode.batches.put(({slow.stream_id: f"s{i} ", fast.stream_id: f"f{i} "}, {}, {}))
            await _settle()
        assert fast_client.writes[1:] == ["f0 ", "f1 ", "f2 ", "f3 "]  # not held up by the paused one
        slow_client.resume()
        await _settle()
        await decode.batches.put(({}, {slow.stream_id: None, fast.stream_id: None}, {}))
        await asyncio.wait_for(asyncio.gather(slow_task, fast_task), 2)
        return slow_client, fast_client

    slow, fast = asyncio.run(run())
    # s0 was being written when the client paused; s1..s3 waited and left as one write once it read again.
    assert slow.writes[1:] == ["s0 ", "s1 s2 s3 "]
    assert slow.ended and fast.ended


def test_a_client_that_stops_reading_is_ended_past_the_bound_and_its_stream_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(feeds_module, "MAX_BACKLOG_BYTES", 100)

    async def run() -> tuple[Client, Client, FakeDecode, list[str], DecodeStream]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        stuck, stuck_client, stuck_task, closed = await _open(decode, feeds)
        other, other_client, other_task, _ = await _open(decode, feeds)
        stuck_client.pause()
        for _ in range(6):
            await decode.batches.put(({stuck.stream_id: "x" * 30, other.stream_id: "y"}, {}, {}))
            await _settle()
        await asyncio.wait_for(stuck_task, 2)  # ended, with no wait on the client that does not read
        await decode.batches.put(({other.stream_id: "z"}, {other.stream_id: None}, {}))
        await asyncio.wait_for(other_task, 2)
        return stuck_client, other_client, decode, closed, stuck

    stuck, other, decode, closed, stream = asyncio.run(run())
    assert decode.stopped == [stream.stream_id]  # the engine stops making its tokens
    assert closed == ["closed"] and not stuck.ended  # its response ended without waiting on it
    assert "".join(other.writes[1:]) == "y" * 6 + "z" and other.ended


def test_a_failure_that_cannot_be_resumed_ends_the_stream_with_an_error_frame() -> None:
    async def run() -> Client:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        stream, client, task, _ = await _open(decode, feeds)
        await decode.batches.put(
            ({stream.stream_id: "data: 0\n\n"}, {stream.stream_id: {"message": "boom", "code": 500}}, {})
        )
        await asyncio.wait_for(task, 2)
        return client

    client = asyncio.run(run())
    assert client.writes[1] == "data: 0\n\n"
    assert client.writes[2].startswith('data: {"error": {"message": "boom"') and client.writes[2].endswith("[DONE]\n\n")
    assert client.ended


def test_a_client_whose_write_fails_ends_alone_and_later_frames_are_not_written() -> None:
    async def run() -> tuple[Client, Client, FakeDecode, DecodeStream, asyncio.Task[None], asyncio.Task[None]]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        broken, broken_client, broken_task, _ = await _open(decode, feeds)
        other, other_client, other_task, _ = await _open(decode, feeds)
        original = broken_client.send

        async def failing(message: dict[str, Any]) -> None:
            if message.get("body") == b"b1":
                raise RuntimeError("connection reset")
            await original(message)

        broken_client.send = failing  # type: ignore[method-assign]
        assert isinstance(broken.sink, object)
        broken.sink.send = failing  # type: ignore[union-attr]
        for i in range(3):
            await decode.batches.put(({broken.stream_id: f"b{i}", other.stream_id: f"o{i}"}, {}, {}))
            await _settle()
        await decode.batches.put(({other.stream_id: "end"}, {other.stream_id: None}, {}))
        await asyncio.wait_for(other_task, 2)
        await asyncio.wait([broken_task], timeout=2)
        return broken_client, other_client, decode, broken, broken_task, other_task

    broken_client, other_client, decode, broken, broken_task, other_task = asyncio.run(run())
    assert broken_client.writes[1:] == ["b0"]  # nothing after the write that failed
    assert broken_task.done() and decode.stopped == [broken.stream_id]  # ended, and stopped on decode
    assert "".join(other_client.writes[1:]) == "o0o1o2end" and other_client.ended  # the feed went on
