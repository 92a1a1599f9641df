"""What the parts of a realtime connection (router/realtime/socket.py `RealtimeConnection`) need of it and of each
other, as Protocols: the parts (settings, conversation, audio input, spoken turn) import no sibling's class, and the
voice files do not import the socket they serve. A part's Protocols used by it alone live beside it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, Protocol

from router.realtime.events import ResponseCreate

P = ParamSpec("P")


class Calls(Protocol):
    """The connection's events to its client and calls on its session's owner, which every part makes."""

    async def send(self, type_: str, **fields: Any) -> None: ...

    async def call(
        self,
        method: Callable[Concatenate[Any, str, P], Awaitable[dict[str, Any]]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> dict[str, Any] | None:
        """A call on the session's owner, one of router/sessions/owner.py's (None: refused, and the client told)."""
        ...


class ClientErrors(Protocol):
    """The connection's `error` events (with the client event's `event_id`)."""

    async def error(
        self, message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
    ) -> None: ...


class SessionValues(Protocol):
    """The session's settings (router/realtime/settings.py `SessionSettings`)."""

    values: dict[str, Any]  # as `session.updated` shows them


class Cancellable(Protocol):
    """A response as the audio input sees it: barge-in cancels it (router/realtime/response.py `ResponseStream`)."""

    async def cancel(self, reason: str = "client_cancelled") -> None: ...


class SpokenAnswer(Protocol):
    """An answer's spoken message (router/realtime/audio_out.py `AudioOut`), as a truncate cuts it."""

    item_id: str
    base: int  # where its text starts in the answer's text
    audio_ms: float  # its audio sent

    def heard_chars(self, ms: float) -> int | None: ...  # its text heard by `ms` of its audio (None: past it)


class EarlyReads(Protocol):
    """The conversation's early reads of the next turn's answer (router/realtime/conversation.py)."""

    def read_early(self, turn: int) -> None: ...


class VoiceConversation(EarlyReads, Protocol):
    """What the audio input and its spoken turn need of the conversation (router/realtime/conversation.py)."""

    buffer: str  # the input text buffer: typed text, then the spoken turn's transcript so far
    lock: asyncio.Lock  # the input text's: transcripts and client events change it in turn
    items: set[str]  # the conversation's item ids
    last_item_id: str | None
    answer_item: str | None  # the last response's message item
    answer_audio: SpokenAnswer | None  # its audio, if it was spoken

    @property
    def response(self) -> Cancellable | None: ...  # the latest response

    @property
    def responding(self) -> bool: ...

    async def announce_item(self, item_id: str, role: str, parts: list[dict[str, Any]]) -> None: ...

    async def commit_input(self, item_id: str, parts: list[dict[str, Any]], committed: str | None = None) -> bool: ...

    async def commit_and_respond(
        self, item_id: str, parts: list[dict[str, Any]], announced: Callable[[], Awaitable[None]]
    ) -> None: ...

    async def response_create(self, event: ResponseCreate) -> None: ...


class VoiceConnection(Calls, ClientErrors, Protocol):
    """What the audio input (router/realtime/audio.py) and its spoken turn (router/realtime/spoken_turn.py) need of
    their connection."""

    ingress: Any  # the router's ingress (router/app.py): its config and clients
    close_after_answer: bool

    @property
    def settings(self) -> SessionValues: ...

    @property
    def conversation(self) -> VoiceConversation: ...
