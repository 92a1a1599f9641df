"""A realtime response's output items as their events go out (router/realtime/response.py `ResponseStream` holds
one): the message, and one `function_call` item per tool call, in the order the answer makes them.

A text response's message has a `text` part: `response.output_text.delta` per read, then `.done` [beta:
`response.text.*`]. An audio response's message has an `audio` part instead, and no text events (as OpenAI's): its
text goes to be spoken (router/realtime/audio_out.py `AudioOut`: the transcript and audio deltas), then
`response.output_audio.done`, `response.output_audio_transcript.done {transcript}` [beta: `response.audio.*`,
`response.audio_transcript.*`], and the item's content `{"type": "output_audio", "transcript"}` [beta: `audio`].
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from core import metrics
from router.openai.tool_calls import function_call_item
from router.realtime.audio_out import AudioOut, Ready, Speaking
from router.realtime.audio_settings import OutputAudio
from router.realtime.events import new_id


class Voiced(Protocol):
    """The session's settings (router/realtime/settings.py): the voice it first spoke in."""

    voiced: str | None

    def voice_spoken(self, voice: str) -> None: ...  # (fixed from now on; the owner keeps it for a re-attach)


class Connection(Speaking, Protocol):
    """What a response's output needs of its connection (router/realtime/socket.py)."""

    @property
    def settings(self) -> Voiced: ...


class ConversationItems(Protocol):
    """What a response needs of its conversation (router/realtime/conversation.py): the items it adds."""

    last_item_id: str | None
    items: set[str]  # the conversation's item ids (a truncate names one)
    answer_item: str | None  # the last response's message item (the answer a truncate may cut)
    answer_audio: AudioOut | None  # that message's audio, when it was spoken (a truncate cuts it by audio_end_ms)


class Output:
    """A response's output items. An item is opened when its first piece arrives and done before the next one
    opens; a response with no output at all still has its (empty) message. `speech`: the answer is spoken so
    (None: text); `ready`: its first sentence, synthesized already (a preemptive answer's)."""

    def __init__(
        self,
        connection: Connection,
        conversation: ConversationItems,
        response_id: str,
        speech: OutputAudio | None = None,
        ready: Ready | None = None,
    ) -> None:
        self.connection, self.conversation, self.response_id = connection, conversation, response_id
        self.items: list[dict[str, Any]] = []  # their final form, for `response.done`
        self._text: list[str] = []  # the answer's text so far, as it came (joined when needed)
        self.length = 0  # its length
        self.message: dict[str, Any] | None = None  # the message item, while it is open
        self.calls_sent: list[int] = []  # per call begun: how much of its arguments went out
        self.open_call: int | None = None
        self.calls: list[dict[str, Any]] = []  # the calls as they stand
        self.speech, self.ready = speech, ready
        if speech is None:  # (a text response: a preemptive answer's audio is of no use)
            self._retire_ready()
        self.spoken: AudioOut | None = None  # the last message's audio
        self.interrupted = False
        self.started = time.monotonic()  # (the response's start: its first audio's latency)
        self.first_audio = False

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": item["id"], "output_index": self.items.index(item)}

    async def add(self, deltas: list[str], calls: list[dict[str, Any]]) -> None:
        """What one read brought: text deltas, and the calls as they stand so far."""
        self.calls = calls
        if delta := "".join(deltas):
            await self._add_text(delta)
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
        """Every item done (calls the stream did not show, e.g. in a replay, sent whole; a spoken message's audio
        all sent, unless interrupted meanwhile); the final items."""
        text = summary.get("text") or ""
        if len(text) > self.length:
            await self._add_text(text[self.length :])
        calls = summary.get("tool_calls") or []
        if len(calls) > len(self.calls_sent):
            await self.add([], calls)
        if self.message is None and not self.items:
            await self._open_message()
        # Cut by max_output_tokens: the item the cut fell in is `incomplete`, as OpenAI marks it.
        await self._done(cut=summary.get("status") == "completed" and summary.get("finish_reason") == "length")
        self._retire_ready()  # (no message was spoken)
        return self.items

    async def interrupt(self) -> None:
        """Barge-in or cancel: the audio stops now (what was heard is the spoken message's transcript)."""
        self.interrupted = True
        try:
            if self.spoken is not None:
                await self.spoken.interrupt()
        finally:
            self._retire_ready()

    def abort(self) -> None:
        """The response's task was cancelled (the connection closes) or failed: nothing of its audio goes on."""
        if self.spoken is not None:
            self.spoken.abort()
        self._retire_ready()

    def _retire_ready(self) -> None:
        if self.ready is not None:
            self.ready.retire()
            self.ready = None

    @property
    def heard(self) -> int | None:
        """Interrupted while spoken: how much of the answer's text the user heard (None: not interrupted)."""
        spoken = self.spoken
        return None if spoken is None or spoken.cut is None else spoken.base + spoken.cut

    @property
    def text(self) -> str:
        """The answer's text so far."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    async def _add_text(self, delta: str) -> None:
        if self.message is None:
            await self._done()
            await self._open_message()
        assert self.message is not None
        self._text.append(delta)
        self.length += len(delta)
        if self.spoken is not None and self.spoken.item_id == self.message["id"]:
            self.spoken.add(delta)  # (its transcript goes out with its audio)
            return
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
        self.conversation.answer_audio = None
        send = self.connection.send
        await send(
            "response.output_item.added", response_id=self.response_id, output_index=len(self.items) - 1, item=message
        )
        part: dict[str, Any] = {"type": "text", "text": ""}
        if self.speech is not None:
            part = {"type": "audio", "transcript": ""}
            ready, self.ready = self.ready, None
            self.spoken = AudioOut(
                self.connection, self._where(message), self.speech, self._spoke, ready, self.length, self.interrupted
            )
            self.conversation.answer_audio = self.spoken
        await send("response.content_part.added", **self._where(message), content_index=0, part=part)

    def _spoke(self, seconds: float) -> None:
        """Audio went out: counted, the response's first timed, and the session's voice settled."""
        metrics.inc(metrics.AUDIO_OUT_SECONDS, seconds, metrics.AUDIO_OUT, surface="realtime")
        if not self.first_audio:
            self.first_audio = True
            waited = time.monotonic() - self.started
            metrics.observe(metrics.FIRST_AUDIO_SECONDS, waited, metrics.FIRST_AUDIO, surface="realtime")
            settings = self.connection.settings
            if settings.voiced is None and self.speech is not None:
                settings.voice_spoken(self.speech.voice)

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
            where = self._where(message)
            if self.spoken is not None and self.spoken.item_id == message["id"]:
                await self._audio_done(message, where)
            else:
                text = self.text
                await send(
                    "response.text.done" if self.connection.beta else "response.output_text.done",
                    **where,
                    content_index=0,
                    text=text,
                )
                part = {"type": "text", "text": text}
                await send("response.content_part.done", **where, content_index=0, part=part)
                message["content"] = [part]
            message["status"] = "incomplete" if cut else "completed"
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

    async def _audio_done(self, message: dict[str, Any], where: dict[str, Any]) -> None:
        """A spoken message's end: its audio all sent (or interrupted), then the `done` events with its transcript."""
        assert self.spoken is not None
        transcript = await self.spoken.finish()
        send, beta = self.connection.send, self.connection.beta
        kind = "response.audio" if beta else "response.output_audio"
        await send(f"{kind}.done", **where, content_index=0)
        await send(f"{kind}_transcript.done", **where, content_index=0, transcript=transcript)
        part = {"type": "audio", "transcript": transcript}
        await send("response.content_part.done", **where, content_index=0, part=part)
        message["content"] = [{"type": "audio" if beta else "output_audio", "transcript": transcript}]
