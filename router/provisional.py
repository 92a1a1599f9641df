"""A streaming reader's hold on its session's preemptive answer while the turn may still go on.

A reader that waits for a session's answer (`/events`, an NDJSON request's response) learns from the owner
which preemptive answer decode is making for the turn (prefill/preemptive.py) and adopts its stream
*tentatively*: decode sends its frames to this router from then on, but keeps its cap and its low rank until
the owner confirms the turn. When the turn ends unchanged, the claim names that stream and its frames are
already here: the first token leaves with the claim's reply, with no call to decode in between. When the input
changes, the owner stops it on decode and this hold lets it go.

Provisional text (the session's `preemptive.stream`): while held, the stream's text goes to `sink` as it arrives,
marked with its attempt, then whether it was confirmed or discarded; the surface turns these into events of its
own (router/sessions.py: named SSE events; router/realtime.py: `rtpd.response.provisional.*`). Only text is
provisional: a tool call reaches the client only in the confirmed answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from router.feeds import DecodeStream, Feeds
from serve_app.protocol import choice_text, parse_sse

# (kind, fields): ("delta", {"attempt", "delta"}) while held, then ("done", {"attempt", "status"}), status
# "confirmed" (it is the answer: the answer's frames follow) or "discarded".
Provisional = tuple[str, dict[str, Any]]


def frame_text(text: str) -> str:
    """The content in a run of SSE frames (text only: tool calls are never provisional)."""
    try:
        return "".join(choice_text(frame)[0] for frame in parse_sse(text))
    except ValueError:  # (not JSON: nothing provisional in it; the feed's reader must not fail on it)
        return ""


class Held:
    def __init__(self, feeds: Feeds, sink: asyncio.Queue[Provisional] | None = None) -> None:
        self.feeds = feeds
        self.sink = sink  # where provisional text goes, if the session asked for it
        self.stream: DecodeStream | None = None  # (its `tap` is set while its text goes to `sink`)
        self._following = ""  # the preemptive answer the owner named last (held, or gone before it was adopted)

    @property
    def stream_id(self) -> str:
        """What the owner is told this reader holds: its next reply waits until that changes."""
        return self._following

    async def follow(self, live: dict[str, Any] | None) -> None:
        """The owner's `provisional` (or None): hold that stream, and let go of any other."""
        stream_id = (live or {}).get("stream_id", "")
        if stream_id == self._following:
            return
        self.drop()
        self._following = stream_id
        if live is None:
            return
        opened = await self.feeds.adopt(live, live["endpoint"], live["request"], tentative=True, tap=self._tap(live))
        if isinstance(opened, DecodeStream):  # (else it is gone already: the owner's next reply says what is live)
            self.stream = opened

    def _tap(self, live: dict[str, Any]) -> Callable[[str], None] | None:
        if self.sink is None or not live.get("stream"):
            return None
        sink, attempt = self.sink, live["stream_id"]

        def tap(text: str) -> None:
            if delta := frame_text(text):
                sink.put_nowait(("delta", {"attempt": attempt, "delta": delta}))

        return tap

    def _done(self, stream: DecodeStream, status: str) -> None:
        if stream.tap is not None and self.sink is not None:
            self.sink.put_nowait(("done", {"attempt": stream.stream_id, "status": status}))
        stream.tap = None

    def take(self, stream_id: str | None) -> DecodeStream | None:
        """The held stream if the answer is that preemptive answer (it is no longer held, but read)."""
        if not stream_id or self.stream is None or self.stream.stream_id != stream_id:
            return None
        stream, self.stream = self.stream, None
        self._done(stream, "confirmed")
        return stream

    def drop(self) -> None:
        """Let the held stream go: it is stopped on decode (the owner stops it too, when it gives it up)."""
        if self.stream is not None:
            self._done(self.stream, "discarded")
            self.stream.cancel()
            self.stream = None
