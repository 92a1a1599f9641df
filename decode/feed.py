"""One stream per (router replica, decode replica) carrying the frames of every request between them.

Each item that crosses a Ray hop has a fixed cost, and with one stream per request that cost is paid per
token per request: at 128 streams it, not the engine, set the app's token rate. A feed carries, in one item,
everything every one of a router's requests on this replica produced since the last item, so the hop costs one
item per engine step whatever the number of streams. Never waits to batch: an item leaves as soon as the router
asks for the next one and anything is ready.

    router                                  decode replica
      start(stream_id, request) ─────────►  engine request; frames go to the router's outbox
      feed(consumer, replica) ◄── {stream_id: frames}, {stream_id: None | error} ── outbox, per item
      stop(stream_id)  ─────────►  abort (the client left)

A feed with no stream left ends after a few idle seconds (the router opens a new one with its next request):
a permanent call would keep a draining replica from ever stopping. A feed that attaches while an older one of
the same router is still attached takes the outbox over; the older one puts back what it took and leaves.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

Batch = tuple[dict[str, str], dict[str, dict[str, Any] | None]]  # (frames by stream, ended streams: None or error)


class Outbox:
    """What one router's streams produced and it has not yet taken."""

    def __init__(self) -> None:
        self.frames: dict[str, list[str]] = {}
        self.ended: dict[str, dict[str, Any] | None] = {}
        self.ready = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}  # stream id -> the task pumping its engine output
        self.drained_at = time.monotonic()  # when the router last took an item (an abandoned outbox is reaped)
        self.owner: object | None = None  # the feed reading it (a newer feed of the same router takes it over)

    @property
    def attached(self) -> bool:
        return self.owner is not None

    @property
    def idle(self) -> bool:
        return not (self.tasks or self.frames or self.ended)

    def put(self, stream_id: str, text: str) -> None:
        self.frames.setdefault(stream_id, []).append(text)
        self.ready.set()

    def end(self, stream_id: str, error: dict[str, Any] | None = None) -> None:
        self.ended[stream_id] = error
        self.tasks.pop(stream_id, None)
        self.ready.set()

    async def take(self) -> Batch:
        """Everything ready now (waits until something is)."""
        while not (self.frames or self.ended):  # (another reader may have woken first and taken it)
            await self.ready.wait()
            self.ready.clear()
        self.ready.clear()
        frames = {sid: "".join(parts) for sid, parts in self.frames.items()}
        ended, self.frames, self.ended = self.ended, {}, {}
        self.drained_at = time.monotonic()
        return frames, ended

    def restore(self, batch: Batch) -> None:
        """Put back a batch its reader could not deliver (it was taken over), ahead of anything newer."""
        frames, ended = batch
        for stream_id, text in frames.items():
            self.frames[stream_id] = [text, *self.frames.get(stream_id, [])]
        self.ended = {**ended, **self.ended}
        if frames or ended:
            self.ready.set()

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
