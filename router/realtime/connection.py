"""What a realtime connection's audio input (router/realtime/audio.py, router/realtime/spoken_turn.py) needs of
its connection (router/realtime/socket.py `RealtimeConnection`): this Protocol, not the connection's class, so that the
voice folder does not import the socket it serves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, Protocol

from router.realtime.events import ResponseCreate
from router.realtime.response import ResponseStream

P = ParamSpec("P")


class VoiceConnection(Protocol):
    ingress: Any  # the router's ingress (router/app.py): its config and clients
    settings: dict[str, Any]  # the session's settings, as `session.updated` shows them
    buffer: str  # the input text buffer: the turn's transcript so far
    items: set[str]  # the conversation's item ids
    last_item_id: str | None
    answer_item: str | None  # the last response's message item
    response: ResponseStream | None  # the latest response
    close_after_answer: bool

    @property
    def responding(self) -> bool: ...

    async def send(self, type_: str, **fields: Any) -> None: ...

    async def error(
        self, message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
    ) -> None: ...

    async def call(
        self,
        method: Callable[Concatenate[Any, str, P], Awaitable[dict[str, Any]]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> dict[str, Any] | None:
        """A call on the session's owner, one of router/sessions/owner.py's (None: refused, and the client told)."""
        ...

    async def announce_item(self, item_id: str, role: str, parts: list[dict[str, Any]]) -> None: ...

    async def commit_input(self, item_id: str, parts: list[dict[str, Any]], committed: str | None = None) -> bool: ...

    async def commit_and_respond(
        self, item_id: str, parts: list[dict[str, Any]], announced: Callable[[], Awaitable[None]]
    ) -> None: ...

    async def response_create(self, event: ResponseCreate) -> None: ...

    def read_early(self, turn: int) -> None: ...
