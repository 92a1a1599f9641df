"""The decode feeds: an outbox hands over everything ready at once; the router demultiplexes it per request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from core.protocol import PREEMPTIVE_CAP
from decode.feed import Outbox
from router.streams.feeds import DecodeFailed, DecodeStream, Feeds


def test_outbox_hands_over_everything_ready_in_one_item() -> None:
    async def run() -> list[Any]:
        box = Outbox()
        box.put("a", "data: 1\n\n")
        box.put("b", "data: x\n\n")
        box.put("a", "data: 2\n\n")
        first = await box.take()
        box.end("a")
        box.end("b", {"message": "boom", "code": 500})
        second = await box.take()
        waiting = asyncio.ensure_future(box.take())
        await asyncio.sleep(0.01)
        return [first, second, waiting.done()]

    first, second, blocked = asyncio.run(run())
    assert first == ({"a": "data: 1\n\ndata: 2\n\n", "b": "data: x\n\n"}, {}, {})
    assert second == ({}, {"a": None, "b": {"message": "boom", "code": 500}}, {})
    assert blocked is False  # nothing ready: the feed waits, it does not spin


def test_an_outbox_take_with_an_idle_limit_gives_none_only_when_nothing_came() -> None:
    async def run() -> list[Any]:
        box = Outbox()
        nothing = await box.take(0.05)
        later = asyncio.ensure_future(box.take(5))
        await asyncio.sleep(0.01)
        box.put("a", "data: 1\n\n")
        return [nothing, await asyncio.wait_for(later, 1)]

    nothing, got = asyncio.run(run())
    assert nothing is None
    assert got == ({"a": "data: 1\n\n"}, {}, {})


class FakeCall:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        async def result() -> Any:
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value

        return result().__await__()


class FakeStreamingCall:
    """A streaming Serve call's response: iterated, or cancelled."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self.items = items
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.items

    def cancel(self) -> None:
        self.cancelled = True


class Method:
    """A handle's method: `remote` is `fn`."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeDecode:
    """A decode deployment handle: `start` answers with its replica; `feed` yields what the test pushes."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue[Any] = asyncio.Queue()
        self.stopped: list[str] = []
        self.confirmed: list[str] = []
        self.feeds: list[dict[str, Any]] = []
        self.start_reply: dict[str, Any] = {"replica": "d1"}
        self.start_kwargs: dict[str, Any] = {}

    def options(self, **_: Any) -> FakeDecode:
        return self

    @property
    def start(self) -> Any:
        outer = self

        class Method:
            def remote(self, **kwargs: Any) -> FakeCall:
                outer.start_kwargs = kwargs
                return FakeCall(outer.start_reply)

        return Method()

    @property
    def feed(self) -> Any:
        outer = self

        class Method:
            def remote(self, **kwargs: Any) -> AsyncIterator[Any]:
                outer.feeds.append(kwargs)

                async def gen() -> AsyncIterator[Any]:
                    while True:
                        batch = await outer.batches.get()
                        if isinstance(batch, StopAsyncIteration):
                            return
                        if isinstance(batch, BaseException):
                            raise batch
                        yield batch

                return FakeStreamingCall(gen())

        return Method()

    adopt = start  # (recorded and answered as a start is)

    @staticmethod
    def _recording(into: list[str], reply: Any) -> Any:
        """A method that records the stream id of each call in `into` and answers `reply`."""

        class Method:
            def remote(self, **kwargs: Any) -> FakeCall:
                into.append(kwargs["stream_id"])
                return FakeCall(reply)

        return Method()

    @property
    def stop(self) -> Any:
        return self._recording(self.stopped, None)

    @property
    def confirm(self) -> Any:
        return self._recording(self.confirmed, {"confirmed": True})


async def collect(stream: DecodeStream) -> list[str]:
    return [text async for text in stream]


def test_a_second_reader_never_takes_over_a_held_preemptive_answer() -> None:
    """Two readers of one session on one router (an old `/events` and its reconnect): the one that holds the
    preemptive answer's stream keeps it and its frames; the other is refused (it takes an ordinary hand-off)."""

    async def run() -> tuple[Any, Any, list[str]]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        live = {"replica": "d1", "parked": "preempt:s", "stream_id": "s-t0-p1"}
        held = await feeds.adopt(live, "chat", {"stream": True}, tentative=True)
        other = await feeds.adopt(live, "chat", {"stream": True})
        await decode.batches.put(({"s-t0-p1": "data: 1\n\n"}, {"s-t0-p1": None}, {}))
        assert isinstance(held, DecodeStream)
        return held, other, await collect(held)

    held, other, frames = asyncio.run(run())
    assert other["error"]["code"] == 409
    assert frames == ["data: 1\n\n"]  # the holder still gets its frames and its end


def test_feeds_demultiplex_one_feed_into_each_requests_stream() -> None:
    async def run() -> tuple[list[str], list[str], FakeDecode]:
        decode = FakeDecode()
        feeds = Feeds(decode, "router-1")  # type: ignore[arg-type]
        a = await feeds.open("chat", {"stream": True})
        b = await feeds.open("chat", {"stream": True})
        assert isinstance(a, DecodeStream) and isinstance(b, DecodeStream)
        decode.batches.put_nowait(({a.stream_id: "A1", b.stream_id: "B1"}, {}))
        decode.batches.put_nowait(({a.stream_id: "A2"}, {a.stream_id: None}))
        decode.batches.put_nowait(({b.stream_id: "B2"}, {b.stream_id: None}))
        got_a, got_b = await asyncio.gather(collect(a), collect(b))
        return got_a, got_b, decode

    got_a, got_b, decode = asyncio.run(run())
    assert "".join(got_a) == "A1A2" and "".join(got_b) == "B1B2"
    assert len(decode.feeds) == 1 and decode.feeds[0] == {
        "consumer": "router-1",
        "replica": "d1",
        "direct": True,
    }  # one feed


def test_a_stream_ending_with_an_error_raises_it_even_a_stop_it_did_not_ask_for() -> None:
    async def run() -> tuple[Any, list[str]]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        a = await feeds.open("chat", {})
        b = await feeds.open("chat", {})
        assert isinstance(a, DecodeStream) and isinstance(b, DecodeStream)
        decode.batches.put_nowait(({a.stream_id: "x"}, {a.stream_id: {"message": "boom", "code": 500}}))
        decode.batches.put_nowait(({}, {b.stream_id: {"message": "stopped", "code": 499}}))
        with pytest.raises(DecodeFailed) as failed:
            await collect(a)
        with pytest.raises(DecodeFailed) as stopped:  # an abort this router did not ask for is a failure
            await collect(b)
        return failed.value.error, stopped.value.error

    error, stopped = asyncio.run(run())
    assert error["message"] == "boom" and stopped["code"] == 499


def test_a_feed_that_fails_ends_every_stream_of_that_replica_with_an_error() -> None:
    async def run() -> Any:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        a = await feeds.open("chat", {})
        assert isinstance(a, DecodeStream)
        decode.batches.put_nowait(RuntimeError("replica died"))
        with pytest.raises(DecodeFailed) as failed:
            await collect(a)
        return failed.value.error, feeds.streams

    error, streams = asyncio.run(run())
    assert "replica died" in error["message"] and streams == {}


def test_a_feed_that_ends_idle_is_read_again_for_streams_still_running() -> None:
    async def run() -> list[str]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        a = await feeds.open("chat", {})
        assert isinstance(a, DecodeStream)
        decode.batches.put_nowait(StopAsyncIteration())  # the fake's way of ending a feed normally
        await asyncio.sleep(0.01)
        decode.batches.put_nowait(({a.stream_id: "late"}, {a.stream_id: None}))
        return await collect(a)

    assert asyncio.run(run()) == ["late"]


def test_cancel_stops_the_request_on_decode_once_and_non_streams_are_answers() -> None:
    async def run() -> tuple[list[str], Any]:
        decode = FakeDecode()
        feeds = Feeds(decode, "r")  # type: ignore[arg-type]
        a = await feeds.open("chat", {})
        assert isinstance(a, DecodeStream)
        a.cancel()
        a.cancel()
        await asyncio.sleep(0)
        decode.start_reply = {"response": {"object": "chat.completion"}}
        whole = await feeds.open("chat", {"stream": False})
        return decode.stopped, (whole, feeds.streams)

    stopped, (whole, streams) = asyncio.run(run())
    assert len(stopped) == 1
    assert whole == {"response": {"object": "chat.completion"}} and streams == {}


class FakeEngine:
    """A decode replica's engine as the feed logic uses it: the priority calls, recorded."""

    tokenizer = None  # (frames of one id each: nothing to tell apart)

    def __init__(self) -> None:
        self.priorities: list[tuple[str, int]] = []

    async def utility(self, method: str, *args: Any) -> int:
        assert method == "rtpd_set_priority"
        self.priorities.append(args)
        return 1

    def shutdown(self) -> None:  # (DecodeServer.__del__ shuts its engine down)
        pass


def _decode_server() -> Any:
    """The decode deployment's class without its engine: the feed logic only needs its outboxes."""
    from decode.server import DecodeServer

    server = object.__new__(DecodeServer.func_or_class)
    server.replica, server.outboxes, server.routes, server.parked, server.holds = "d1", {}, {}, {}, {}
    return server


def test_a_newer_feed_takes_the_outbox_over_and_the_older_one_leaves_it_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import decode.server

    monkeypatch.setattr(decode.server, "FEED_IDLE_S", 0.2)  # an outdated feed notices within this

    async def run() -> tuple[Any, Any, bool]:
        server = _decode_server()
        old = server.feed(consumer="r", replica="d1")
        old_next = asyncio.ensure_future(old.__anext__())
        await asyncio.sleep(0)
        new = server.feed(consumer="r", replica="d1")
        new_next = asyncio.ensure_future(new.__anext__())
        await asyncio.sleep(0)
        outbox = server.outboxes["r"]
        outbox.tasks["s1"] = asyncio.ensure_future(asyncio.sleep(10))  # a running stream
        outbox.put("s1", "frame")
        await asyncio.sleep(0.01)
        # Whichever generator woke, the frame reaches the newer feed; the older one leaves without cleanup.
        got = await asyncio.wait_for(new_next, 1)
        with contextlib.suppress(StopAsyncIteration):
            await asyncio.wait_for(old_next, 2)  # it ends: taken over
        alive = not outbox.tasks["s1"].cancelled() and server.outboxes.get("r") is outbox
        outbox.tasks["s1"].cancel()
        await new.aclose()
        return got, server.outboxes, alive

    got, outboxes, alive = asyncio.run(run())
    assert got == ({"s1": "frame"}, {}, {})
    assert alive  # the older feed's end cancelled nothing and kept the outbox
    assert outboxes == {}  # the newer feed, closed by its router, cleaned up


def test_a_feed_for_another_replica_fails() -> None:
    async def run() -> None:
        await _decode_server().feed(consumer="r", replica="gone").__anext__()

    with pytest.raises(RuntimeError, match="gone"):
        asyncio.run(run())


def test_an_adopted_stream_moves_with_what_it_made_and_what_it_makes_next() -> None:
    """A preemptive answer (prefill/preemptive.py) runs on decode for a consumer no router reads; the router that
    serves the answer adopts it: the frames it made so far come first on that router's feed, then the rest."""

    async def run() -> tuple[Any, Any, Any, Any]:
        server = _decode_server()
        server.engine = FakeEngine()
        go_on = asyncio.Event()

        async def answer() -> AsyncIterator[str]:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
            await go_on.wait()
            yield "data: 3\n\n"

        parked = server.outboxes.setdefault("preempt:s", Outbox())
        server.routes["x"] = parked
        parked.tasks["x"] = asyncio.ensure_future(server._pump(answer(), "x"))
        await asyncio.sleep(0.01)
        missing = await server.adopt(consumer="r", stream_id="nope", parked="preempt:s", request_id="s-t0")
        adopted = await server.adopt(consumer="r", stream_id="x", parked="preempt:s", request_id="s-t0")
        first = await server.outboxes["r"].take()
        go_on.set()
        await asyncio.sleep(0.01)
        rest = await server.outboxes["r"].take()
        return missing, adopted, (first, rest, "preempt:s" in server.outboxes), server.engine.priorities

    missing, adopted, (first, rest, parked_left), priorities = asyncio.run(run())
    assert missing["error"]["code"] == 404
    assert adopted == {"replica": "d1"}
    assert first == ({"x": "data: 1\n\ndata: 2\n\n"}, {}, {})
    assert rest == ({"x": "data: 3\n\n"}, {"x": None}, {})
    assert not parked_left  # nothing else was parked there: its outbox is gone
    assert priorities == [("s-t0", 0)]  # an ordinary answer's rank on the engine from now on


def test_a_tentatively_adopted_stream_keeps_its_cap_until_confirmed_and_is_stopped_by_its_id() -> None:
    """A router whose reader waits for the turn adopts a preemptive answer tentatively (router/sessions/provisional.py):
    its frames go to that router, but it still stops at its cap and keeps its rank until the owner confirms the
    turn; a discarded one is stopped by its owner, by stream id, wherever its frames go, with what it made."""
    from decode.server import ParkedStream

    def frame(i: int) -> str:
        return f'data: {{"choices":[{{"index":0,"text":"t{i}","token_ids":[{i}]}}]}}\n\n'

    async def run(confirm: bool) -> tuple[Any, ...]:
        server = _decode_server()
        server.engine = FakeEngine()
        more = asyncio.Event()

        async def answer() -> AsyncIterator[str]:
            for i in range(1, 7):
                if i == 3:
                    await more.wait()
                yield frame(i)

        parked = server.outboxes.setdefault("preempt:s", Outbox())
        server.routes["x"] = parked
        state = server.parked["x"] = ParkedStream(cap=3, request_id="s-t0-p1", parked="preempt:s")
        parked.tasks["x"] = asyncio.ensure_future(server._pump(answer(), "x", "strip", state))
        await asyncio.sleep(0.01)
        await server.adopt(consumer="r", stream_id="x", parked="preempt:s", request_id="x", tentative=True)
        held = await server.outboxes["r"].take()  # what it made so far is at the router already
        if confirm:
            await server.confirm(stream_id="x")  # (its engine request: as its start named it)
        more.set()
        await asyncio.sleep(0.01)
        rest = await server.outboxes["r"].take()
        stopped = await server.stop(consumer="preempt:s", stream_id="x", replica="d1")
        return held, rest, stopped, server.engine.priorities

    held, rest, stopped, priorities = asyncio.run(run(confirm=False))
    assert list(held[0]) == ["x"] and "t2" in held[0]["x"]
    assert "t3" in rest[0]["x"] and "t4" not in rest[0]["x"]  # stopped at its cap: 3 tokens
    assert rest[1]["x"]["type"] == PREEMPTIVE_CAP
    assert priorities == []  # still a preemptive answer's rank
    assert stopped == {"tokens": 3}  # its owner's stop finds it by its id: what it made is counted

    held, rest, stopped, priorities = asyncio.run(run(confirm=True))
    assert "t6" in rest[0]["x"] and rest[1]["x"] is None  # confirmed: no cap, it ended whole
    assert priorities == [("s-t0-p1", 0)]


async def test_the_stats_export_ends_quietly_when_the_engine_is_dead(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A replica shutting down: its engine is dead, and the export loop stops instead of logging a traceback every
    few seconds (reading engine stats failed: EngineDeadError) until the process goes."""
    import decode.server

    class EngineDeadError(Exception):  # (vLLM's, by name: decode/server.py does not import vLLM's errors)
        pass

    class DeadEngine:
        async def stats_since(self, read_at: Any) -> Any:
            raise EngineDeadError("EngineCore encountered an issue")

    monkeypatch.setattr(decode.server, "STATS_EXPORT_S", 0.001)
    server = object.__new__(decode.server.DecodeServer.func_or_class)
    server.engine = DeadEngine()
    await asyncio.wait_for(server._export_stats(), 1.0)
    assert "reading engine stats failed" not in caplog.text
