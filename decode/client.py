"""The decode role's client: what a router, and a prefill replica starting a preemptive answer, call on decode
replicas (decode/server.py), with typed arguments.

Calls go by value over gRPC, each method's Serve handle made once (core/handles.py). A `replica` argument pins a
call to that replica (router/placement.py); `avoid` and `prefer` steer a new stream away from or towards one. A
feed's batches come over a connection of their own (decode/wire.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypedDict, cast

from ray.serve.handle import DeploymentHandle

from core.handles import MethodHandles
from core.protocol import Endpoint
from decode import wire
from decode.feed import Batch, TokenIds

__all__ = ["Batch", "DecodeClient", "Started", "Stopped", "TokenIds"]
logger = logging.getLogger(__name__)
FEED_END_S = 10.0  # a feed's call ends within this once its connection closed (decode/wire.py), or it failed


class Started(TypedDict, total=False):
    """`start`, `adopt`: the stream's replica (its frames come on the caller's feed), or the whole answer (a request
    that does not stream), or an error (naming `replica` when that replica's engine failed: another may take it)."""

    replica: str
    response: dict[str, Any]
    error: dict[str, Any]


class Stopped(TypedDict, total=False):
    """`stop`: the tokens the stream had made (what a preemptive answer cost), or an error."""

    tokens: int
    error: dict[str, Any]


class DecodeClient:
    """Each call returns what its handle returns (awaitable); `feed` an async iterator of batches."""

    def __init__(self, handle: DeploymentHandle, direct: bool = True) -> None:
        self._method = MethodHandles(handle)
        self.direct = direct  # feeds' batches over their own connection (decode/wire.py), not the call's items
        self.unreachable: set[str] = set()  # replicas this router could not connect to: their feeds go via Serve
        self.connections: dict[str, wire.Feed] = {}  # replica -> its feed's connection, while it is read

    def start(
        self,
        *,
        consumer: str,
        stream_id: str,
        endpoint: Endpoint,
        body: dict[str, Any],
        ids: str | None,
        avoid: list[str] | None = None,
        prefer: str | None = None,
        park_tokens: int | None = None,
        hold_tokens: int | None = None,
        preemptive: bool = False,
        via: str | None = None,
    ) -> Awaitable[Started]:
        """`{"replica": ...}` (its frames come on `consumer`'s feed), `{"response": ...}` or `{"error": ...}`.
        `preemptive` (a prefill replica's preemptive answer, parked under `consumer`): it stops at `park_tokens`,
        or is held at `hold_tokens` until confirmed (decode/server.py `start`). `via`: on that replica, over its
        feed's connection if one is open (decode/wire.py; it fails with ConnectionError if the connection ends
        first), else through Serve, which places it."""
        kwargs = {
            "stream_id": stream_id,
            "endpoint": endpoint,
            "body": body,
            "ids": ids,
            "avoid": avoid,
            "prefer": prefer,
            "park_tokens": park_tokens,
            "hold_tokens": hold_tokens,
            "preemptive": preemptive,
        }
        if via is not None and (connection := self.connections.get(via)) is not None and connection.usable:
            with contextlib.suppress(TypeError):  # (what msgpack cannot carry goes through Serve)
                return cast(Awaitable[Started], connection.call("start", kwargs))
        return self._method("start").remote(consumer=consumer, **kwargs)

    def release(self, *, request_id: str, kv_transfer_params: dict[str, Any]) -> Awaitable[dict[str, Any]]:
        """Free the KV a prefill replica holds for a hand-off nobody will read (through any decode replica)."""
        return self._method("release").remote(request_id=request_id, kv_transfer_params=kv_transfer_params)

    def adopt(
        self, *, consumer: str, stream_id: str, parked: str, request_id: str, replica: str, tentative: bool
    ) -> Awaitable[Started]:
        """Take over a preemptive answer's stream parked under `parked`: `{"replica": ...}` or a 404 error."""
        return self._method("adopt").remote(
            consumer=consumer,
            stream_id=stream_id,
            parked=parked,
            request_id=request_id,
            replica=replica,
            tentative=tentative,
        )

    def confirm(self, *, stream_id: str, request_id: str, replica: str | None) -> Awaitable[None]:
        """A held preemptive answer is the answer: its cap is lifted, its rank an ordinary answer's."""
        return self._method("confirm").remote(stream_id=stream_id, request_id=request_id, replica=replica)

    def stop(self, *, consumer: str, stream_id: str, replica: str | None) -> Awaitable[Stopped]:
        """Abort a stream (the client left): `{"tokens": n}`, what a preemptive answer had made."""
        return self._method("stop").remote(consumer=consumer, stream_id=stream_id, replica=replica)

    async def feed(self, *, consumer: str, replica: str) -> AsyncGenerator[Batch, None]:
        """Every frame of `consumer`'s streams on `replica`, one batch per engine step (decode/feed.py): over the
        feed's own connection when the replica gives one (decode/wire.py), else as the call's items. Ends when the
        call ends; raises what it raises. A replica this router cannot connect to gets asked for items from then on."""
        direct = self.direct and replica not in self.unreachable
        more = {"direct": True} if direct else {}  # (not sent otherwise: a replica older than it takes the call)
        call = self._method("feed", stream=True).remote(consumer=consumer, replica=replica, **more)
        items, ended = aiter(call), False
        end: asyncio.Future[Any] | None = None  # the call's next item, awaited while the batches come directly
        try:
            while True:
                try:
                    if end is None:
                        item = await anext(items)
                    else:  # (the connection closed: the call says how the feed ended)
                        item, end = await asyncio.wait_for(end, FEED_END_S), None
                except StopAsyncIteration:
                    ended = True
                    return
                if not wire.is_address(item):
                    yield item
                    continue
                try:
                    connection = await wire.connect(item)
                except (OSError, TimeoutError) as e:
                    connection, why = None, str(e) or type(e).__name__
                else:
                    why = "it stopped waiting"
                if connection is None:  # (the replica sends the batches as the call's items instead)
                    logger.warning("no connection to decode replica %s (%s): its feed goes via Serve", replica, why)
                    self.unreachable.add(replica)
                    continue
                end = asyncio.ensure_future(anext(items))  # (the replica's generator goes on meanwhile)
                # The call failing (the replica is gone) cuts the connection: a read never outlives its replica.
                end.add_done_callback(functools.partial(_cut_if_failed, connection))
                if "start" in item.get("calls", ()):  # (an older replica reads no calls)
                    self.connections[replica] = connection
                try:
                    async with contextlib.aclosing(aiter(connection)) as batches:
                        async for batch in batches:
                            yield batch
                finally:
                    if self.connections.get(replica) is connection:
                        del self.connections[replica]
        finally:
            if not ended:
                if end is not None:
                    end.cancel()
                call.cancel()  # (its reader stopped, or the connection broke: decode ends the feed's streams)

    def check_health(self) -> Awaitable[None]:
        return self._method("check_health").remote()


def _cut_if_failed(connection: wire.Feed, end: asyncio.Future[Any]) -> None:
    """A feed's call ended while its connection is read: if it failed (not its end: StopAsyncIteration), the replica
    is gone, and so is what the connection would still carry."""
    if not end.cancelled() and not isinstance(end.exception(), StopAsyncIteration | type(None)):
        connection.abort()
