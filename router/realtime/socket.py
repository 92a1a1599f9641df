"""`/v1/realtime`: the OpenAI Realtime API over WebSocket, for text and voice (audio in: router/realtime/audio.py;
answers spoken: router/realtime/output.py).

Each conversation item (and each `input_text_buffer.append`) is forwarded to the session's prefill replica
as it arrives, so the conversation is prefilled while the user is still typing or speaking; `response.create`
hands the KV to decode and streams the answer back as Realtime events (router/realtime/response.py). GA event
names by default; a client that sends `OpenAI-Beta: realtime=v1` gets the beta names (`response.text.delta`,
`modalities`).

Every client event is validated first (router/realtime/events.py) and applied whole or not at all. Errors are
`error` events (with the client's `event_id`) and leave the connection open, whatever the client sends:
malformed JSON, wrong types, binary frames, frames over `limits.max_frame_bytes`. Close codes:

- 1000: a one-turn session's answer ended (`?close_after_answer=true`: the session closes with its answer,
  whose conversation is not prefilled again; the socket closes right after `response.done`);
- 1008: refused in the handshake (API key, model);
- 1011: the session could not be created;
- 1012 (service restart): this router replica is stopping (redeploy, scale-down; router/restart.py). A response
  streaming finishes first (a few seconds at most); the `error` event before the close (code
  `server_restarting`) names the session, which is kept: reconnect with `?session_id=<id>` to go on;
- 1013 (try again later): the server is overloaded (router/admission/gate.py) or every prefill replica is at its
  session capacity; the `error` event (code `server_overloaded`) carries `retry_after` in seconds;
- 4404 (reason "session not found"): `?session_id=` names no open session of this API key;
- 4408 (reason "session expired"): the session is over. Its prefill replica closed or forgot it (idle for
  `limits.idle_timeout_s`, or older than `limits.max_session_s`), or this connection saw no client event for
  `limits.idle_timeout_s` (a response streaming counts as activity), or outlived `limits.max_session_s`.
  An `error` event says why just before.

`GET /v1/realtime?session_id=sess_...` re-attaches to an existing session (same API key only), as after a 1012:
`session.created` carries the same id, and the conversation, its resident KV and any text appended but not
committed (it joins the user's turn at the next `response.create`) are the owner replica's as they were. The
settings this connection shows start from the defaults: the owner keeps the session's own, and a
`session.update` changes only what it sets. Only a client that leaves deletes its session, never a restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from core import metrics
from core.protocol import error_status
from core.tasks import detached
from router.admission.gate import OVERLOADED, Refusal, Ticket, admit_session
from router.realtime.audio import AudioInput
from router.realtime.conversation import Conversation
from router.realtime.events import (
    ClientEvent,
    InvalidEvent,
    decode,
    event_id_of,
    leading_event_id,
    new_id,
    parse,
)
from router.realtime.response import InputSeen
from router.realtime.settings import SessionSettings
from router.sessions.owner import create_session, current_tenant, session_attach, session_delete, session_info

logger = logging.getLogger(__name__)
P = ParamSpec("P")  # (a session call's arguments, as router/sessions/owner.py types them)

api = APIRouter()

SESSION_EXPIRED = 4408  # an application close code (4000-4999); 408 as in HTTP's Request Timeout
SESSION_NOT_FOUND = 4404  # likewise; 404 as in HTTP's Not Found
SERVICE_RESTART, TRY_AGAIN_LATER = 1012, 1013  # RFC 6455 (IANA registry) codes clients reconnect or back off on
RESTART_RESPONSE_WAIT_S = 10.0  # how long a stopping router lets a response streaming finish before closing


class SessionGone(Exception):
    """The owner replica closed or forgot the session: every later call would fail, so the connection ends."""


class Restarting(Exception):
    """This router replica is stopping: the connection closes with 1012 and keeps its session."""


def session_gone(error: dict[str, Any]) -> bool:
    """Whether a session call's error says the session itself is over (not just this call refused)."""
    status, message = error_status({"error": error}), str(error.get("message") or "")
    return (status == 404 and message.endswith("not found")) or (status == 409 and "is closed" in message)


class RealtimeConnection:
    """One `/v1/realtime` socket and its session: lifecycle, dispatch, events and the owner's calls here; the parts
    it holds handle the client's events: `settings` (router/realtime/settings.py), `conversation` (items, the text
    input buffer and responses, router/realtime/conversation.py) and `audio` (router/realtime/audio.py)."""

    def __init__(self, ws: WebSocket, ingress: Any, model: str, beta: bool, close_after_answer: bool = False) -> None:
        self.ws = ws
        # One turn only (`?close_after_answer=true`): the session closes with its answer, whose conversation is not
        # prefilled again, and the server closes the socket (1000) after `response.done`.
        self.close_after_answer = close_after_answer
        self.ingress = ingress
        self.beta = beta
        self.limits = ingress.config.limits  # read once: a connection keeps the limits it started with
        self.session_id: str | None = None
        self.settings = SessionSettings(self, model, beta)  # session.update, and the settings the client is shown
        self.conversation = Conversation(self)  # conversation.item.*, input_text_buffer.*, response.*
        self.audio = AudioInput(self)  # input_audio_buffer.*, the VAD and transcription (router/voice/)
        # Each client event type's handler (the event validated first: router/realtime/events.py).
        self.handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            "session.update": self.settings.update,
            "conversation.item.create": self.conversation.item_create,
            "input_text_buffer.append": self.conversation.buffer_append,
            "input_text_buffer.replace": self.conversation.buffer_replace,
            "input_text_buffer.commit": self.conversation.buffer_commit,
            "input_text_buffer.clear": self.conversation.buffer_clear,
            "response.create": self.conversation.response_create,
            "response.cancel": self.conversation.response_cancel,
            "input_audio_buffer.append": self.audio.append,
            "input_audio_buffer.commit": self.audio.commit,
            "input_audio_buffer.clear": self.audio.clear,
            "conversation.item.truncate": self.audio.truncate,
        }
        self.input_seen = InputSeen()  # the input the owner last named (`response.create` may release an early read)
        self.closing = False
        self.event_id: str | None = None  # the client event being handled: its errors carry this id
        self.opened = self.last_event = time.monotonic()
        self._send_lock = asyncio.Lock()
        self._restart = asyncio.Event()  # set by router/restart.py when this replica stops
        self._restart_by = 0.0  # a response streaming then may finish until this time
        self.accepted = False  # the handshake completed (`accept`)
        self.restarting = False  # closed for a restart: the session stays for the client's reconnect

    def restart(self) -> None:
        self._restart_by = time.monotonic() + RESTART_RESPONSE_WAIT_S
        self._restart.set()

    # --- plumbing ----------------------------------------------------------------------------------
    async def send(self, type_: str, **fields: Any) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps({"type": type_, "event_id": new_id("event"), **fields}))

    async def error(
        self, message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
    ) -> None:
        error = {"type": type_, "code": code, "message": message, "param": param, "event_id": self.event_id}
        await self.send("error", error=error)

    async def call(
        self,
        method: Callable[Concatenate[Any, str, P], Awaitable[dict[str, Any]]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> dict[str, Any] | None:
        """One of router/sessions/owner.py's session calls, on this connection's session
        (`call(session_buffer, op=...)`), its reply `checked`."""
        return await self.checked(method(self.ingress, self.session_id, *args, **kwargs))

    async def checked(
        self, call: Awaitable[dict[str, Any]], fields: dict[str, str] | None = None
    ) -> dict[str, Any] | None:
        """A session call's reply; an `error` event (and None) if it failed (`fields`: the owner's names of fields
        → the event's), and `SessionGone` once the session is over."""
        result = await self.input_seen.call(call)
        if "error" in result:
            err = result["error"]
            param = (fields or {}).get(err.get("param"), err.get("param"))
            await self.error(err["message"], str(err.get("type") or "session_error"), param)
            if session_gone(err):
                raise SessionGone(err["message"])
            return None
        return result

    # --- lifecycle ---------------------------------------------------------------------------------
    async def accept(self) -> None:
        """Complete the handshake (once)."""
        if not self.accepted:
            self.accepted = True
            await self.ws.accept(subprotocol=getattr(self.ws.state, "subprotocol", None))

    async def refuse(self, message: str, code: str, close_code: int, **extra: Any) -> None:
        """Accept the handshake, say why in an `error` event, and close (a refusal the client can read)."""
        await self.accept()
        error = {"type": "server_error", "code": code, "message": message, "param": None, "event_id": None, **extra}
        await self.send("error", error=error)
        wait = extra.get("retry_after")
        await self.ws.close(code=close_code, reason=f"try again in {wait} s" if wait else None)  # (1013's wait too)
        metrics.inc(metrics.REALTIME_CLOSES, 1, "realtime connections closed by the server", code=str(close_code))

    async def open_session(self) -> bool:
        settings = self.settings.values
        spec = {
            "request": {"model": settings["model"], "messages": [], **self.settings.sampling(settings)},
            "close_after_answer": self.close_after_answer,
            "connection": getattr(self.ingress, "replica_name", None),  # (closed if this router replica dies)
        }
        created = await create_session(self.ingress, spec)  # (the client left meanwhile: the session goes too)
        if "error" in created:
            err = created["error"]
            if error_status(created) == 429:  # every session slot is taken (the replica's own hard limit)
                wait = {"retry_after": err.get("retry_after", 1)}
                await self.refuse(err["message"], OVERLOADED, TRY_AGAIN_LATER, **wait)
            else:
                await self.refuse(err["message"], "session_failed", 1011)
            return False
        self.session_id = created["session_id"]
        return True

    async def attach(self, session_id: str) -> bool:
        """Re-attach to an open session of this key (after a restart's 1012); 4404 if there is none."""
        info = await session_info(self.ingress, session_id)
        if "error" in info or info.get("state") == "closed":
            message = f"session {session_id} not found (it ended, expired or belongs to another API key)"
            await self.refuse(message, "session_not_found", SESSION_NOT_FOUND)
            return False
        self.session_id = session_id
        # The connection's view of the session as the session holds it (settings, text typed and not committed).
        self.settings.restore(info)
        self.conversation.buffer = info.get("buffer") or ""
        # The connection is this router replica's now: the session no longer dies with the one it left.
        await session_attach(
            self.ingress,
            session_id,
            connection=getattr(self.ingress, "replica_name", None),
        )
        return True

    async def run(self, resume: str | None = None) -> None:
        if not await (self.attach(resume) if resume else self.open_session()):
            return
        watch = getattr(self.ingress, "restart", None)
        if watch is not None and not watch.register(self):
            self.restart()  # the replica began stopping during the handshake
        try:
            await self.accept()
            await self.send("session.created", session=self.settings.session_object())
            self.opened = self.last_event = time.monotonic()  # the session's clocks start once the client has it
            while (message := await self.next_message()) is not None:
                if message["type"] == "websocket.disconnect":
                    return
                self.last_event = time.monotonic()
                await self.on_message(message)
            response = self.conversation.response
            if self.close_after_answer and response is not None and response.done:
                await self.ws.close(code=1000, reason="the session's one answer ended")
                return
            await self.error(self.expiry_reason(), "session_expired")
            await self.ws.close(code=SESSION_EXPIRED, reason="session expired")
        except SessionGone:  # its `error` event is sent
            await self.ws.close(code=SESSION_EXPIRED, reason="session expired")
        except Restarting:
            await self.close_for_restart()
        except WebSocketDisconnect:
            pass
        finally:
            self.closing = True
            if watch is not None:
                watch.unregister(self)
            if self.conversation.early is not None:
                self.conversation.early.close()
            self.audio.close()
            if self.conversation.response is not None:
                self.conversation.response.task.cancel()
            # The client is gone: the session's KV goes with it (in a task of its own: this one may be cancelled).
            # Not when this replica stops: the client reconnects to the session through another one.
            if not self.restarting:
                detached(session_delete(self.ingress, self.session_id))

    async def close_for_restart(self) -> None:
        """1012, with an `error` naming the session before it."""
        self.restarting = True
        message = f"the server is restarting: reconnect with session_id={self.session_id} to continue the session"
        error = {"type": "server_error", "code": "server_restarting", "message": message, "param": None}
        await self.send("error", error={**error, "event_id": None, "session_id": self.session_id})
        await self.ws.close(code=SERVICE_RESTART, reason="service restart")
        metrics.inc(metrics.REALTIME_CLOSES, 1, "realtime connections closed by the server", code=str(SERVICE_RESTART))

    def time_left(self) -> float:
        deadline = min(self.last_event + self.limits.idle_timeout_s, self.opened + self.limits.max_session_s)
        return deadline - time.monotonic()

    def expiry_reason(self) -> str:
        if time.monotonic() - self.opened >= self.limits.max_session_s:
            return f"the session reached its maximum duration of {self.limits.max_session_s:g} s"
        return f"the session expired: no client event for {self.limits.idle_timeout_s:g} s"

    async def next_message(self) -> dict[str, Any] | None:
        """The client's next ASGI message; None when the connection expired waiting for it; `Restarting` once
        this replica stops (between events: none is half applied), after a response streaming has ended (or
        `RESTART_RESPONSE_WAIT_S`), its client's events still handled meanwhile. A response streaming is
        activity: nothing expires before it ends, and its end counts as the last event."""
        receiving = asyncio.ensure_future(self.ws.receive())
        restart = asyncio.ensure_future(self._restart.wait())
        try:
            while True:
                response = self.conversation.response
                streaming = response.task if response is not None and not response.done else None
                if restart.done() and (streaming is None or time.monotonic() >= self._restart_by):
                    raise Restarting
                if streaming is None:
                    waiting, timeout = {receiving, restart}, max(self.time_left(), 0)
                elif restart.done():
                    waiting, timeout = {receiving, streaming}, max(self._restart_by - time.monotonic(), 0)
                else:
                    waiting, timeout = {receiving, streaming, restart}, None
                await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done():
                    return receiving.result()
                if restart.done():
                    continue  # (decided above)
                if streaming is None or self.close_after_answer:
                    return None  # (expired, or a one-turn session's answer ended)
                self.last_event = time.monotonic()
        finally:
            receiving.cancel()  # (a no-op once it is done)
            restart.cancel()

    async def on_message(self, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            await self.error("binary frames are not supported: events are JSON text frames", "binary_not_supported")
            return
        limit = self.limits.max_frame_bytes
        if len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:  # (4 bytes a character)
            self.event_id = leading_event_id(text)  # found without parsing what is refused
            await self.error(f"the frame exceeds the limit of {limit} bytes", "frame_too_large")
            self.event_id = None
            return
        await self.dispatch(text)

    async def dispatch(self, text: str) -> None:
        """Validate and apply one client event. Nothing a client sends ends the connection: an invalid event,
        and any failure handling it, answers an `error` event."""
        event: ClientEvent | None = None
        try:
            raw = decode(text)
            self.event_id = event_id_of(raw)
            event = parse(raw)
            await self.handlers[event.type](event)
        except InvalidEvent as e:
            await self.error(e.message, e.code, e.param)
        except (SessionGone, WebSocketDisconnect):
            raise
        except Exception:  # logged without the event itself: it may hold the user's text
            logger.exception("session %s: %s failed", self.session_id, event.type if event else "an event")
            await self.error("the server failed to handle the event", "server_error", type_="server_error")
        finally:
            self.event_id = None


@api.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    ingress = ws.app.state.ingress
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    key = ingress.api_keys.websocket_key(ws.headers.get("authorization"), offered)
    if key is None:
        await ws.close(code=1008, reason="incorrect or missing API key")  # refused during the handshake
        return
    current_tenant.set(ingress.api_keys.key_id(key))  # the session belongs to this key
    # Browsers offer `realtime` (with the key as another subprotocol) and fail the handshake unless one is chosen.
    ws.state.subprotocol = "realtime" if "realtime" in offered else None
    model = ws.query_params.get("model") or ingress.config.model_name
    if model != ingress.config.model_name:
        await ws.accept(subprotocol=ws.state.subprotocol)
        error = {"type": "invalid_request_error", "code": "model_not_found", "message": f"unknown model {model!r}"}
        await ws.send_text(json.dumps({"type": "error", "event_id": new_id("event"), "error": error}))
        await ws.close(code=1008)
        return
    beta = "realtime=v1" in ws.headers.get("openai-beta", "")
    once = ws.query_params.get("close_after_answer", "").lower() in ("1", "true")
    connection = RealtimeConnection(ws, ingress, model, beta, close_after_answer=once)
    resume = ws.query_params.get("session_id") or None
    watch = getattr(ingress, "restart", None)
    if watch is not None and watch.stopping:  # (Serve may route a connection here until it knows)
        await connection.refuse("the server is restarting: reconnect", "server_restarting", SERVICE_RESTART)
        return
    if resume is None:
        # A new session may wait to be admitted (router/admission/gate.py), longer than a client's connect timeout
        # (often 10 s) if the handshake waited too: the handshake completes now, `session.created` once admitted.
        await connection.accept()
    ticket = await admit_session(ingress) if resume is None else Ticket()  # (a re-attach is no new session)
    if isinstance(ticket, Refusal):
        await connection.refuse(ticket.message, OVERLOADED, TRY_AGAIN_LATER, retry_after=ticket.retry_after)
        return
    started = time.monotonic()
    try:
        await connection.run(resume)
    finally:
        ticket.release()  # the session is over for this router's admission
    logger.info("realtime connection closed after %.1fs", time.monotonic() - started)
