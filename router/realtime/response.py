"""One `/v1/realtime` response: the answer of a turn, read from decode and sent as `response.*` events.

`response.create` (router/realtime/conversation.py) starts a `ResponseStream` once the owner prefill replica has handed
the turn to decode; it sends `response.created`, the output item and content part, one text delta per read (a slow
reader gets fewer, larger deltas), then the `done` events and `response.done` with the status and usage.
`response.cancel` stops the reading: the response still ends with `response.done`, status `cancelled`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from router.openai.tool_calls import function_call_item
from router.realtime.events import new_id
from router.sessions.answers import AnswerReader
from router.sessions.provisional import Provisional

logger = logging.getLogger(__name__)


class Connection(Protocol):
    """What a response needs of its connection (router/realtime/socket.py)."""

    ingress: Any
    session_id: str | None
    beta: bool

    async def send(self, type_: str, **fields: Any) -> None: ...


class ConversationItems(Protocol):
    """What a response needs of its conversation (router/realtime/conversation.py): the items it adds."""

    last_item_id: str | None
    items: set[str]  # the conversation's item ids (a truncate names one)
    answer_item: str | None  # the last response's message item (the answer a truncate may cut)


class InputSeen:
    """The input (prefill/preemptive.py `input_tag`) the owner's reply to a connection's last session call named:
    `response.create` releases a held preemptive answer made from it (`EarlyRead.release`). None while a call is
    in flight, and after calls that overlapped (their replies may come in another order than the owner applied
    them)."""

    def __init__(self) -> None:
        self.tag: str | None = None
        self._in_flight = self._calls = 0

    async def call(self, call: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        alone, self.tag = not self._in_flight, None
        self._in_flight += 1
        self._calls += 1
        mine = self._calls
        try:
            result = await call
        finally:
            self._in_flight -= 1
        if alone and mine == self._calls:
            self.tag = (result.get("preemptive") or {}).get("input")
        return result


class EarlyRead:
    """The next turn's answer, read before `response.create` when the session answers preemptively: its reader
    waits for the turn from now on and holds the preemptive answer's frames (router/sessions/provisional.py), so that
    the response's first delta needs no call to decode; with `preemptive.stream`, the text of each preemptive
    answer goes out as `rtpd.response.provisional.delta` events, then `rtpd.response.provisional.done` (status
    `confirmed` or `discarded`)."""

    def __init__(self, connection: Connection, turn: int) -> None:
        self.connection, self.turn = connection, turn
        self.events: asyncio.Queue[Provisional | None] = asyncio.Queue()  # (None: no more)
        assert connection.session_id is not None
        self.reader = AnswerReader(connection.ingress, connection.session_id, turn, "realtime", self.events)
        self.opening = asyncio.create_task(self.reader.open())
        self.relay = asyncio.create_task(self._relay())

    async def _relay(self) -> None:
        while (event := await self.events.get()) is not None:
            await self._send(event)

    async def _send(self, event: Provisional) -> None:
        kind, fields = event
        await self.connection.send(f"rtpd.response.provisional.{'delta' if kind == 'delta' else 'done'}", **fields)

    def usable(self) -> bool:
        """Whether it can read the answer (it did not fail while waiting: then the response reads it anew)."""
        if not self.opening.done():
            return True
        return not self.opening.cancelled() and self.opening.exception() is None and self.opening.result() is None

    def release(self, tag: str | None) -> bool:
        """`response.create` with nothing of its own: whether the held preemptive answer was made from the input
        `tag` names (the owner's reply to the connection's last call), so that it is the answer from now on and
        its first delta needs no call to the owner (router/sessions/provisional.py `release_input`)."""
        return self.usable() and self.reader.held is not None and self.reader.held.release_input(tag)

    def revoke(self, error: dict[str, Any]) -> None:
        """The owner refused the `response.create` that released it: the response ends with an error, not it."""
        if self.reader.held is not None:
            self.reader.held.revoke(error)

    async def open(self) -> dict[str, Any] | None:
        """The reader's `open()`, once the answer is asked for; the provisional events go out before its own."""
        self.reader.requested()
        try:
            return await self.opening
        finally:
            self.events.put_nowait(None)  # every event queued so far goes out first, none cut off midway
            await asyncio.gather(self.relay, return_exceptions=True)

    def close(self) -> None:
        """Not needed after all (the connection closes, or the response reads its answer anew)."""
        self.opening.cancel()
        self.relay.cancel()
        self.reader.release()


class ResponseStream:
    """The response to one `response.create`, streaming in a task of its own from construction on."""

    def __init__(
        self, connection: Connection, conversation: ConversationItems, turn: int, early: EarlyRead | None = None
    ) -> None:
        self.early = early  # its answer's reader, opened before it was asked for
        self.connection, self.conversation = connection, conversation
        self.reading: asyncio.Task[None] | None = None  # the answer's stream from decode (response.cancel stops it)
        self.cancel_requested = False
        self.cancel_reason = "client_cancelled"  # (speech that interrupts it: `turn_detected`)
        self.reader: AnswerReader | None = None
        self.output: Output | None = None
        self.task = asyncio.create_task(self.stream(turn))

    @property
    def done(self) -> bool:
        return self.task.done()

    async def cancel(self, reason: str = "client_cancelled") -> None:
        """response.cancel (or speech, `turn_detected`): the response ends as cancelled (its `response.done`
        sent) before this returns."""
        self.cancel_reason = reason
        self.cancel_requested = True  # read before the reading starts, too
        if self.reader is not None:
            self.reader.cancel()  # reported cancelled (not released), and the stream from decode stops
        if self.reading is not None:
            self.reading.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def stream(self, turn: int) -> None:
        connection = self.connection
        response_id = new_id("resp")
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress", "output": []}
        await connection.send("response.created", response=response)
        output = self.output = Output(connection, self.conversation, response_id)
        summary = await self.read_answer(turn)
        items = await output.close(summary)
        self.conversation.last_item_id = items[-1]["id"]
        status, details = summary.get("status"), None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": self.cancel_reason}
        elif status == "completed" and summary.get("finish_reason") == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        elif status == "failed":
            details = {"type": "failed", "error": summary.get("error")}
        usage = summary.get("usage") or {}
        response.update(
            status=status,
            status_details=details,
            output=items,
            usage={
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
            },
        )
        await connection.send("response.done", response=response)

    async def read_answer(self, turn: int) -> dict[str, Any]:
        """Stream the answer from decode as output items' events; its summary (a cancelled one included).

        One event per read: everything decode sent while the client was slow to take the last one (the router's
        stream joins what is queued) goes out as one delta. A slow reader gets fewer, larger deltas, never less
        text, and never holds the engine: decode pumps into its outbox and the router's feed queues it here."""
        connection = self.connection
        early, self.early = self.early, None
        if early is not None:
            reader = self.reader = early.reader
        else:
            reader = self.reader = AnswerReader(connection.ingress, connection.session_id, turn, surface="realtime")

        async def read() -> None:
            if self.cancel_requested:
                raise asyncio.CancelledError
            if (err := await (early.open() if early is not None else reader.open())) is not None:
                reader.outcome.status, reader.outcome.error = "failed", err.get("error", err)
                return
            async for _, deltas in reader.items():
                await self.output.add(deltas, reader.outcome.tool_calls)

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


class Output:
    """A response's output items as their events go out: the message (its text) and one `function_call` item per
    tool call, in the order the answer makes them. An item is opened when its first piece arrives and done before
    the next one opens; a response with no output at all still has its (empty) message."""

    def __init__(self, connection: Connection, conversation: ConversationItems, response_id: str) -> None:
        self.connection, self.conversation, self.response_id = connection, conversation, response_id
        self.items: list[dict[str, Any]] = []  # their final form, for `response.done`
        self.text = ""
        self.message: dict[str, Any] | None = None  # the message item, while it is open
        self.calls_sent: list[int] = []  # per call begun: how much of its arguments went out
        self.open_call: int | None = None
        self.calls: list[dict[str, Any]] = []  # the calls as they stand

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": item["id"], "output_index": self.items.index(item)}

    async def add(self, deltas: list[str], calls: list[dict[str, Any]]) -> None:
        """What one read brought: text deltas, and the calls as they stand so far."""
        self.calls = calls
        if delta := "".join(deltas):
            await self._text(delta)
        for index, call in enumerate(calls):
            if index >= len(self.calls_sent):
                if not call["function"]["name"]:
                    break  # (its name has not arrived yet)
                await self._open_call(call)
            sent = self.calls_sent[index]
            if index == self.open_call and len(arguments := call["function"]["arguments"]) > sent:
                self.calls_sent[index] = len(arguments)
                item = self.items[-1]
                await self.connection.send(
                    "response.function_call_arguments.delta",
                    **self._where(item),
                    call_id=item["call_id"],
                    delta=arguments[sent:],
                )

    async def close(self, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """Every item done (calls the stream did not show, e.g. in a replay, sent whole); the final items."""
        text = summary.get("text") or ""
        if len(text) > len(self.text):
            await self._text(text[len(self.text) :])
        calls = summary.get("tool_calls") or []
        if len(calls) > len(self.calls_sent):
            await self.add([], calls)
        if self.message is None and not self.items:
            await self._open_message()
        # Cut by max_output_tokens: the item the cut fell in is `incomplete`, as OpenAI marks it.
        await self._done(cut=summary.get("status") == "completed" and summary.get("finish_reason") == "length")
        return self.items

    async def _text(self, delta: str) -> None:
        if self.message is None:
            await self._done()
            await self._open_message()
        assert self.message is not None
        self.text += delta
        beta = self.connection.beta
        name = "response.text.delta" if beta else "response.output_text.delta"
        await self.connection.send(name, **self._where(self.message), content_index=0, delta=delta)

    async def _open_message(self) -> None:
        item_id = new_id("item")
        message = {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant"}
        message.update(status="in_progress", content=[])
        self.items.append(message)
        self.message = message
        self.conversation.items.add(item_id)
        self.conversation.answer_item = item_id
        send = self.connection.send
        await send(
            "response.output_item.added", response_id=self.response_id, output_index=len(self.items) - 1, item=message
        )
        part = {"type": "text", "text": ""}
        await send("response.content_part.added", **self._where(message), content_index=0, part=part)

    async def _open_call(self, call: dict[str, Any]) -> None:
        await self._done()
        item = function_call_item(call, new_id("item"), "in_progress")
        self.conversation.items.add(item["id"])
        self.items.append(item)
        self.calls_sent.append(0)
        self.open_call = len(self.calls_sent) - 1
        await self.connection.send(
            "response.output_item.added", response_id=self.response_id, output_index=len(self.items) - 1, item=item
        )

    async def _done(self, cut: bool = False) -> None:
        """The open item is done (the message with its text, or a call with its whole arguments). `cut`: the
        answer ended inside it (max_output_tokens): `incomplete`, and a call's arguments are not announced done
        (a client that runs calls on that event would run half of its JSON)."""
        send = self.connection.send
        if self.message is not None:
            message, self.message = self.message, None
            text, where = self.text, self._where(message)
            await send(
                "response.text.done" if self.connection.beta else "response.output_text.done",
                **where,
                content_index=0,
                text=text,
            )
            await send("response.content_part.done", **where, content_index=0, part={"type": "text", "text": text})
            message.update(status="incomplete" if cut else "completed", content=[{"type": "text", "text": text}])
            await send(
                "response.output_item.done",
                response_id=self.response_id,
                output_index=where["output_index"],
                item=message,
            )
        elif self.open_call is not None:
            index, self.open_call = self.open_call, None
            item = self.items[-1]
            arguments = self.calls[index]["function"]["arguments"]
            where = self._where(item)
            if not cut:
                await send(
                    "response.function_call_arguments.done",
                    **where,
                    call_id=item["call_id"],
                    name=item["name"],
                    arguments=arguments,
                )
            item.update(status="incomplete" if cut else "completed", arguments=arguments)
            await send(
                "response.output_item.done", response_id=self.response_id, output_index=where["output_index"], item=item
            )
