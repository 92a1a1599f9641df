"""A feed's batches (decode/feed.py) over a TCP connection from the router, not as items of its Serve call.

Each item of a Serve streaming call costs both processes Serve's per-item machinery: cloudpickle, gRPC's stream
write and read, the handle's response generator. At one stream a feed item is one token, and that machinery was
most of what the router and the decode replica spent per token (bench/results/token_path_direct_feed.md). So the
Serve call keeps what it is good at, and carries no batch:
- it places the feed on its replica, a draining replica waits for it, a dead replica fails it, and a router that
  leaves cancels it (decode/server.py `feed`);
- its one item is where to connect and a one-time ticket.

The batches go over a connection the router opens with that ticket, each a 4-byte length and a msgpack body. NVIDIA
Dynamo streams responses the same way: the request through its request plane, the answer over a TCP stream back to
the frontend.

    router                                      decode replica
      feed(consumer, replica, direct=True) ───►  Address {host, port, ticket}: the call's one item
      connect(host, port), the ticket ────────►  handed to the feed waiting for it
      ◄──── [length][Batch] ... ───────────────  every batch, then closed when the feed ends
      [length][Call] ─────────────────────────►  a `start` of this router's (no Serve call per request)
      ◄──── [length][Reply] ───────────────────  what `start` returned, among the batches
      the call ends: how the feed ended (normally, or its error)

A request's `start` then goes over its replica's open connection too: a Serve call per request (Serve's routing,
pickling, gRPC and its request handling on both ends) cost the router and the decode replica 0.3-2.4 ms more per
1-token answer in three A/B runs, 3.5-4.8 ms against 2.5-3.8 (bench/results/token_path_direct_start*.md). The
router places it itself, by the decode pool's policy (router/placement.py); with no open connection to that
replica it goes through Serve.

A router that cannot connect within CONNECT_S (a network policy between pods) gets the batches as the call's items,
as before; so does one that does not ask (`decode.feed: serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import AsyncGenerator, Callable
from typing import Any, NotRequired, TypedDict

import msgspec

from core.protocol import error_body
from decode.feed import Batch

logger = logging.getLogger(__name__)
CONNECT_S = 2.0  # a router connects and is accepted within this, or asks for the batches as the call's items
ACCEPT_S = 5.0  # a feed waits this long for its router (longer: a router still trying is never refused)
_TICKET_BYTES = 32  # (hex of 16 random bytes)
_HEADER = 4
_ACCEPTED = b"\x01"  # the replica's answer to a ticket it was waiting for (EOF instead: refused)
# A peer gone without a word (its node lost) is noticed in ~25 s, not TCP's ~15 min of retransmits.
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}
_ENCODER = msgspec.msgpack.Encoder()
# What the router reads: a batch (an array), or a call's reply (a map: `Reply`).
_DECODER = msgspec.msgpack.Decoder(
    tuple[dict[str, str], dict[str, dict[str, Any] | None], dict[str, tuple[list[int] | None, list[int]]]]
    | dict[str, Any]
)
_CALL_DECODER = msgspec.msgpack.Decoder(dict[str, Any])  # what the replica reads: `Call`s
CALLS = frozenset({"start"})  # the methods a router calls over its feed's connection


class Address(TypedDict):
    """Where a feed's batches come from: the Serve call's one item when it goes direct; `calls`, the methods the
    replica answers over the connection (a replica of an older version answers none: its router starts through
    Serve)."""

    host: str
    port: int
    ticket: str
    calls: NotRequired[list[str]]


class Call(TypedDict):
    """A router's call on its feed's connection: `method` (one of CALLS) with `kwargs`, answered by a Reply."""

    call: int
    method: str
    kwargs: dict[str, Any]


class Reply(TypedDict):
    """The replica's answer to the router's Call numbered `call`: what the method returned."""

    call: int
    reply: dict[str, Any]


_UNENCODABLE = (TypeError, OverflowError, msgspec.EncodeError)  # (an object, or an int past 64 bits)


def is_address(item: Any) -> bool:
    return isinstance(item, dict) and "ticket" in item


def direct_allowed() -> bool:
    """Ray's TLS (`RAY_USE_TLS`) encrypts its own traffic, Serve calls included; this connection is plain TCP, so
    with TLS on the batches stay the call's items."""
    return os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true")


def _keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE.items():
            if hasattr(socket, name):  # (Linux)
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def pack(message: Batch | Call | Reply) -> bytearray:
    """A message as it goes on the wire: its length, then msgpack (encoded in place behind the header). Raises
    TypeError for what msgpack cannot carry."""
    buffer = bytearray(_HEADER)
    _ENCODER.encode_into(message, buffer, _HEADER)
    buffer[:_HEADER] = (len(buffer) - _HEADER).to_bytes(_HEADER, "big")
    return buffer


class Connection:
    """A router's connection, as the feed that writes to it sees it. After its ticket the router sends only calls
    (`answer_calls` takes each); the end of what it sends is its end of the connection closing: `on_lost` is called
    then (the router left)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.on_lost: Callable[[], Any] | None = None
        self._on_call: Callable[[Call], Any] | None = None
        self._early: list[Call] = []  # calls read before a feed took the connection (it answers them then)
        self.calls = 0  # calls taken and not yet answered (the feed does not end idle meanwhile)
        self.taken = False  # (a feed took it: `Listener.forget` leaves it alone)
        self._watch = asyncio.ensure_future(self._read_calls(reader))

    def answer_calls(self, handler: Callable[[Call], Any]) -> None:
        """`handler` takes every call the router sends, from now on and any that came before."""
        self._on_call = handler
        early, self._early = self._early, []
        for call in early:
            handler(call)

    async def _read_calls(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(Exception):  # (a broken connection, or garbage: the router's end is lost)
            while True:
                header = await reader.readexactly(_HEADER)
                call = _CALL_DECODER.decode(await reader.readexactly(int.from_bytes(header, "big")))
                if call.get("method") not in CALLS or not isinstance(call.get("call"), int):
                    break  # (not a call this side answers: nobody sends that)
                self.calls += 1
                if self._on_call is None:
                    self._early.append(call)  # type: ignore[arg-type]
                else:
                    self._on_call(call)  # type: ignore[arg-type]
        if self.on_lost is not None:
            self.on_lost()

    def reply(self, call: int, reply: dict[str, Any]) -> bool:
        """Answer a call (among the batches: the router's reader resolves it). False: the router is gone, and with
        it the answer."""
        self.calls -= 1
        if self.writer.is_closing():
            return False
        try:
            message = pack(Reply(call=call, reply=reply))
        except _UNENCODABLE as e:  # (the router must not wait for an answer that never comes)
            logger.error("a reply msgpack cannot carry (%s): answering with an error", e)
            message = pack(Reply(call=call, reply=error_body(500, f"unencodable reply: {e}")))
        self.writer.write(message)
        return True

    async def send(self, batch: Batch) -> None:
        """Raises ConnectionError once the router is gone (its end closed the connection)."""
        if self.writer.is_closing():
            raise ConnectionResetError("the router closed the feed's connection")
        self.writer.write(pack(batch))
        await self.writer.drain()  # (returns at once unless the router lags: then the outbox gathers the steps)

    def close(self) -> None:
        self.on_lost = None  # (closed here: nobody left)
        self._watch.cancel()
        self.writer.close()


class Listener:
    """A decode replica's port for its feeds' connections: one connection per feed, matched by its ticket."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self._server: asyncio.Server | None = None
        self._waiting: dict[str, asyncio.Future[Connection]] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connected, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def expect(self) -> Address:
        """A ticket for one connection, and where to bring it."""
        ticket = secrets.token_hex(_TICKET_BYTES // 2)
        self._waiting[ticket] = asyncio.get_running_loop().create_future()
        return Address(host=self.host, port=self.port, ticket=ticket, calls=sorted(CALLS))

    async def accept(self, ticket: str, timeout: float | None = None) -> Connection | None:
        """The connection that brought `ticket`, or None if none came within `timeout` (ACCEPT_S)."""
        waiting = self._waiting[ticket]
        try:
            done, _ = await asyncio.wait({waiting}, timeout=ACCEPT_S if timeout is None else timeout)
            if not done:
                return None
            connection = waiting.result()
            connection.taken = True
            return connection  # (a cancel while waiting raises in `wait`, and is not lost)
        finally:
            self.forget(ticket)

    def forget(self, ticket: str) -> None:
        """No feed waits for `ticket` any more; a connection it brought that nobody took is closed."""
        waiting = self._waiting.pop(ticket, None)
        if waiting is None:
            return
        if not waiting.done():
            waiting.cancel()
        elif not waiting.result().taken:
            waiting.result().close()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ticket = (await asyncio.wait_for(reader.readexactly(_TICKET_BYTES), CONNECT_S)).decode("ascii", "replace")
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        waiting = self._waiting.get(ticket)
        if waiting is None or waiting.done():  # (no feed expects it: late, stale or forged; the router falls back)
            logger.debug("a feed connection from %s: no feed waits for its ticket", writer.get_extra_info("peername"))
            writer.close()
            return
        _keepalive(writer)
        writer.write(_ACCEPTED)
        waiting.set_result(Connection(reader, writer))

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


class Feed:
    """The router's side of one feed's connection: async-iterate its batches until the replica closes it; `call` a
    method of the replica over it while it is read."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next = 0
        self.open = True  # (until its reader ends: a call after that fails at once)

    def abort(self) -> None:
        """Cut the connection (its call failed: the replica is gone); a read in progress ends at once."""
        self.writer.transport.abort()

    @property
    def usable(self) -> bool:
        """Still read and not closing (a cut connection stays registered until its reader notices)."""
        return self.open and not self.writer.is_closing()

    def call(self, method: str, kwargs: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """The replica's reply to `method(**kwargs)`, read among the batches; fails with ConnectionError if the
        connection ends first (the replica may have taken the call or not: the caller treats it as a lost call).
        Raises TypeError at once for arguments msgpack cannot carry (the caller sends them through Serve)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if not self.usable:
            future.set_exception(ConnectionResetError("the feed's connection closed"))
            return future
        try:
            message = pack(Call(call=self._next, method=method, kwargs=kwargs))
        except _UNENCODABLE as e:
            raise TypeError(f"msgpack cannot carry the call's arguments: {e}") from e
        self._calls[self._next] = future
        self._next += 1
        self.writer.write(message)
        return future

    async def __aiter__(self) -> AsyncGenerator[Batch, None]:
        try:
            while True:
                try:
                    header = await self.reader.readexactly(_HEADER)
                except asyncio.IncompleteReadError as e:
                    if e.partial:
                        raise
                    return  # closed between batches: the feed ended (its call says how)
                message = _DECODER.decode(await self.reader.readexactly(int.from_bytes(header, "big")))
                if isinstance(message, dict):  # a call's reply
                    future = self._calls.pop(message.get("call"), None)
                    if future is not None and not future.done():
                        future.set_result(message.get("reply") or {})
                    continue
                yield message
        finally:
            self.open = False
            self.writer.close()
            calls, self._calls = self._calls, {}
            for future in calls.values():
                if not future.done():
                    future.set_exception(ConnectionResetError("the feed's connection closed before the reply"))


async def connect(address: Address, timeout: float | None = None) -> Feed | None:
    """A connection to `address`, accepted by its replica; None if the replica refused the ticket (its feed stopped
    waiting: it sends the batches as items). Raises OSError or TimeoutError if it cannot connect within `timeout`
    (CONNECT_S)."""
    timeout = CONNECT_S if timeout is None else timeout
    reader, writer = await asyncio.wait_for(asyncio.open_connection(address["host"], address["port"]), timeout)
    try:
        _keepalive(writer)
        writer.write(address["ticket"].encode("ascii"))
        accepted = await asyncio.wait_for(reader.read(len(_ACCEPTED)), timeout)
    except BaseException:
        writer.close()
        raise
    if accepted != _ACCEPTED:
        writer.close()
        return None
    return Feed(reader, writer)
