"""A streaming reader's hold on its session's preemptive answer while the turn may still go on.

A reader that waits for a session's answer (`/events`, an NDJSON request's response) learns from the owner
which preemptive answer decode is making for the turn (prefill/preemptive.py) and adopts its stream
*tentatively*: decode sends its frames to this router from then on, but keeps its cap and its low rank until
the owner confirms the turn. When the turn ends unchanged, the claim names that stream and its frames are
already here: the first token leaves with the claim's reply, with no call to decode in between. When the input
changes, the owner stops it on decode and this hold lets it go.

Released here (`Feeds.held`, `release`): a REST end chunk (`end_of_input`, empty, appended) whose sequence id is the
one the held answer's input was waiting for comes to this router before the owner has it. Sequence ids are the
session's own order, so nothing can have changed the input in between: the reader streams the held answer at
once, and the owner's reply to its claim, naming the same stream, follows the first frames (the answer's turn
bookkeeping waits for it; an owner that refuses the chunk, or ends the turn another way, revokes it: the stream
ends with an error frame, never with another answer's text). Realtime (`release_input`): `response.create` with
nothing of its own releases it likewise when the owner's reply to the connection's last call (none in flight)
named the input the held answer was made from; `session_respond` refused revokes it.

Provisional text (the session's `preemptive.stream`): while held, the stream's text goes to `sink` as it arrives,
marked with its attempt, then whether it was confirmed or discarded; the surface turns these into events of its
own (router/sessions/rest.py: named SSE events; router/realtime/socket.py: `rtpd.response.provisional.*`). Only text is
provisional: a tool call reaches the client only in the confirmed answer. A `watch` sees the held text too, whether the
client does or not, and hears when it is discarded (router/realtime/early_speech.py: its first sentence is
synthesized before the turn is confirmed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from core.protocol import choice_text, parse_sse
from router.streams.feeds import DecodeStream, Feeds

logger = logging.getLogger(__name__)
# (kind, fields): ("delta", {"attempt", "delta"}) while held, then ("done", {"attempt", "status"}), status
# "confirmed" (it is the answer: the answer's frames follow) or "discarded".
Provisional = tuple[str, dict[str, Any]]
# (attempt, text): a held answer's text as it arrives, whether or not the client sees it; (attempt, None): discarded.
Watch = Callable[[str, str | None], None]


def frame_text(text: str) -> str:
    """The content in a run of SSE frames (text only: tool calls are never provisional)."""
    try:
        return "".join(choice_text(frame)[0] for frame in parse_sse(text))
    except ValueError:  # (not JSON: nothing provisional in it; the feed's reader must not fail on it)
        return ""


class Held:
    def __init__(
        self,
        feeds: Feeds,
        session_id: str,
        sink: asyncio.Queue[Provisional] | None = None,
        watch: Watch | None = None,
    ) -> None:
        self.feeds, self.session_id = feeds, session_id
        self.sink = sink  # where provisional text goes, if the session asked for it
        self.watch = watch  # sees the held text too (router/realtime/early_speech.py)
        self._shown: set[str] = set()  # the held streams whose text goes to `sink`
        self.stream: DecodeStream | None = None  # (its `tap` is set while its text goes to `sink` or `watch`)
        self.live: dict[str, Any] = {}  # the owner's description of the held stream (prefill/preemptive.py)
        self._following = ""  # the preemptive answer the owner named last (held, or gone before it was adopted)
        loop = asyncio.get_running_loop()
        self.released: asyncio.Future[float] = loop.create_future()  # (when) its end chunk came to this router
        self.revoked: asyncio.Future[dict[str, Any]] = loop.create_future()  # the owner refused that end chunk

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
            self.stream, self.live = opened, live
            self.feeds.held.setdefault(self.session_id, self)

    def _tap(self, live: dict[str, Any]) -> Callable[[str], None] | None:
        sink = self.sink if live.get("stream") else None
        watch, attempt = self.watch, live["stream_id"]
        if sink is None and watch is None:
            return None
        if sink is not None:
            self._shown.add(attempt)

        def tap(text: str) -> None:
            if delta := frame_text(text):
                if sink is not None:
                    sink.put_nowait(("delta", {"attempt": attempt, "delta": delta}))
                if watch is not None:
                    try:
                        watch(attempt, delta)
                    except Exception:  # (the feed's reader carries every stream: it must not fail on one's watcher)
                        logger.exception("session %s: the held answer's watcher failed", self.session_id)

        return tap

    def _done(self, stream: DecodeStream, status: str) -> None:
        if stream.stream_id in self._shown and self.sink is not None:
            self._shown.discard(stream.stream_id)
            self.sink.put_nowait(("done", {"attempt": stream.stream_id, "status": status}))
        if stream.tap is not None and self.watch is not None and status == "discarded":
            self.watch(stream.stream_id, None)
        stream.tap = None

    def release(self, sequence_id: int) -> bool:
        """An end chunk `sequence_id` (empty, appended) came to this router: whether it makes the held answer the
        answer (the next sequence id after the input it was made from), which its reader then streams."""
        return self._release("end_sequence_id", sequence_id)

    def release_input(self, tag: str | None) -> bool:
        """A realtime `response.create` that changes nothing, on a connection whose calls have all been answered:
        whether the held answer was made from the input the last of those replies named (`tag`), which makes it
        the answer as an end chunk does; the owner's reply to its claim confirms it."""
        return bool(tag) and self._release("input", tag)

    def _release(self, key: str, value: Any) -> bool:
        if self.stream is None or self.released.done() or self.live.get(key) != value:
            return False
        self.released.set_result(time.time())
        return True

    def revoke(self, error: dict[str, Any]) -> None:
        """The owner refused the end chunk that released it: its reader must not go on with it."""
        if not self.revoked.done():
            self.revoked.set_result(error)

    def early_claim(self) -> dict[str, Any]:
        """What the reader of a released answer knows before the owner's reply to its claim (`session_claim`'s)."""
        live = self.live
        request = {k: v for k, v in live["request"].items() if k != "priority"}  # (it is an ordinary answer now)
        adopt = {k: live[k] for k in ("replica", "parked", "stream_id")}
        return {
            "turn": live["turn"],
            "endpoint": live["endpoint"],
            "include_usage": live["include_usage"],
            "last_chunk_time": self.released.result(),
            "request": request,
            "adopt": adopt,
        }

    def take(self, stream_id: str | None) -> DecodeStream | None:
        """The held stream if the answer is that preemptive answer (it is no longer held, but read)."""
        if not stream_id or self.stream is None or self.stream.stream_id != stream_id:
            return None
        stream, self.stream = self.stream, None
        self._unlist()
        self._done(stream, "confirmed")
        return stream

    def drop(self) -> None:
        """Let the held stream go: it is stopped on decode (the owner stops it too, when it gives it up)."""
        if self.stream is not None:
            self._done(self.stream, "discarded")
            self.stream.cancel()
            self.stream = None
            if self.released.done():  # (released, but let go before its reader took it: the owner's reply decides)
                self.released = asyncio.get_running_loop().create_future()
        self._unlist()

    def _unlist(self) -> None:
        if self.feeds.held.get(self.session_id) is self:
            del self.feeds.held[self.session_id]
