"""A streaming-input session as its owner prefill replica holds it.

The session keeps its whole input (chat messages or completion text, so it can be replayed), an ordered
chunk log, a state (open → prefilling → answering → open … closed), an idle deadline and a size cap. Its
input is always tokenised as a whole; only the *stable* part is streamed to the engine: everything but the
in-progress text after its last whitespace, which a later chunk may still extend (a chunk boundary inside a
word) — see `stable_tokens`. At end of input the whole input is rendered exactly as one ordinary request
would be, and that request is the hand-off (see prefill/streaming.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable
from enum import Enum
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from prefill.answer import Answer
from prefill.conversation import Conversation, SessionError  # (SessionError: imported from here too)
from prefill.preempt_state import PreemptState
from prefill.streaming import StreamingPrefill

MAX_REMEMBERED_CALLS = 64
# A session whose client's connection was held by a router replica that died (realtime, NDJSON) is closed this long
# after: time for the client to reconnect through another router and re-attach (a realtime `?session_id=`).
ORPHAN_GRACE_S = 15.0


class SessionState(str, Enum):
    OPEN = "open"  # accepting input, nothing prefilled yet (or start policy not met)
    PREFILLING = "prefilling"  # input is being prefilled as it arrives
    ANSWERING = "answering"  # an answer is being handed off or streamed (decode → router → client)
    CLOSED = "closed"


class StartPolicy(BaseModel):
    """When prefill starts (the vLLM-Omni streaming-input RFC's policies)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["on_first_chunk", "on_min_length", "on_end_only"] = "on_first_chunk"
    min_tokens: int = Field(default=256, ge=1)  # for on_min_length


class SessionLimits(BaseModel):
    """One session's limits: the server's (`limits` in the app config, core/config.py LimitsConfig), or
    lower ones the client asked for (`within`)."""

    model_config = ConfigDict(extra="forbid")
    idle_timeout_s: float = Field(default=300.0, gt=0)
    max_session_s: float = Field(default=3600.0, gt=0)
    max_payload_bytes: int = Field(default=1_000_000, gt=0)
    max_chunk_bytes: int = Field(default=256 << 10, gt=0)
    max_pending_chunks: int = Field(default=64, gt=0)
    gap_timeout_s: float = Field(default=10.0, gt=0)  # how long an out-of-order chunk waits for its gap
    # How long a router may stream one answer before the owner gives up on hearing how it ended.
    answer_timeout_s: float = Field(default=600.0, gt=0)

    @classmethod
    def of_server(cls, limits: Any) -> SessionLimits:
        fields = {name: getattr(limits, name) for name in cls.model_fields if name != "max_payload_bytes"}
        return cls(max_payload_bytes=limits.max_session_payload_bytes, **fields)

    def within(self, asked: dict[str, Any]) -> SessionLimits:
        """The client's limits, each at most the server's (ValueError naming the field otherwise)."""
        lowered = self.model_validate({**self.model_dump(), **asked})
        for name in asked:
            if getattr(lowered, name) > getattr(self, name):
                raise ValueError(f"{name}: at most {getattr(self, name):g} on this server", name)
        return lowered


class SessionJournal(Protocol):
    """What is called on a session's journal (prefill/journal.py `Journal`, which imports this module)."""

    def write(self, op: str, **fields: Any) -> Awaitable[None]: ...

    async def flush(self) -> None: ...

    async def forget(self) -> None: ...


def _landed() -> asyncio.Future[None]:
    """A write with no journal: already done (a future, not a coroutine, so that leaving it unawaited is fine)."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class Session:
    def __init__(
        self,
        session_id: str,
        endpoint: Literal["chat", "completion"],
        request: dict[str, Any],
        policy: StartPolicy,
        limits: SessionLimits,
        streaming: StreamingPrefill,
    ) -> None:
        self.id = session_id
        # Its messages (or prompt), instructions and input deferred past an answer (prefill/conversation.py).
        self.conversation = Conversation(endpoint, request, lambda: self.answering)
        self.policy = policy
        self.limits = limits
        self.streaming = streaming
        self.state = SessionState.OPEN
        self.buffer = ""  # in-progress text: the current user turn (chat) or the prompt's tail (completion)
        # Where the turn's audio transcript starts in `buffer` (REST audio chunks, `mode: "transcript"`): each such
        # chunk is the whole transcript so far, and replaces the one before from here.
        self.transcript_at: int | None = None
        self.chunk_log: list[dict[str, Any]] = []
        self.next_seq = 0
        self.pending: dict[int, tuple[float, dict[str, Any]]] = {}
        self.payload_bytes = 0
        self.input_ended = False
        self.answers: list[Answer] = []
        self.changed = asyncio.Condition()  # notified when an answer starts or changes status
        self.last_active = time.monotonic()
        self.last_chunk_at: float | None = None
        self.close_reason: str | None = None
        self.closed_at: float | None = None
        self.created_at = time.monotonic()
        # Calls on a session are applied one at a time, in arrival order (prefill/errors.py `serialized`):
        # Ray Serve runs a replica's async methods concurrently, and a chunk's apply + prefill spans awaits.
        self.lock = asyncio.Lock()
        # One request's session (an NDJSON body): it ends with its answer, whatever its router does after.
        self.ephemeral = False  # one request's session (an NDJSON body): its one reader leaving cancels the answer
        self.buffered = False  # its input waited for room to stream (residency control), at least once
        self.close_after_answer = False  # one turn only: closed when its answer ends, no re-prefill for a next turn
        self.audio: dict[str, Any] | None = None  # REST audio chunks' format (`{"rate", "language"}`), as created
        self.preempt: PreemptState | None = None  # its preemptive answers (prefill/preemptive.py), if it asked
        # What a realtime connection set that only the router uses (`given`: its audio and output settings;
        # `voiced`: the voice it spoke in), kept for a connection that re-attaches (router/realtime/settings.py
        # `SessionSettings.restore`); opaque here, its keys merged as they come.
        self.view: dict[str, Any] | None = None
        self.waiters = 0  # readers waiting for an answer (prefill/handoff.py `_waiting`)
        self.tenant = ""  # the id of the API key that created it (router/keys/auth.py); "" without keys
        # The router replica (its Ray actor's name) holding the client's connection (realtime, NDJSON): the client
        # is gone when it dies unless it re-attaches elsewhere (`orphaned`), and nobody else would close it.
        self.connection: str | None = None
        self.orphaned_at: float | None = None
        # Where its changes are recorded so that it outlives this replica (prefill/journal.py); None in unit tests.
        self.journal: SessionJournal | None = None
        # Ids of the last client calls applied (a call retried after a failover is acknowledged, not reapplied).
        self.applied_calls: OrderedDict[str, None] = OrderedDict()

    @property
    def endpoint(self) -> Literal["chat", "completion"]:
        return self.conversation.endpoint

    @property
    def request(self) -> dict[str, Any]:
        """The OpenAI request the answer is made from; its messages/prompt grow with the input."""
        return self.conversation.request

    def full_request(self, instructions: str | None = None) -> dict[str, Any]:
        """The ordinary OpenAI request equal to everything received so far (the in-progress text included);
        `instructions` replace the session's for one response."""
        return self.conversation.full_request(self.buffer, instructions)

    def stable_tokens(self, tokenizer: Any) -> list[int]:
        """Tokens of the input that no later chunk can change (`Conversation.stable_tokens`)."""
        return self.conversation.stable_tokens(tokenizer, self.buffer)

    def orphaned(self, now: float, connection_alive: bool) -> bool:
        """Whether the session's connection died with its router replica over `ORPHAN_GRACE_S` ago (and no
        client re-attached meanwhile): then nothing would ever close it but its idle timeout."""
        if connection_alive or self.connection is None:
            self.orphaned_at = None
            return False
        if self.orphaned_at is None:
            self.orphaned_at = now
        return now - self.orphaned_at > ORPHAN_GRACE_S

    def remember_call(self, call: str) -> None:
        self.applied_calls[call] = None
        if len(self.applied_calls) > MAX_REMEMBERED_CALLS:
            self.applied_calls.popitem(last=False)

    def record(self, op: str, **fields: Any) -> Awaitable[None]:
        """Journal a change (prefill/journal.py): called right after making it, awaited before the call that
        made it is acknowledged."""
        if self.journal is not None:
            return self.journal.write(op, **fields)
        return _landed()

    # --- input -------------------------------------------------------------------------------------
    def touch(self) -> None:
        self.last_active = time.monotonic()

    def check_open(self) -> None:
        if self.state == SessionState.CLOSED:
            raise SessionError(409, f"session {self.id} is closed ({self.close_reason})")

    def add_chunk(
        self,
        seq: int,
        payload: str,
        end_of_input: bool,
        mode: str = "append",
        offset: int | None = None,
        role: str = "user",
        tool_call_id: str | None = None,
        audio_start: bool = False,
    ) -> dict[str, Any]:
        """Apply chunks in sequence order; hold a gap, apply a duplicate once. Returns what happened.

        `mode: "replace"` (update mode) replaces the current turn's input from character `offset` (default 0)
        with `payload`, as a vector search replaces documents. `mode: "transcript"` (audio chunks, transcribed by
        the router's speech role): the payload is the turn's audio transcript so far, in place of the last one;
        `audio_start`: the speech replica began the turn's audio with it (one that already has a transcript lost its
        audio with a speech replica: 409).
        `role: "tool"`: the chunk is a tool's whole result, a `tool` message answering the call `tool_call_id` of
        the last answer."""
        self.check_open()
        self.touch()
        if seq < self.next_seq or seq in self.pending:  # a retry of what was applied: acknowledged, even now
            return {"duplicate": True, "applied": []}
        if self.answering:
            raise SessionError(409, "input arrived while the answer is being generated", "sequence_id")
        if seq - self.next_seq >= self.limits.max_pending_chunks:  # bounds what is held out of order
            raise SessionError(
                400,
                f"sequence_id {seq} is too far ahead: the next expected is {self.next_seq}, and at most "
                f"{self.limits.max_pending_chunks} chunks are held out of order",
                "sequence_id",
            )
        self.check_chunk(payload)
        if role == "tool":
            if mode != "append":
                raise SessionError(400, "a tool's result is a whole message: mode must be append", "mode")
            self.conversation.check_tool_result(tool_call_id)
        if mode == "append" and role == "user" and payload and self.transcript_at is not None:
            raise SessionError(
                409, "this turn is spoken: end its audio (an audio chunk with end_of_input) before typing", "modality"
            )
        if mode == "transcript":
            offset = None
            if audio_start and self.transcript_at is not None and seq == self.next_seq:
                raise SessionError(
                    409,
                    "the speech replica that held this turn's audio stopped, and the audio is lost: send the turn's "
                    "audio again after clearing its transcript (a `replace` chunk), or end the turn",
                    "payload",
                )
        if mode in ("replace", "transcript") and seq == self.next_seq:
            offset = self.transcript_offset() if mode == "transcript" else offset
            self._check_offset(offset or 0)  # applies now: refuse it before anything changes
            held = self.payload_bytes - len(self.buffer[offset or 0 :].encode())
            if held + len(payload.encode()) > self.limits.max_payload_bytes:
                raise SessionError(413, f"session payload cap of {self.limits.max_payload_bytes} bytes exceeded")
        else:
            self._count_payload(payload)
        chunk: dict[str, Any] = {"payload": payload, "end_of_input": end_of_input}
        if mode == "replace":
            chunk.update(mode="replace", offset=offset or 0)
        elif mode == "transcript":
            chunk.update(mode="transcript")
        if role == "tool":
            chunk.update(role="tool", tool_call_id=tool_call_id)
        self.pending[seq] = (time.monotonic(), chunk)
        applied = []
        while self.next_seq in self.pending:
            _, chunk = self.pending.pop(self.next_seq)
            if self.input_ended:  # a new turn after an answer
                self.input_ended = False
            if chunk.get("mode") == "transcript":
                if seq != self.next_seq:  # held out of order: its bytes were counted on arrival
                    self.payload_bytes -= len(chunk["payload"].encode())
                self.transcript_at = self.transcript_offset()
                self._replace(self.transcript_at, chunk["payload"], transcript=True)
            elif chunk.get("mode") == "replace":
                try:
                    self._check_offset(chunk["offset"])
                except SessionError as e:  # held out of order and invalid once its turn came: input is broken
                    e.message = f"chunk {self.next_seq}: {e.message}"
                    e.close = True
                    raise
                if seq != self.next_seq:  # held out of order: its bytes were counted on arrival
                    self.payload_bytes -= len(chunk["payload"].encode())
                self._replace(chunk["offset"], chunk["payload"])
            elif chunk.get("role") == "tool":
                self.commit_buffer()
                self.conversation.commit(
                    {"role": "tool", "tool_call_id": chunk["tool_call_id"], "content": chunk["payload"]}
                )
            else:
                self.buffer += chunk["payload"]
            self.chunk_log.append({"sequence_id": self.next_seq, **chunk})
            self.last_chunk_at = time.monotonic()
            applied.append(self.next_seq)
            self.next_seq += 1
            if chunk["end_of_input"]:
                self.input_ended = True
        return {"duplicate": False, "applied": applied, "pending": sorted(self.pending)}

    def check_chunk(self, text: str, param: str = "payload") -> None:
        if len(text.encode()) > self.limits.max_chunk_bytes:
            raise SessionError(413, f"one chunk holds at most {self.limits.max_chunk_bytes} bytes", param)

    def add_message(
        self,
        role: str,
        content: str,
        tool_call_id: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> None:
        """A whole conversation item (realtime `conversation.item.create`), counted against the payload cap; the
        in-progress text is committed before it (`Conversation.add_message`)."""
        self.check_open()
        self.touch()
        self.check_chunk(content, "content")
        if role == "tool":
            self.conversation.check_tool_result(tool_call_id)
        self._count_payload(content)
        self.commit_buffer()
        self.conversation.add_message(role, content, tool_call_id, tool_calls)

    def commit_buffer(self) -> None:
        """The in-progress text becomes part of the input: a user message (chat) or the prompt's tail."""
        if not self.buffer:
            return
        self.conversation.commit({"role": "user", "content": self.buffer})
        self.buffer = ""
        self.transcript_at = None  # (REST audio: the next turn's transcript starts anew)

    def append_text(self, text: str) -> None:
        """Text typed within the current turn (realtime `input_text_buffer.append`)."""
        self.check_open()
        self.touch()
        self.check_chunk(text, "delta")
        self._count_payload(text)
        self.buffer += text

    def replace_text(self, offset: int, text: str) -> None:
        """The current turn's text from character `offset` on becomes `text` (realtime
        `input_text_buffer.replace`)."""
        self.check_open()
        self.touch()
        self.check_chunk(text, "text")
        self._check_offset(offset)
        self._replace(offset, text)

    def transcript_offset(self) -> int:
        """Where this turn's transcript starts: where it started, or (the turn's first audio) the input's end."""
        at = self.transcript_at
        return at if at is not None and at <= len(self.buffer) else len(self.buffer)

    def _check_offset(self, offset: int) -> None:
        if not 0 <= offset <= len(self.buffer):
            raise SessionError(
                400, f"offset {offset} is beyond the current input ({len(self.buffer)} characters)", "offset"
            )

    def _replace(self, offset: int, text: str, transcript: bool = False) -> None:
        """The cap bounds the input held, not the bytes sent: the replaced text's bytes are given back.
        `transcript`: a transcript chunk's own replace (it keeps `transcript_at`)."""
        held = self.payload_bytes - len(self.buffer[offset:].encode())
        if held + len(text.encode()) > self.limits.max_payload_bytes:
            raise SessionError(413, f"session payload cap of {self.limits.max_payload_bytes} bytes exceeded")
        self.payload_bytes = held + len(text.encode())
        self.buffer = self.buffer[:offset] + text
        if self.transcript_at is not None and offset <= self.transcript_at and not transcript:
            self.transcript_at = None  # (a replace reached the transcript: the turn's next audio starts anew)

    def clear_text(self) -> None:
        self.payload_bytes -= len(self.buffer.encode())
        self.buffer = ""
        self.transcript_at = None

    def _count_payload(self, text: str) -> None:
        size = len(text.encode())
        if self.payload_bytes + size > self.limits.max_payload_bytes:
            raise SessionError(413, f"session payload cap of {self.limits.max_payload_bytes} bytes exceeded")
        self.payload_bytes += size

    def expired_gap(self, now: float) -> int | None:
        """The first missing sequence id if a held chunk has waited past the gap timeout."""
        if self.pending and min(t for t, _ in self.pending.values()) + self.limits.gap_timeout_s < now:
            return self.next_seq
        return None

    def may_start(self, num_stable: int) -> bool:
        if self.policy.type == "on_end_only":
            return False
        return self.policy.type == "on_first_chunk" or num_stable >= self.policy.min_tokens

    # --- hand-over ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """Everything another replica needs to take the session over: its input, not its KV (the adopter
        prefills the input again — the input is kept for exactly this)."""
        return {
            "id": self.id,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "request": self.request,
            "instructions": self.conversation.instructions,
            "policy": self.policy.model_dump(),
            "limits": self.limits.model_dump(),
            "buffer": self.buffer,
            "transcript_at": self.transcript_at,
            "chunk_log": self.chunk_log,
            "next_seq": self.next_seq,
            "pending": [[seq, chunk] for seq, (_, chunk) in self.pending.items()],
            "payload_bytes": self.payload_bytes,
            "input_ended": self.input_ended,
            "deferred": self.conversation.deferred,
            "ephemeral": self.ephemeral,
            "close_after_answer": self.close_after_answer,
            "audio": self.audio,
            "connection": self.connection,
            # A finished answer is history; one not yet done is handed off again by the adopter (its KV stays
            # here), or, if a router is streaming it, is reported to the adopter when it ends.
            "answers": [{**a.summary(), "overrides": a.overrides} for a in self.answers],
        }

    @classmethod
    def adopt(cls, state: dict[str, Any], streaming: StreamingPrefill) -> Session:
        session = cls(
            state["id"],
            state["endpoint"],
            state["request"],
            StartPolicy.model_validate(state["policy"]),
            SessionLimits.model_validate(state["limits"]),
            streaming,
        )
        session.conversation.instructions = state["instructions"]
        session.tenant = state.get("tenant", "")
        session.buffer = state["buffer"]
        session.transcript_at = state.get("transcript_at")
        session.chunk_log = state["chunk_log"]
        session.next_seq = state["next_seq"]
        session.pending = {seq: (time.monotonic(), chunk) for seq, chunk in state["pending"]}
        session.payload_bytes = state["payload_bytes"]
        session.input_ended = state["input_ended"]
        session.conversation.deferred = state.get("deferred", [])
        session.ephemeral = state.get("ephemeral", False)
        session.close_after_answer = state.get("close_after_answer", False)
        session.audio = state.get("audio")
        session.connection = state.get("connection")
        for summary in state["answers"]:
            answer = Answer.from_summary(summary)
            answer.overrides = summary.get("overrides") or {}
            session.answers.append(answer)
        return session

    # --- answers -----------------------------------------------------------------------------------
    @property
    def answering(self) -> bool:
        return bool(self.answers) and not self.answers[-1].done

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "state": self.state.value,
            "endpoint": self.endpoint,
            "next_sequence_id": self.next_seq,
            "pending": sorted(self.pending),
            "payload_bytes": self.payload_bytes,
            "input_ended": self.input_ended,
            "turns": len(self.answers),
            "resident_tokens": len(self.streaming.sent),
            "rewrites": self.streaming.rewrites,
            "invalidated_tokens": self.streaming.invalidated_tokens,
            "coalesced": self.streaming.coalesced,  # versions a later one superseded before they reached the engine
            "streaming": self.streaming.active,  # its input is prefilled as it arrives (resident)
            "prefilled": self.streaming.prefilled,  # the engine holds the KV of all its stable input sent so far
            "buffered": self.buffered,  # its input waited for room to stream (residency control) at least once
            **({"preemptive": self.preempt.summary()} if self.preempt is not None else {}),
            **({"audio": self.audio} if self.audio is not None else {}),
            "expires_in": max(0.0, self.limits.idle_timeout_s - (time.monotonic() - self.last_active)),
        }
