"""A spoken turn's transcript in the session's input (router/realtime/audio.py `AudioInput` holds one).

Each new transcript of the turn so far (speech/utterance.py) is sent as deltas where two successive transcripts
agree, and revises the session's input text through the update mode (`session_buffer` append, or replace from the
first changed character: only the changed suffix is prefilled again). As the user speaks only settled words go in
(agreed, and not the newest transcript's last `SETTLED_WORDS`); at a pause the whole transcript, and a session with
preemptive answers starts its answer from it (`session_preempt`). At the end of the turn: the final transcript,
the committed user item, and the answer. Text typed while a turn is spoken stays before its transcript.
"""

from __future__ import annotations

import os
from typing import Protocol

from router.realtime.connection import VoiceConnection
from router.realtime.events import new_id
from router.sessions.owner import session_buffer, session_preempt
from speech.client import MODEL_RATE, TranscriptionFailed, Utterance

SETTLED_WORDS = 2  # words at a partial transcript's end kept out of the LLM's input until the pause


def common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix((a, b)))


def stable_prefix(a: str, b: str) -> str:
    """What two successive transcripts agree on, up to the last whole word (LocalAgreement-2)."""
    n = common_prefix(a, b)
    if n == len(a) == len(b):
        return a
    cut = a.rfind(" ", 0, n + 1)
    return a[:cut] if cut > 0 else ""


def settled(agreed: str, newest: str) -> str:
    """`agreed` (a prefix of `newest`, whole words) less the words within SETTLED_WORDS of `newest`'s end."""
    edge = len(newest)
    for _ in range(SETTLED_WORDS):
        edge = max(newest.rfind(" ", 0, edge), 0)
    return agreed[: min(len(agreed), edge)].rstrip()


class InputMode(Protocol):
    """What the spoken turn needs of its audio input (router/realtime/audio.py): how the turn's text is used."""

    vllm_flow: bool  # vLLM's realtime client: `transcription.delta` / `transcription.done`

    @property
    def transcription_only(self) -> bool: ...


class SpokenTurn:
    """The turn being spoken: its transcript in the session's input, typed text beside it, and the turn's end."""

    def __init__(self, connection: VoiceConnection, mode: InputMode) -> None:
        self.conn = connection
        self.mode = mode
        self.turn: Utterance | None = None  # the turn's audio, transcribed as it grows (None: nobody speaks)
        self.item_id: str | None = None
        self.offset = 0  # where the turn's transcript starts in the session's input text
        self.shown = ""  # transcript text sent as deltas
        self.previous = ""  # the transcript before the latest (for the deltas' agreement)

    def begin(self, turn: Utterance) -> None:
        """`turn` is the turn from now on; its transcript goes after the text typed so far."""
        self.item_id = new_id("item")
        self.offset = len(self.conn.conversation.buffer)
        self.shown = self.previous = ""
        self.turn = turn

    # --- typed text beside a spoken turn ----------------------------------------------------------------
    @property
    def speaking(self) -> bool:
        """A spoken turn is in progress, its transcript at the end of the session's input text."""
        return self.turn is not None and not self.mode.transcription_only

    def typed_text(self) -> str:
        buffer = self.conn.conversation.buffer
        return buffer[: self.offset] if self.speaking else buffer

    async def typed(self, offset: int, text: str) -> bool:
        """The typed text from `offset` on becomes `text`, before the transcript of a spoken turn in progress
        (the caller holds the lock). Whether the owner took it."""
        conn, conversation = self.conn, self.conn.conversation
        transcript = conversation.buffer[self.offset :] if self.speaking else ""
        typed = self.typed_text()
        if offset == len(typed) and not transcript:
            ok = await conn.call(session_buffer, op="append", text=text)
        else:
            ok = await conn.call(session_buffer, op="replace", text=text + transcript, offset=offset)
        if ok:
            conversation.buffer = typed[:offset] + text + transcript
            if self.speaking:
                self.offset = offset + len(text)
        return ok is not None

    # --- the turn ----------------------------------------------------------------------------------
    async def on_text(self, text: str, delay: float, turn: Utterance | None = None) -> None:
        """A new transcript of the turn so far: agreed text sent as deltas and into the session's input; at a pause,
        the whole transcript, and the preemptive answer starts from it."""
        if self.turn is None or (turn is not None and turn is not self.turn):
            return  # (a late transcript of a turn that ended: the end's own transcript decided)
        agreed = stable_prefix(self.previous, text)
        self.previous = text
        if not self.mode.transcription_only:
            if turn is not None and turn.at_pause:
                await self.revise(text, turn)
                if self.conn.settings.values.get("preemptive") is not None:
                    await self.conn.call(session_preempt)  # (not waiting for the input to idle)
            else:
                # As the user speaks, the words two transcripts agree on (LocalAgreement-2) that are SETTLED_WORDS
                # behind the newest one's end (a recognizer revises its last words most): few of them change
                # again, so little of the input is prefilled twice; the rest comes at the pause.
                await self.revise(settled(agreed, text), turn, grow_only=True)
        await self.delta(agreed)

    async def delta(self, text: str) -> None:
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return
        delta, self.shown = text[len(self.shown) :], text
        if self.mode.vllm_flow:
            await self.conn.send("transcription.delta", delta=delta)
        else:
            await self.conn.send(
                "conversation.item.input_audio_transcription.delta", item_id=self.item_id, content_index=0, delta=delta
            )

    async def revise(self, text: str, turn: Utterance | None = None, grow_only: bool = False) -> None:
        """The turn's part of the session's input text becomes `text` (only what changed is sent). `turn`: only
        while that utterance is the turn (a partial transcript that lost the race with the turn's end is dropped).
        `grow_only`: not if the input already starts with it (agreed words never cut the pause's transcript)."""
        conversation = self.conn.conversation
        async with conversation.lock:
            if turn is not None and turn is not self.turn:
                return
            current = conversation.buffer[self.offset :]
            joined = text if not conversation.buffer[: self.offset] or not text else " " + text  # (after typed text)
            if current == joined or (grow_only and current.startswith(joined)):
                return
            n = common_prefix(current, joined)
            if n == len(current):
                ok = await self.conn.call(session_buffer, op="append", text=joined[n:])
            else:
                ok = await self.conn.call(session_buffer, op="replace", text=joined[n:], offset=self.offset + n)
            if ok:
                conversation.buffer = conversation.buffer[: self.offset] + joined

    async def end_turn(self, end: int, respond: bool) -> None:
        """The turn's audio up to `end` is final: its transcript, the committed item, and the answer."""
        conversation = self.conn.conversation
        async with conversation.lock:  # (a partial's revision in flight finishes first; none starts after)
            turn, item_id = self.turn, self.item_id
            assert turn is not None and item_id is not None
            self.turn = None
        try:
            text = await turn.final(end)
        except TranscriptionFailed as e:
            await self.failed(item_id, e)
            return
        finally:
            turn.close()
        await self.delta(text)
        # As vLLM's Whisper serving reports it (OpenAI's `duration` usage): the turn's audio seconds.
        usage = {"type": "duration", "seconds": round(end / MODEL_RATE, 3)}
        if self.mode.vllm_flow:
            await self.conn.send("transcription.done", text=text, usage=usage)
            return
        committed = {"previous_item_id": conversation.last_item_id, "item_id": item_id}
        await self.conn.send("input_audio_buffer.committed", **committed)
        part = {"type": "input_audio", "transcript": text}

        async def completed() -> None:
            await self.conn.send(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=text,
                usage=usage,
            )

        if not self.mode.transcription_only:
            await self.revise(text)
        if self.mode.transcription_only or not conversation.buffer.strip():  # (nothing was said: nothing to answer)
            await conversation.announce_item(item_id, "user", [part])
            await completed()
        elif respond:  # (a held preemptive answer made from this input leaves before the owner's commit)
            await conversation.commit_and_respond(item_id, [part], completed)
        else:
            await conversation.commit_input(item_id, [part])
            await completed()

    async def failed(self, item_id: str, e: TranscriptionFailed) -> None:
        """The recognizer failed: the turn's audio is not lost silently: the client hears of it, and the session
        and every other turn go on. Its text so far leaves the session's input."""
        if not self.mode.transcription_only:
            await self.revise("")
        error = {"type": "server_error", "code": e.code, "message": e.message, "param": None}
        if self.mode.vllm_flow:
            await self.conn.send("error", error=e.message, code=e.code)
            return
        await self.conn.send(
            "conversation.item.input_audio_transcription.failed", item_id=item_id, content_index=0, error=error
        )

    async def clear(self) -> None:
        """`input_audio_buffer.clear`: the turn is dropped, and its text leaves the session's input."""
        async with self.conn.conversation.lock:  # (no revision of the turn in flight)
            turn, self.turn = self.turn, None
        if turn is not None:
            turn.close()
            if not self.mode.transcription_only:
                await self.revise("")

    def close(self) -> None:
        if self.turn is not None:
            self.turn.close()
