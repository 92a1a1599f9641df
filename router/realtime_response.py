"""One `/v1/realtime` response: the answer of a turn, read from decode and sent as `response.*` events.

`response.create` (router/realtime.py) starts a `ResponseStream` once the owner prefill replica has handed the
turn to decode; it sends `response.created`, the output item and content part, one text delta per read (a slow
reader gets fewer, larger deltas), then the `done` events and `response.done` with the status and usage.
`response.cancel` stops the reading: the response still ends with `response.done`, status `cancelled`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from router.answers import AnswerReader
from router.realtime_events import new_id

logger = logging.getLogger(__name__)


class Connection(Protocol):
    """What a response needs of its connection (router/realtime.py)."""

    ingress: Any
    session_id: str | None
    beta: bool
    last_item_id: str | None

    async def send(self, type_: str, **fields: Any) -> None: ...


class ResponseStream:
    """The response to one `response.create`, streaming in a task of its own from construction on."""

    def __init__(self, connection: Connection, turn: int) -> None:
        self.connection = connection
        self.reading: asyncio.Task[None] | None = None  # the answer's stream from decode (response.cancel stops it)
        self.cancel_requested = False
        self.reader: AnswerReader | None = None
        self.task = asyncio.create_task(self.stream(turn))

    @property
    def done(self) -> bool:
        return self.task.done()

    async def cancel(self) -> None:
        """response.cancel: the response ends as cancelled (its `response.done` sent) before this returns."""
        self.cancel_requested = True  # read before the reading starts, too
        if self.reader is not None:
            self.reader.cancel()  # reported cancelled (not released), and the stream from decode stops
        if self.reading is not None:
            self.reading.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def stream(self, turn: int) -> None:
        connection = self.connection
        beta, send = connection.beta, connection.send
        response_id, item_id = new_id("resp"), new_id("item")
        text_delta = "response.text.delta" if beta else "response.output_text.delta"
        text_done = "response.text.done" if beta else "response.output_text.done"
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress", "output": []}
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant"}
        where = {"response_id": response_id, "item_id": item_id, "output_index": 0}
        await send("response.created", response=response)
        await send(
            "response.output_item.added",
            response_id=response_id,
            output_index=0,
            item={**item, "status": "in_progress", "content": []},
        )
        await send("response.content_part.added", **where, content_index=0, part={"type": "text", "text": ""})
        summary = await self.read_answer(turn, text_delta, where)
        text = summary.get("text") or ""
        await send(text_done, **where, content_index=0, text=text)
        await send("response.content_part.done", **where, content_index=0, part={"type": "text", "text": text})
        done_item = {**item, "status": "completed", "content": [{"type": "text", "text": text}]}
        await send("response.output_item.done", response_id=response_id, output_index=0, item=done_item)
        connection.last_item_id = item_id
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
        await send("response.done", response=response)

    async def read_answer(self, turn: int, text_delta: str, where: dict[str, Any]) -> dict[str, Any]:
        """Stream the answer from decode as `text_delta` events; its summary (a cancelled one included).

        One event per read: everything decode sent while the client was slow to take the last one (the router's
        stream joins what is queued) goes out as one delta. A slow reader gets fewer, larger deltas, never less
        text, and never holds the engine: decode pumps into its outbox and the router's feed queues it here."""
        connection = self.connection
        reader = self.reader = AnswerReader(connection.ingress, connection.session_id, turn)

        async def read() -> None:
            if self.cancel_requested:
                raise asyncio.CancelledError
            if (err := await reader.open()) is not None:
                reader.outcome.status, reader.outcome.error = "failed", err.get("error", err)
                return
            async for _, deltas in reader.items():
                if delta := "".join(deltas):
                    await connection.send(text_delta, **where, content_index=0, delta=delta)

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
            logger.exception("session %s: response failed", connection.session_id)
            reader.release()
            reader.outcome.status = "failed"
            reader.outcome.error = {"message": f"the response failed: {e}", "type": "server_error", "code": 500}
        finally:
            self.reading = self.reader = None
        if reader.summary is not None:
            return reader.summary
        return reader.outcome.as_dict()
