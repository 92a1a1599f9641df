"""One `/v1/realtime` response: the answer of a turn, read from decode and sent as `response.*` events.

`response.create` (router/realtime/conversation.py) starts a `ResponseStream` once the owner prefill replica has handed
the turn to decode; it sends `response.created`, the output items (router/realtime/output.py: one text delta per read,
a slow reader getting fewer, larger deltas; or the answer spoken), then `response.done` with the status and usage.
`response.cancel` (or speech over the answer) stops the reading and the audio: the response still ends with
`response.done`, status `cancelled`; a spoken answer cut short is cut in the session's conversation too, to what the
user heard of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from router.realtime.audio_settings import OutputAudio
from router.realtime.early_speech import EarlySpeech
from router.realtime.events import Sampling, new_id
from router.realtime.output import Connection as OutputConnection
from router.realtime.output import ConversationItems, Output, Voiced
from router.sessions.answers import AnswerReader
from router.sessions.owner import session_truncate
from router.sessions.provisional import Provisional

logger = logging.getLogger(__name__)


class SpeechSettings(Voiced, Protocol):
    """The session's settings as a response needs them (router/realtime/settings.py): how it speaks."""

    def speech(self, response: Sampling | None = None) -> OutputAudio | None: ...


class Connection(OutputConnection, Protocol):
    """What a response needs of its connection (router/realtime/socket.py)."""

    session_id: str | None

    @property
    def settings(self) -> SpeechSettings: ...


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
    `confirmed` or `discarded`). A session that speaks has the held answer's first sentence synthesized meanwhile
    (router/realtime/early_speech.py), for the response to send if this answer becomes it."""

    def __init__(self, connection: Connection, turn: int) -> None:
        self.connection, self.turn = connection, turn
        self.events: asyncio.Queue[Provisional | None] = asyncio.Queue()  # (None: no more)
        assert connection.session_id is not None
        tts = getattr(connection.ingress, "tts", None)
        self.speech = EarlySpeech(connection, connection.settings.speech) if tts is not None else None
        watch = self.speech.watch if self.speech is not None else None
        self.reader = AnswerReader(connection.ingress, connection.session_id, turn, "realtime", self.events, watch)
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
        if self.speech is not None:
            self.speech.retire()


class ResponseStream:
    """The response to one `response.create`, streaming in a task of its own from construction on."""

    def __init__(
        self,
        connection: Connection,
        conversation: ConversationItems,
        turn: int,
        early: EarlyRead | None = None,
        speech: OutputAudio | None = None,
    ) -> None:
        self.early = early  # its answer's reader, opened before it was asked for
        self.speech = speech  # how it is spoken (None: text)
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
        try:
            if self.output is not None:
                await self.output.interrupt()  # the audio stops first: nothing more is heard
        except Exception:  # (its own failure: the reading stops all the same, and the response ends)
            logger.exception("session %s: the response's audio did not stop cleanly", self.connection.session_id)
        finally:
            if self.reader is not None:
                self.reader.cancel()  # reported cancelled (not released), and the stream from decode stops
            if self.reading is not None:
                self.reading.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def stream(self, turn: int) -> None:
        connection = self.connection
        response_id = new_id("resp")
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress", "output": []}
        speech, ready = self.speech, self.early.speech if self.early is not None else None
        if speech is not None:  # (as OpenAI's response object shows how it speaks)
            response.update(self.shown(speech))
        output: Output | None = None
        closed = False
        try:
            await connection.send("response.created", response=response)
            output = self.output = Output(connection, self.conversation, response_id, speech, ready)
            summary = await self.read_answer(turn)
            items = await output.close(summary)  # (a spoken answer: once its audio is out, or interrupted)
            closed = True
        finally:
            if not closed:  # cancelled (the connection closes), or a send failed: nothing of it goes on
                if output is not None:
                    output.abort()
                if self.early is not None:  # (its reader never taken: its claim let go, its early speech closed)
                    self.early.close()
                    self.early = None
        assert output is not None
        self.conversation.last_item_id = items[-1]["id"]
        if (heard := output.heard) is not None:  # interrupted while spoken: the conversation keeps what was heard
            if heard < output.length and summary.get("status") == "completed":
                summary = {**summary, "status": "cancelled"}  # (its text had all come; its audio had not all gone)
            await self.cut_to(heard)
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

    def shown(self, speech: OutputAudio) -> dict[str, Any]:
        """How it speaks, as OpenAI's response object shows it."""
        if self.connection.beta:
            return {"modalities": ["text", "audio"], "output_audio_format": speech.format.beta(), "voice": speech.voice}
        output = {"format": speech.format.ga(), "voice": speech.voice}
        return {"output_modalities": ["audio"], "audio": {"output": output}}

    async def cut_to(self, chars: int) -> None:
        """A spoken answer interrupted: the session's conversation keeps what the user heard of it (as a truncate
        does), before `response.done` (the client's next turn is answered from it)."""
        try:
            await session_truncate(self.connection.ingress, self.connection.session_id, chars=chars)
        except Exception:  # (the answer stays whole in the conversation; the client may still truncate it)
            logger.warning("session %s: could not cut the interrupted answer", self.connection.session_id)

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
