"""decode/wire.py: a feed's batches over the router's own TCP connection to the decode replica, on real sockets, with
the decode replica's feed logic (decode/server.py `feed`) and the router's reader (router/streams/feeds.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from decode import wire
from decode.client import DecodeClient
from decode.feed import Outbox
from router.streams.feeds import DecodeStream, Feeds
from tests.unit.router.test_feeds import FakeStreamingCall, Method, _decode_server


def _server_with_listener() -> Any:
    server = _decode_server()
    server.listener = wire.Listener("127.0.0.1")
    return server


class EagerCall(FakeStreamingCall):
    """A streaming Serve call as Serve runs it: the replica's generator goes on whether or not the caller reads."""

    def __init__(self, generator: Any) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.pump = asyncio.ensure_future(self._pump(generator))
        super().__init__(self._items())

    async def _pump(self, generator: Any) -> None:
        try:
            async for item in generator:
                self.queue.put_nowait(item)
            self.queue.put_nowait(StopAsyncIteration())
        except BaseException as e:
            self.queue.put_nowait(e)

    async def _items(self) -> Any:
        while not isinstance(item := await self.queue.get(), StopAsyncIteration):
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        super().cancel()
        self.pump.cancel()


class ServerHandle:
    """A decode handle whose `feed` runs the decode replica's own feed generator (and `start` starts nothing)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.calls: list[FakeStreamingCall] = []
        self.feed = Method(self._feed)

    def options(self, **_: Any) -> ServerHandle:
        return self

    def _feed(self, **kwargs: Any) -> FakeStreamingCall:
        self.calls.append(EagerCall(self.server.feed(**kwargs)))
        return self.calls[-1]


async def _open_stream(feeds: Feeds, server: Any, stream_id: str) -> DecodeStream:
    """A stream as `Feeds.open` leaves it once decode started it on replica d1 (whose task runs until ended)."""
    stream = DecodeStream(feeds, stream_id)
    stream.replica = "d1"
    feeds.streams[stream_id] = stream
    outbox = server.outboxes.setdefault("r", Outbox())
    outbox.tasks[stream_id] = asyncio.ensure_future(asyncio.sleep(60))
    server.routes[stream_id] = outbox
    feeds._read("d1")
    return stream


def test_a_batch_survives_the_wire_as_it_was() -> None:
    batch = ({"s1": 'data: {"x":"é"}\n\n'}, {"s2": None, "s3": {"message": "boom", "code": 500}}, {"s1": ([1, 2], [3])})
    packed = wire.pack(batch)
    assert int.from_bytes(packed[:4], "big") == len(packed) - 4
    assert wire._DECODER.decode(bytes(packed[4:])) == batch


def test_a_streams_frames_reach_its_router_over_the_direct_connection_and_its_end_after_them() -> None:
    async def run() -> tuple[list[str], dict[str, Any], bool]:
        server = _server_with_listener()
        await server.listener.start()
        handle = ServerHandle(server)
        feeds = Feeds(handle, "r")  # type: ignore[arg-type]
        stream = await _open_stream(feeds, server, "s1")
        stream.ids = "strip"
        outbox = server.outboxes["r"]
        got: list[str] = []
        for i in range(3):
            outbox.put("s1", f"data: {i}\n\n", [7] if i == 0 else None, [10 + i])
            got.append(await asyncio.wait_for(stream.__anext__(), 2))
        outbox.tasks.pop("s1").cancel()
        outbox.end("s1")
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(stream.__anext__(), 2)
        direct = not feeds.decode.unreachable and handle.calls[0].cancelled is False
        direct = direct and handle.calls[0].queue.empty()  # (the call's one item was the address)
        progress = {"prompt": stream.progress.prompt, "generated": stream.progress.generated}
        server.listener.close()
        feeds.readers["d1"].cancel()
        return got, progress, direct

    got, progress, direct = asyncio.run(run())
    assert got == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert progress == {"prompt": [7], "generated": [10, 11, 12]}  # the ids came beside the frames
    assert direct


def test_a_router_that_cannot_connect_gets_the_batches_as_the_calls_items(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "ACCEPT_S", 0.3)

    async def run() -> tuple[str, bool]:
        server = _server_with_listener()
        await server.listener.start()
        port = server.listener.port
        server.listener.port = _closed_port()  # (where the router is told to connect: nothing listens there)
        handle = ServerHandle(server)
        feeds = Feeds(handle, "r")  # type: ignore[arg-type]
        stream = await _open_stream(feeds, server, "s1")
        server.outboxes["r"].put("s1", "data: late\n\n")
        text = await asyncio.wait_for(stream.__anext__(), 5)
        server.listener.port = port
        server.listener.close()
        _cancel_streams(server)
        feeds.readers["d1"].cancel()
        return text, feeds.decode.unreachable

    text, unreachable = asyncio.run(run())
    assert text == "data: late\n\n"
    assert unreachable == {"d1"}  # (this router's next feeds from d1 ask for Serve items from the start)


def test_a_connection_without_a_ticket_the_replica_gave_is_closed() -> None:
    async def run() -> bytes:
        listener = wire.Listener("127.0.0.1")
        await listener.start()
        listener.expect()  # (a feed waits for its own ticket)
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(b"0" * 32)
        got = await asyncio.wait_for(reader.read(), 2)  # closed by the replica: EOF
        writer.close()
        listener.close()
        return got

    assert asyncio.run(run()) == b""


def test_a_router_that_drops_its_connection_ends_its_streams_on_decode() -> None:
    """The router left (its process died, or its reader stopped): decode cancels the streams nobody reads."""

    async def run() -> bool:
        server = _server_with_listener()
        await server.listener.start()
        rest, connection = await _direct_feed(server)
        batches = aiter(connection)
        outbox = server.outboxes["r"]
        task = outbox.tasks["s1"] = asyncio.ensure_future(asyncio.sleep(60))
        outbox.put("s1", "data: 1\n\n")
        assert (await asyncio.wait_for(anext(batches), 2))[0] == {"s1": "data: 1\n\n"}
        connection.writer.close()  # the router's end closes, with nothing more to send
        with pytest.raises(asyncio.CancelledError):  # (decode ends the feed as when its call is cancelled)
            await asyncio.wait_for(rest, 2)
        await asyncio.sleep(0)
        server.listener.close()
        return task.cancelled()

    assert asyncio.run(run())


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_router_that_connects_after_its_feed_stopped_waiting_gets_each_batch_once_as_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its ticket is refused (the replica sends the batches as the call's items by then): the router reads those,
    each once, and the feed ends as it should."""
    monkeypatch.setattr(wire, "ACCEPT_S", 0.05)
    connect = wire.connect

    async def late(address: Any, timeout: float | None = None) -> Any:
        await asyncio.sleep(0.3)
        return await connect(address, timeout)

    monkeypatch.setattr(wire, "connect", late)

    async def run() -> tuple[list[str], set[str]]:
        server = _server_with_listener()
        await server.listener.start()
        feeds = Feeds(ServerHandle(server), "r")  # type: ignore[arg-type]
        stream = await _open_stream(feeds, server, "s1")
        outbox = server.outboxes["r"]
        outbox.put("s1", "data: 1\n\n")
        outbox.put("s1", "data: 2\n\n")
        await asyncio.sleep(0.5)
        outbox.tasks.pop("s1").cancel()
        outbox.end("s1")
        got = [text async for text in stream]
        server.listener.close()
        feeds.readers["d1"].cancel()
        return got, feeds.decode.unreachable

    got, unreachable = asyncio.run(run())
    assert "".join(got) == "data: 1\n\ndata: 2\n\n"
    assert unreachable == {"d1"}


def test_a_feed_whose_call_fails_while_its_connection_stays_open_fails_at_once() -> None:
    """The replica is gone (Ray says so: the call fails) but no FIN came (its node is lost): the router does not
    wait on the silent connection; the feed fails, and its streams are resumed elsewhere."""

    async def run() -> float:
        listener = wire.Listener("127.0.0.1")
        await listener.start()
        address = listener.expect()
        gone = asyncio.Event()

        async def items() -> Any:
            yield address
            await gone.wait()
            raise RuntimeError("the actor died")

        class Handle:
            feed = Method(lambda **_: FakeStreamingCall(items()))

            def options(self, **_: Any) -> Any:
                return self

        from decode.client import DecodeClient

        feed = DecodeClient(Handle()).feed(consumer="r", replica="d1")  # type: ignore[arg-type]
        reading = asyncio.ensure_future(anext(feed))
        connection = await listener.accept(address["ticket"])  # (kept open, silent)
        await asyncio.sleep(0.1)
        started = asyncio.get_running_loop().time()
        gone.set()
        with pytest.raises(Exception) as failed:
            await asyncio.wait_for(reading, 2)
        assert not isinstance(failed.value, TimeoutError)
        elapsed = asyncio.get_running_loop().time() - started
        assert connection is not None
        connection.close()
        listener.close()
        return elapsed

    assert asyncio.run(run()) < 1


def test_a_feed_closed_before_its_router_connects_forgets_its_ticket() -> None:
    async def run() -> dict[str, Any]:
        server = _server_with_listener()
        await server.listener.start()
        feed = server.feed(consumer="r", replica="d1", direct=True)
        await feed.__anext__()
        await feed.aclose()  # (Serve cancelled the call at its first item)
        server.listener.close()
        return server.listener._waiting

    assert asyncio.run(run()) == {}


class _Pool:
    """The decode pool as the router's Serve request router sees it (core/placement.py POOLS)."""

    def __init__(self, stats: dict[str, int]) -> None:
        from types import SimpleNamespace

        self.curr_replicas = {
            rid: SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={"active_streams": n})
            for rid, n in stats.items()
        }


class StartingHandle(ServerHandle):
    """ServerHandle whose Serve `start` is counted (the direct path must not use it) and answered by the server."""

    def __init__(self, server: Any) -> None:
        super().__init__(server)
        self.serve_starts: list[dict[str, Any]] = []
        self.stops: list[dict[str, Any]] = []
        self.start = Method(self._start)
        self.stop = Method(self._stop)

    def _start(self, **kwargs: Any) -> Any:
        self.serve_starts.append(kwargs)
        return asyncio.ensure_future(self.server.start(**kwargs))

    def _stop(self, **kwargs: Any) -> Any:
        self.stops.append(kwargs)
        return asyncio.ensure_future(asyncio.sleep(0, {"tokens": 0}))


async def _connected(client: DecodeClient) -> None:
    """Until the router's feed connection to d1 takes calls."""
    for _ in range(200):
        if "d1" in client.connections:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the feed's connection never opened")


async def _direct_feed(server: Any) -> tuple[asyncio.Future[Any], wire.Feed]:
    """The replica's feed for router r, opened direct, and the router's connection to it: the feed's next step
    (pending while it serves the connection) and the connection."""
    feed = server.feed(consumer="r", replica="d1", direct=True)
    address = await feed.__anext__()
    rest = asyncio.ensure_future(feed.__anext__())
    connection = await wire.connect(address)
    assert connection is not None
    return rest, connection


def _cancel_streams(server: Any) -> None:
    for outbox in server.outboxes.values():
        for task in outbox.tasks.values():
            task.cancel()


def _starting_server(started: list[dict[str, Any]], gate: asyncio.Event | None = None) -> Any:
    """A decode server whose `start` records its arguments and starts a stream that runs until cancelled."""
    server = _server_with_listener()

    async def start(**kwargs: Any) -> dict[str, Any]:
        started.append(kwargs)
        if gate is not None:
            await gate.wait()
        outbox = server.outboxes.setdefault(kwargs["consumer"], Outbox())
        outbox.tasks[kwargs["stream_id"]] = asyncio.ensure_future(asyncio.sleep(60))
        server.routes[kwargs["stream_id"]] = outbox
        return {"replica": "d1"}

    server.start = start
    return server


def test_a_start_goes_over_its_replicas_open_feed_connection_not_through_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a feed's connection is open, the router places a new stream itself and starts it over that connection:
    the replica takes it as the feed's router's (whatever `consumer` says) and replies among the batches."""
    from core import placement

    monkeypatch.setitem(placement.POOLS, "decode", _Pool({"d1": 0}))

    async def run() -> tuple[list[str], list[dict[str, Any]], int]:
        started: list[dict[str, Any]] = []
        server = _starting_server(started)
        await server.listener.start()
        handle = StartingHandle(server)
        feeds = Feeds(handle, "r")  # type: ignore[arg-type]
        first = await feeds.open("chat", {"stream": True})  # (no connection yet: through Serve, which opens the feed)
        assert isinstance(first, DecodeStream)
        await _connected(feeds.decode)
        second = await asyncio.wait_for(feeds.open("chat", {"stream": True}), 2)
        assert isinstance(second, DecodeStream) and second.replica == "d1"
        server.outboxes["r"].put(second.stream_id, "data: 2\n\n")
        text = await asyncio.wait_for(second.__anext__(), 2)
        server.listener.close()
        _cancel_streams(server)
        feeds.readers["d1"].cancel()
        return [text], started, len(handle.serve_starts)

    texts, started, serve_starts = asyncio.run(run())
    assert texts == ["data: 2\n\n"]
    assert serve_starts == 1  # only the first: the second went over the connection
    assert [s["consumer"] for s in started] == ["r", "r"]
    assert started[1]["body"] == {"stream": True, "return_token_ids": True}


def test_a_start_whose_connection_closes_before_its_reply_goes_again_under_a_new_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica's end of the connection closed with a start in flight (the replica is gone, or its feed ended):
    the router cannot know whether it started, so it starts the request again under a new stream id (frames of
    the old one never reach it), through Serve as no connection is open."""
    from core import placement

    monkeypatch.setitem(placement.POOLS, "decode", _Pool({"d1": 0}))

    async def run() -> tuple[str, str, int, int]:
        started: list[dict[str, Any]] = []
        gate = asyncio.Event()
        server = _starting_server(started, gate)
        await server.listener.start()
        handle = StartingHandle(server)
        feeds = Feeds(handle, "r")  # type: ignore[arg-type]
        gate.set()
        first = await feeds.open("chat", {"stream": True})
        assert isinstance(first, DecodeStream)
        await _connected(feeds.decode)
        gate.clear()
        stream = DecodeStream(feeds, "s-old", "chat", {"stream": True, "kv_transfer_params": {"remote_host": "p"}})
        starting = asyncio.ensure_future(feeds._start(stream, "chat", stream.body))
        for _ in range(100):
            if len(started) == 2:
                break
            await asyncio.sleep(0.01)
        feeds.decode.connections["d1"].abort()  # (the connection is cut with the start unanswered)
        gate.set()
        reply = await asyncio.wait_for(starting, 2)
        server.listener.close()
        _cancel_streams(server)
        for reader in feeds.readers.values():
            reader.cancel()
        await asyncio.sleep(0.05)  # (the old id's stop is detached)
        assert "kv_transfer_params" in started[1]["body"]
        assert "kv_transfer_params" not in started[2]["body"]  # (the lost start may have read the KV already)
        assert {"stream_id": "s-old", "replica": "d1"}.items() <= handle.stops[0].items()  # (it may run there)
        return reply["replica"], stream.stream_id, len(started), len(handle.serve_starts)

    replica, stream_id, starts, serve_starts = asyncio.run(run())
    assert replica == "d1"
    assert stream_id != "s-old"  # (a new id: the old one may run on the replica)
    assert starts == 3 and serve_starts == 2  # the first open, the lost start, then again through Serve


def test_a_feed_with_a_start_in_flight_does_not_end_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle feed ends after FEED_IDLE_S, but not while a start it took is unanswered: the reply would be lost,
    and the stream with it."""
    import decode.server

    monkeypatch.setattr(decode.server, "FEED_IDLE_S", 0.05)

    async def run() -> dict[str, Any]:
        started: list[dict[str, Any]] = []
        gate = asyncio.Event()
        server = _starting_server(started, gate)
        await server.listener.start()
        rest, connection = await _direct_feed(server)
        batches = asyncio.ensure_future(anext(aiter(connection)))  # (reads replies, as the router's reader does)
        reply = connection.call("start", {"stream_id": "s1", "endpoint": "chat", "body": {}})
        await asyncio.sleep(0.3)  # six idle periods with the start in flight
        assert not rest.done()
        gate.set()
        got = await asyncio.wait_for(reply, 2)
        server.outboxes["r"].tasks["s1"].cancel()
        server.listener.close()
        rest.cancel()
        batches.cancel()
        return got

    assert asyncio.run(run()) == {"replica": "d1"}


@pytest.mark.parametrize("odd", [object(), 2**70], ids=["an object", "an int past 64 bits"])
def test_what_msgpack_cannot_carry_starts_through_serve(odd: Any) -> None:
    async def run() -> tuple[bool, int]:
        server = _starting_server([])
        await server.listener.start()
        handle = StartingHandle(server)
        client = DecodeClient(handle)  # type: ignore[arg-type]
        feed = client.feed(consumer="r", replica="d1")
        reading = asyncio.ensure_future(anext(feed))
        await _connected(client)
        body = {"stream": True, "odd": odd}
        reply = await client.start(consumer="r", stream_id="s1", endpoint="chat", body=body, ids=None, via="d1")
        _cancel_streams(server)
        reading.cancel()
        server.listener.close()
        return reply == {"replica": "d1"}, len(handle.serve_starts)

    assert asyncio.run(run()) == (True, 1)


def test_a_replica_that_answers_no_calls_gets_its_starts_through_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode replica of an older version (a rolling upgrade) reads nothing on its connection: its address names
    no calls, and the router never sends it one (it would wait for a reply that never comes)."""
    from core import placement

    monkeypatch.setitem(placement.POOLS, "decode", _Pool({"d1": 0}))
    expect = wire.Listener.expect

    def older(self: wire.Listener) -> wire.Address:
        address = expect(self)
        del address["calls"]
        return address

    monkeypatch.setattr(wire.Listener, "expect", older)

    async def run() -> tuple[bool, int]:
        server = _starting_server([])
        await server.listener.start()
        handle = StartingHandle(server)
        feeds = Feeds(handle, "r")  # type: ignore[arg-type]
        await feeds.open("chat", {"stream": True})
        for _ in range(200):  # (until the replica took the feed's connection)
            if handle.calls and not server.listener._waiting:
                break
            await asyncio.sleep(0.01)
        assert not server.listener._waiting and not feeds.decode.unreachable
        await asyncio.sleep(0.05)
        second = await asyncio.wait_for(feeds.open("chat", {"stream": True}), 2)
        server.listener.close()
        _cancel_streams(server)
        feeds.readers["d1"].cancel()
        return isinstance(second, DecodeStream), len(handle.serve_starts)

    assert asyncio.run(run()) == (True, 2)
