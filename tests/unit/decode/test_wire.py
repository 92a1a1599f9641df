"""decode/wire.py: a feed's batches over the router's own TCP connection to the decode replica, on real sockets, with
the decode replica's feed logic (decode/server.py `feed`) and the router's reader (router/streams/feeds.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from decode import wire
from router.streams.feeds import DecodeStream, Feeds
from tests.unit.router.test_feeds import FakeStreamingCall, _decode_server


def _server_with_listener() -> Any:
    server = _decode_server()
    server.listener = wire.Listener("127.0.0.1")
    return server


class ServerHandle:
    """A decode handle whose `feed` runs the decode replica's own feed generator (and `start` starts nothing)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.calls: list[FakeStreamingCall] = []

    def options(self, **_: Any) -> ServerHandle:
        return self

    @property
    def feed(self) -> Any:
        outer = self

        class Method:
            def remote(self, **kwargs: Any) -> FakeStreamingCall:
                outer.calls.append(FakeStreamingCall(outer.server.feed(**kwargs)))
                return outer.calls[-1]

        return Method()


async def _open_stream(feeds: Feeds, server: Any, stream_id: str) -> DecodeStream:
    """A stream as `Feeds.open` leaves it once decode started it on replica d1 (whose task runs until ended)."""
    stream = DecodeStream(feeds, stream_id)
    stream.replica = "d1"
    feeds.streams[stream_id] = stream
    outbox = server.outboxes.setdefault("r", __import__("decode.feed", fromlist=["Outbox"]).Outbox())
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
        direct = feeds.decode.direct and handle.calls[0].cancelled is False
        progress = {"prompt": stream.progress.prompt, "generated": stream.progress.generated}
        server.listener.close()
        feeds.readers["d1"].cancel()
        return got, progress, direct

    got, progress, direct = asyncio.run(run())
    assert got == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert progress == {"prompt": [7], "generated": [10, 11, 12]}  # the ids came beside the frames
    assert direct


def test_a_router_that_cannot_connect_gets_the_batches_as_the_calls_items(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "CONNECT_S", 0.3)

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
        for task in server.outboxes["r"].tasks.values():
            task.cancel()
        feeds.readers["d1"].cancel()
        return text, feeds.decode.direct

    text, direct = asyncio.run(run())
    assert text == "data: late\n\n"
    assert direct is False  # (this router's next feeds ask for Serve items from the start)


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
        feed = server.feed(consumer="r", replica="d1", direct=True)
        address = await feed.__anext__()
        rest = asyncio.ensure_future(feed.__anext__())
        connection = await wire.connect(address)
        outbox = server.outboxes["r"]
        task = outbox.tasks["s1"] = asyncio.ensure_future(asyncio.sleep(60))
        outbox.put("s1", "data: 1\n\n")
        assert (await asyncio.wait_for(connection.__anext__(), 2))[0] == {"s1": "data: 1\n\n"}
        await connection.aclose()  # the router's end closes, with nothing more to send
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
