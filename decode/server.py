"""Decode replica: pulls a prompt's KV from the prefill replica over NIXL and streams the answer.

A streaming answer's frames reach the router that asked for it through that router's feed (decode/feed.py):
one long-lived stream per router replica carrying every one of its requests' frames, each item everything
ready at that moment. Non-streaming requests are answered by `start` itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from decode.feed import Batch, Outbox
from serve_app.autoscaling import ACTIVE_STREAMS
from serve_app.config import AppConfig
from serve_app.engine import Endpoint, Engine
from serve_app.protocol import error_body, error_payload

logger = logging.getLogger(__name__)
UNCLAIMED_OUTBOX_S = 30.0  # a router that started requests but never opened its feed (it died) loses them
FEED_IDLE_S = 5.0  # a feed with no stream ends after this (so that a draining replica can stop)


@serve.deployment(name="decode", max_ongoing_requests=1024, health_check_period_s=10)
class DecodeServer:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        self.config = AppConfig.model_validate(app_config)
        self.engine = Engine(self.config, "decode")
        await self.engine.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.outboxes: dict[str, Outbox] = {}
        self._reaper = asyncio.create_task(self._reap())

    async def start(self, *, consumer: str, stream_id: str, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
        """Start one OpenAI request (its `kv_transfer_params` point at a prefill replica's KV, or it has none
        and this engine prefills it). A stream's frames go to `consumer`'s feed: `{"replica": <this one>}`.
        Otherwise the answer itself: `{"response": ...}`, or `{"error": ...}`."""
        result = await self.engine.openai(endpoint, body)
        if hasattr(result, "error") and not hasattr(result, "__aiter__"):
            return error_payload(result)
        if not hasattr(result, "__aiter__"):
            return {"response": result.model_dump(mode="json")}
        outbox = self.outboxes.setdefault(consumer, Outbox())
        outbox.tasks[stream_id] = asyncio.create_task(self._pump(result, outbox, stream_id))
        return {"replica": self.replica}

    async def _pump(self, stream: AsyncGenerator[str, None], outbox: Outbox, stream_id: str) -> None:
        error: dict[str, Any] | None = None
        try:
            async for text in stream:
                outbox.put(stream_id, text)
        except asyncio.CancelledError:  # stopped: the client left, or its router did
            error = error_body(499, "stopped")["error"]
        except Exception as e:
            logger.exception("decode stream %s failed", stream_id)
            error = error_body(500, f"decode failed mid-stream: {e}")["error"]
        finally:
            try:
                await stream.aclose()  # closing vLLM's generator aborts the engine request
            finally:
                outbox.end(stream_id, error)  # whatever happens, the router learns the stream ended

    async def feed(self, *, consumer: str, replica: str) -> AsyncGenerator[Batch, None]:
        """`consumer`'s frames from every one of its streams on this replica, for as long as it listens and
        has streams here (an idle feed ends after FEED_IDLE_S; the router opens a new one when it needs it)."""
        if replica != self.replica:  # routed elsewhere: the replica it wants is gone
            raise RuntimeError(f"decode replica {replica} is gone")
        outbox = self.outboxes.setdefault(consumer, Outbox())
        token = outbox.owner = object()
        idle_end = False
        try:
            while outbox.owner is token:
                try:
                    batch = await asyncio.wait_for(outbox.take(), FEED_IDLE_S)
                except TimeoutError:
                    if outbox.idle:
                        idle_end = True
                        return
                    continue
                if outbox.owner is not token:  # a newer feed of this router took over: it delivers this
                    outbox.restore(batch)
                    return
                yield batch
        finally:
            if outbox.owner is token:
                outbox.owner = None
                if not idle_end:  # the router stopped listening (it left or died): nobody reads these streams
                    outbox.cancel_all()
                if self.outboxes.get(consumer) is outbox and (outbox.idle or not idle_end):
                    del self.outboxes[consumer]

    async def stop(self, *, consumer: str, stream_id: str, replica: str | None = None) -> None:
        """The client left: abort its request."""
        outbox = self.outboxes.get(consumer)
        if outbox is not None and (task := outbox.tasks.get(stream_id)) is not None:
            task.cancel()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(5)
            now = time.monotonic()
            for consumer, outbox in list(self.outboxes.items()):
                if not outbox.attached and now - outbox.drained_at > UNCLAIMED_OUTBOX_S:
                    logger.warning("router %s never read its %d streams: aborting them", consumer, len(outbox.tasks))
                    outbox.cancel_all()
                    del self.outboxes[consumer]

    def _active_streams(self) -> int:
        return sum(len(o.tasks) for o in self.outboxes.values())

    def record_routing_stats(self) -> dict[str, Any]:
        """Streams running here: the request router spreads new requests by it (router/placement.py)."""
        return {ACTIVE_STREAMS: self._active_streams()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Streams are the load (Serve sees only the short calls that start them, and the feeds):
        serve_app/autoscaling.py `stream_aware_policy`."""
        return {ACTIVE_STREAMS: float(self._active_streams())}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        return await self.engine.compute_stats(request_id_prefix)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        if (engine := getattr(self, "engine", None)) is not None:
            engine.shutdown()
