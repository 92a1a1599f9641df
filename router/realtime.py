"""`/v1/realtime`: the OpenAI Realtime API over WebSocket, for text.

Each conversation item (and each `input_text_buffer.append`) is forwarded to the session's prefill replica
as it arrives, so the conversation is prefilled while the user is still typing or speaking; `response.create`
hands the KV to decode and streams the answer back as Realtime events. GA event names by default; a client
that sends `OpenAI-Beta: realtime=v1` gets the beta names (`response.text.delta`, `modalities`).
Errors are `error` events and leave the session open, except where the session itself ended.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from router.answers import AnswerReader
from router.owner import create_session, current_tenant, session_call

logger = logging.getLogger(__name__)

api = APIRouter()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class RealtimeConnection:
    def __init__(self, ws: WebSocket, ingress: Any, model: str, beta: bool) -> None:
        self.ws = ws
        self.ingress = ingress
        self.prefill = ingress.prefill
        self.beta = beta
        self.session_id: str | None = None
        self.settings: dict[str, Any] = {
            "model": model,
            "instructions": "",
            "max_output_tokens": "inf",
            "temperature": 0.8,
            ("modalities" if beta else "output_modalities"): ["text"],
        }
        self.buffer = ""
        self.last_item_id: str | None = None
        self.response_task: asyncio.Task[None] | None = None
        self.reading: asyncio.Task[None] | None = None  # the answer's stream from decode (response.cancel stops it)
        self.cancel_requested = False
        self.reader: AnswerReader | None = None
        self._send_lock = asyncio.Lock()

    # --- plumbing ----------------------------------------------------------------------------------
    async def send(self, type_: str, **fields: Any) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps({"type": type_, "event_id": _id("event"), **fields}))

    async def error(self, message: str, code: str, event_id: str | None = None, param: str | None = None) -> None:
        error = {"type": "invalid_request_error", "code": code, "message": message, "param": param}
        await self.send("error", error={**error, "event_id": event_id})

    async def call(self, method: str, **kwargs: Any) -> dict[str, Any] | None:
        """A session call on the owner prefill replica; an `error` event (and None) if it failed."""
        result = await session_call(self.ingress, method, session_id=self.session_id, **kwargs)
        if "error" in result:
            err = result["error"]
            await self.error(err["message"], str(err.get("type") or "session_error"), self._event_id, err.get("param"))
            return None
        return result

    def session_object(self) -> dict[str, Any]:
        return {"id": self.session_id, "object": "realtime.session", "type": "realtime", **self.settings}

    def sampling(self, settings: dict[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if settings.get("max_output_tokens") not in (None, "inf"):
            params["max_tokens"] = int(settings["max_output_tokens"])
        if settings.get("temperature") is not None:
            params["temperature"] = float(settings["temperature"])
        return params

    # --- lifecycle ---------------------------------------------------------------------------------
    async def run(self) -> None:
        model = self.settings["model"]
        created = await create_session(
            self.ingress, {"request": {"model": model, "messages": [], **self.sampling(self.settings)}}
        )
        await self.ws.accept(subprotocol=getattr(self.ws.state, "subprotocol", None))
        if "error" in created:
            await self.error(created["error"]["message"], "session_failed")
            await self.ws.close(code=1011)
            return
        self.session_id = created["session_id"]
        await self.send("session.created", session=self.session_object())
        try:
            while True:
                raw = await self.ws.receive_text()
                await self.dispatch(raw)
        except WebSocketDisconnect:
            pass
        finally:
            if self.response_task is not None:
                self.response_task.cancel()
            # The client is gone: the session's KV goes with it.
            await session_call(self.ingress, "session_delete", session_id=self.session_id)

    async def dispatch(self, raw: str) -> None:
        self._event_id = None
        try:
            event = json.loads(raw)
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise ValueError("an event is a JSON object with a string `type`")
        except ValueError as e:
            await self.error(f"invalid event: {e}", "invalid_json")
            return
        self._event_id = event.get("event_id")
        handler = HANDLERS.get(event["type"])
        if handler is None:
            await self.error(f"unknown event type {event['type']!r}", "unknown_event", self._event_id, "type")
            return
        try:
            await handler(self, event)
        except (KeyError, TypeError, ValueError) as e:
            await self.error(f"invalid {event['type']}: {e}", "invalid_event", self._event_id)

    # --- client events -----------------------------------------------------------------------------
    async def session_update(self, event: dict[str, Any]) -> None:
        session = event.get("session") or {}
        modalities = session.get("output_modalities") or session.get("modalities")
        if modalities is not None and set(modalities) - {"text"}:
            await self.error("only text output is supported", "unsupported_modality", self._event_id, "modalities")
            return
        for key in ("instructions", "max_output_tokens", "temperature"):
            if key in session:
                self.settings[key] = session[key]
        if modalities is not None:
            self.settings["modalities" if self.beta else "output_modalities"] = modalities
        if await self.call(
            "session_update", instructions=self.settings["instructions"], params=self.sampling(self.settings)
        ):
            await self.send("session.updated", session=self.session_object())

    async def item_create(self, event: dict[str, Any]) -> None:
        item = event["item"]
        if item.get("type", "message") != "message":
            raise ValueError(f"item type {item.get('type')!r} is not supported (messages only)")
        role = item["role"]
        if role not in ("user", "system", "assistant"):
            raise ValueError(f"role {role!r}")
        parts = item.get("content") or []
        text = "".join(p.get("text", "") for p in parts if p.get("type") in ("input_text", "text", "output_text"))
        if await self.call("session_message", role=role, content=text):
            await self.announce_item(item.get("id") or _id("item"), role, parts)

    async def announce_item(self, item_id: str, role: str, parts: list[dict[str, Any]]) -> None:
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": "completed"}
        item["content"] = parts
        previous, self.last_item_id = self.last_item_id, item_id
        await self.send("conversation.item.created", previous_item_id=previous, item=item)
        if not self.beta:
            await self.send("conversation.item.added", previous_item_id=previous, item=item)
            await self.send("conversation.item.done", previous_item_id=previous, item=item)

    async def buffer_append(self, event: dict[str, Any]) -> None:
        text = event.get("delta", event.get("text"))
        if not isinstance(text, str):
            raise ValueError("`delta` must be a string")
        if await self.call("session_buffer", op="append", text=text):
            self.buffer += text

    async def buffer_replace(self, event: dict[str, Any]) -> None:
        """Update mode: the buffer's text from character `offset` (default 0) on becomes `text`."""
        text, offset = event.get("text", event.get("delta")), event.get("offset", 0)
        if not isinstance(text, str):
            raise ValueError("`text` must be a string")
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= len(self.buffer):
            raise ValueError(f"`offset` must be an integer from 0 to the buffer's length ({len(self.buffer)})")
        if await self.call("session_buffer", op="replace", text=text, offset=offset):
            self.buffer = self.buffer[:offset] + text

    async def buffer_commit(self, event: dict[str, Any]) -> None:
        if not self.buffer:
            await self.error("the input text buffer is empty", "input_text_buffer_empty", self._event_id)
            return
        if await self.call("session_buffer", op="commit"):
            item_id = _id("item")
            text, self.buffer = self.buffer, ""
            await self.send("input_text_buffer.committed", previous_item_id=self.last_item_id, item_id=item_id)
            await self.announce_item(item_id, "user", [{"type": "input_text", "text": text}])

    async def buffer_clear(self, event: dict[str, Any]) -> None:
        if await self.call("session_buffer", op="clear"):
            self.buffer = ""
            await self.send("input_text_buffer.cleared")

    async def response_create(self, event: dict[str, Any]) -> None:
        if self.response_task is not None and not self.response_task.done():
            await self.error("a response is already in progress", "conversation_already_has_active_response")
            return
        if self.buffer:  # text typed but not committed is part of the user's turn
            await self.buffer_commit(event)
        settings = {**self.settings, **(event.get("response") or {})}
        overrides = self.sampling(settings)
        if settings.get("instructions") != self.settings["instructions"]:
            overrides["instructions"] = settings.get("instructions")
        started = await self.call("session_respond", overrides=overrides)
        if started is None:
            return
        self.cancel_requested = False
        self.response_task = asyncio.create_task(self.stream_response(started["answer"]["turn"]))

    async def response_cancel(self, event: dict[str, Any]) -> None:
        if self.response_task is None or self.response_task.done():
            await self.error("no response is in progress", "response_cancel_not_active", self._event_id)
            return
        self.cancel_requested = True  # read before the reading starts, too
        if self.reader is not None:
            self.reader.cancel()  # reported cancelled (not released), and the stream from decode stops
        if self.reading is not None:
            self.reading.cancel()
        await asyncio.gather(self.response_task, return_exceptions=True)

    # --- the answer --------------------------------------------------------------------------------
    async def stream_response(self, turn: int) -> None:
        response_id, item_id = _id("resp"), _id("item")
        text_delta = "response.text.delta" if self.beta else "response.output_text.delta"
        text_done = "response.text.done" if self.beta else "response.output_text.done"
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress", "output": []}
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant"}
        where = {"response_id": response_id, "item_id": item_id, "output_index": 0}
        await self.send("response.created", response=response)
        await self.send(
            "response.output_item.added",
            response_id=response_id,
            output_index=0,
            item={**item, "status": "in_progress", "content": []},
        )
        await self.send("response.content_part.added", **where, content_index=0, part={"type": "text", "text": ""})
        summary = await self.read_answer(turn, text_delta, where)
        text = summary.get("text") or ""
        await self.send(text_done, **where, content_index=0, text=text)
        await self.send("response.content_part.done", **where, content_index=0, part={"type": "text", "text": text})
        done_item = {**item, "status": "completed", "content": [{"type": "text", "text": text}]}
        await self.send("response.output_item.done", response_id=response_id, output_index=0, item=done_item)
        self.last_item_id = item_id
        status, details = summary.get("status"), None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": "client_cancelled"}
        elif status == "completed" and summary.get("finish_reason") == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        elif status == "failed":
            details = {"type": "failed", "error": summary.get("error")}
        usage = summary.get("usage") or {}
        response.update(
            status=status,
            status_details=details,
            output=[done_item],
            usage={
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
            },
        )
        await self.send("response.done", response=response)

    async def read_answer(self, turn: int, text_delta: str, where: dict[str, Any]) -> dict[str, Any]:
        """Stream the answer from decode as `text_delta` events; its summary (a cancelled one included)."""
        reader = self.reader = AnswerReader(self.ingress, self.session_id, turn)

        async def read() -> None:
            if self.cancel_requested:
                raise asyncio.CancelledError
            if (err := await reader.open()) is not None:
                reader.outcome.status, reader.outcome.error = "failed", err.get("error", err)
                return
            async for _, deltas in reader.items():
                for delta in deltas:
                    await self.send(text_delta, **where, content_index=0, delta=delta)

        self.reading = asyncio.create_task(read())
        try:
            await self.reading
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is not None and task.cancelling():
                reader.release()
                raise  # this task itself was cancelled (the connection is closing), not just the reading
            reader.cancel()  # response.cancel
            await reader.settle("cancelled")  # the owner knows before the client reads response.done
            reader.outcome.status = "cancelled"
        except Exception as e:  # anything else still ends the response, as failed
            logger.exception("session %s: response failed", self.session_id)
            reader.release()
            reader.outcome.status = "failed"
            reader.outcome.error = {"message": f"the response failed: {e}", "type": "server_error", "code": 500}
        finally:
            self.reading = self.reader = None
        if reader.summary is not None:
            return reader.summary
        return reader.outcome.as_dict()


HANDLERS = {
    "session.update": RealtimeConnection.session_update,
    "conversation.item.create": RealtimeConnection.item_create,
    "input_text_buffer.append": RealtimeConnection.buffer_append,
    "input_text_buffer.replace": RealtimeConnection.buffer_replace,
    "input_text_buffer.commit": RealtimeConnection.buffer_commit,
    "input_text_buffer.clear": RealtimeConnection.buffer_clear,
    "response.create": RealtimeConnection.response_create,
    "response.cancel": RealtimeConnection.response_cancel,
}


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
        await ws.send_text(json.dumps({"type": "error", "event_id": _id("event"), "error": error}))
        await ws.close(code=1008)
        return
    beta = "realtime=v1" in ws.headers.get("openai-beta", "")
    started = time.monotonic()
    await RealtimeConnection(ws, ingress, model, beta).run()
    logger.info("realtime connection closed after %.1fs", time.monotonic() - started)
