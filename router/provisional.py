"""A streaming reader's hold on its session's preemptive answer while the turn may still go on.

A reader that waits for a session's answer (`/events`, an NDJSON request's response) learns from the owner
which preemptive answer decode is making for the turn (prefill/preemptive.py) and adopts its stream
*tentatively*: decode sends its frames to this router from then on, but keeps its cap and its low rank until
the owner confirms the turn. When the turn ends unchanged, the claim names that stream and its frames are
already here: the first token leaves with the claim's reply, with no call to decode in between. When the input
changes, the owner stops it on decode and this hold lets it go.
"""

from __future__ import annotations

from typing import Any

from router.feeds import DecodeStream, Feeds


class Held:
    def __init__(self, feeds: Feeds) -> None:
        self.feeds = feeds
        self.stream: DecodeStream | None = None
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
        opened = await self.feeds.adopt(live, live["endpoint"], live["request"], tentative=True)
        if isinstance(opened, DecodeStream):  # (else it is gone already: the owner's next reply says what is live)
            self.stream = opened

    def take(self, stream_id: str | None) -> DecodeStream | None:
        """The held stream if the answer is that preemptive answer (it is no longer held, but read)."""
        if not stream_id or self.stream is None or self.stream.stream_id != stream_id:
            return None
        stream, self.stream = self.stream, None
        return stream

    def drop(self) -> None:
        """Let the held stream go: it is stopped on decode (the owner stops it too, when it gives it up)."""
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
