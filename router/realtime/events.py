"""The client events of `/v1/realtime`, validated: one pydantic model per event type, GA and beta shapes.

Fields this server does not implement (tracing, noise reduction, ...) are ignored, as clients written for
OpenAI send them; a field it does implement must have the right type and range, or the whole event is refused
(`InvalidEvent`, naming the field in `param`) before anything is applied. Types are strict: `"5"` is not a
number and `true` is not an integer.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from router.openai.schemas import is_unicode
from router.realtime.audio_settings import AudioSettings, Transcription, TurnDetection


class InvalidEvent(Exception):
    """A client event refused whole: its `error` event's code, message and `param`."""

    def __init__(self, message: str, code: str = "invalid_event", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _max_output_tokens(value: Any) -> int | Literal["inf"] | None:
    # A plain function rather than `int | Literal["inf"]`: pydantic's union errors name the union's members.
    if value is None or value == "inf" or (type(value) is int and value >= 1):
        return value
    raise ValueError('must be a positive integer or "inf"')


MaxOutputTokens = Annotated[Any, AfterValidator(_max_output_tokens)]


class Tool(_Model):
    """A function the model may call (Realtime's flat form: no `function` wrapper)."""

    type: Literal["function"] = "function"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


def _tool_choice(value: Any) -> Any:
    # A plain function rather than a union: pydantic's union errors name the union's members.
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    raise ValueError('must be "auto", "none", "required" or {"type": "function", "name": ...}')


class Sampling(_Model):
    """What a session (`session.update`) or one response (`response.create`) may set. None: unchanged."""

    instructions: str | None = None
    tools: list[Tool] | None = None  # [] clears them
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    # Beta sessions call it `max_response_output_tokens`.
    max_output_tokens: MaxOutputTokens = Field(
        None, validation_alias=AliasChoices("max_output_tokens", "max_response_output_tokens")
    )
    temperature: float | None = Field(None, ge=0, le=2)
    output_modalities: list[str] | None = Field(None, validation_alias=AliasChoices("output_modalities", "modalities"))
    # This server's extension (sessions only): start the answer while the user may still be typing
    # (prefill/preemptive.py), checked in full by the session's owner; `null` on `session.update`: off.
    preemptive: dict[str, Any] | None = None
    # Audio input (sessions only; router/realtime/audio_settings.py): GA `type` and `audio.input`, beta flat fields.
    # `turn_detection: null` turns the VAD off: whether a field was given at all is `model_fields_set`.
    type: Literal["realtime", "transcription"] | None = None
    audio: AudioSettings | None = None
    input_audio_format: Any = None
    input_audio_transcription: Transcription | None = None
    turn_detection: TurnDetection | None = None
    # Audio output (sessions, and one response): GA `audio.output`; beta's flat fields, read on beta connections
    # only (router/realtime/settings.py: a GA session has no top-level `voice`, and ignores it as before).
    voice: Any = None
    output_audio_format: Any = None
    speed: float | None = Field(None, ge=0.25, le=1.5)

    AUDIO: ClassVar[frozenset[str]] = frozenset(
        {"type", "audio", "input_audio_format", "input_audio_transcription", "turn_detection"}
    )
    OUTPUT: ClassVar[frozenset[str]] = frozenset({"voice", "output_audio_format", "speed"})

    def given(self) -> dict[str, Any]:
        """The settings this event sets, by their GA names (modalities, preemptive answers and audio apart)."""
        exclude = {"output_modalities", "preemptive", *self.AUDIO, *self.OUTPUT}
        return {k: v for k, v in self.model_dump(exclude=exclude).items() if v is not None}


class ContentPart(_Model):
    model_config = ConfigDict(extra="allow", strict=True)  # echoed back as sent (audio parts included)

    type: str
    text: str | None = None

    @property
    def text_content(self) -> str:
        return (self.text or "") if self.type in ("input_text", "text", "output_text") else ""


class Item(_Model):
    """A conversation item: a message, a function call (history the client adds), or a call's result."""

    id: str | None = None
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "assistant"] | None = None  # (messages)
    content: list[ContentPart] | None = None
    call_id: str | None = Field(None, min_length=1, max_length=256)  # (function_call, function_call_output)
    name: str | None = None  # (function_call)
    arguments: str | None = None  # (function_call): JSON text
    output: str | None = None  # (function_call_output)

    def check(self) -> None:
        """The fields its type needs (`InvalidEvent` naming the first one missing or malformed)."""
        needed = {"message": ("role",), "function_call": ("call_id", "name", "arguments")}
        for name in needed.get(self.type, ("call_id", "output")):
            if getattr(self, name) is None:
                message = f"invalid conversation.item.create: item.{name}: required for a {self.type} item"
                raise InvalidEvent(message, param=f"item.{name}")
        if self.type == "function_call":
            try:
                json.loads(self.arguments or "")
            except ValueError:
                message = "invalid conversation.item.create: item.arguments: must be JSON text"
                raise InvalidEvent(message, param="item.arguments") from None

    @property
    def parts(self) -> list[dict[str, Any]]:
        return [p.model_dump(exclude_none=True) for p in self.content or []]

    @property
    def text(self) -> str:
        return "".join(p.text_content for p in self.content or [])


class ClientEvent(_Model):
    type: str
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    session: Sampling | None = None
    model: str | None = None  # vLLM's realtime client names the model here, with no `session`


class ConversationItemCreate(ClientEvent):
    item: Item
    previous_item_id: str | None = None  # accepted; items are appended in arrival order


class BufferAppend(ClientEvent):
    delta: str = Field(validation_alias=AliasChoices("delta", "text"))  # GA `delta`; `text` as well


class BufferReplace(ClientEvent):
    """Update mode: the buffer's text from character `offset` on becomes `text`."""

    text: str = Field(validation_alias=AliasChoices("text", "delta"))
    offset: int = Field(0, ge=0)


class BufferCommit(ClientEvent):
    pass


class BufferClear(ClientEvent):
    pass


class AudioAppend(ClientEvent):
    audio: str  # base64 (checked when decoded: its error names the field)


class AudioCommit(ClientEvent):
    final: bool | None = None  # vLLM's realtime client flow: `false` starts the transcription, `true` ends it


class AudioClear(ClientEvent):
    pass


class ItemTruncate(ClientEvent):
    item_id: str = Field(min_length=1, max_length=256)
    content_index: int = Field(0, ge=0)
    audio_end_ms: int = Field(ge=0)
    # This server's extension, for answers in text: the characters of the answer the user heard (a client's own
    # speech synthesis knows); the conversation keeps only those. (A spoken answer is cut by `audio_end_ms`.)
    text_end: int | None = Field(None, ge=0)


class ResponseCreate(ClientEvent):
    response: Sampling | None = None


class ResponseCancel(ClientEvent):
    response_id: str | None = None


EVENTS: dict[str, type[ClientEvent]] = {
    "session.update": SessionUpdate,
    "conversation.item.create": ConversationItemCreate,
    "input_text_buffer.append": BufferAppend,
    "input_text_buffer.replace": BufferReplace,
    "input_text_buffer.commit": BufferCommit,
    "input_text_buffer.clear": BufferClear,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": AudioCommit,
    "input_audio_buffer.clear": AudioClear,
    "conversation.item.truncate": ItemTruncate,
}


def new_id(prefix: str) -> str:
    """An id for what the server makes: `event_...`, `item_...`, `resp_...`."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def event_id_of(raw: Any) -> str | None:
    """The client's `event_id`, for the error event answering it (when it is a string)."""
    event_id = raw.get("event_id") if isinstance(raw, dict) else None
    return event_id if isinstance(event_id, str) else None


_EVENT_ID = re.compile(r'"event_id"\s*:\s*"([^"\\]{1,256})"')


def leading_event_id(text: str) -> str | None:
    """The `event_id` of a frame too large to parse, if it is among the frame's first or last characters."""
    found = _EVENT_ID.search(text, 0, 4096) or _EVENT_ID.search(text, max(0, len(text) - 4096))
    return found.group(1) if found else None


def decode(text: str) -> dict[str, Any]:
    """A text frame as a JSON object (`InvalidEvent` "invalid_json" if it is not)."""
    try:
        event = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidEvent(f"invalid event: {e}", "invalid_json") from None
    if not isinstance(event, dict):
        raise InvalidEvent("invalid event: an event is a JSON object with a string `type`", "invalid_json", "type")
    if not is_unicode(text, event):
        raise InvalidEvent("invalid event: its text holds an unpaired surrogate (not Unicode)", "invalid_json")
    return event


def parse(event: dict[str, Any]) -> ClientEvent:
    """The validated event (`InvalidEvent` "unknown_event" or "invalid_event", naming the field)."""
    if not isinstance(event.get("type"), str):  # (its event_id is known by now: the error carries it)
        raise InvalidEvent("invalid event: an event is a JSON object with a string `type`", "invalid_json", "type")
    model = EVENTS.get(event["type"])
    if model is None:
        raise InvalidEvent(f"unknown event type {event['type']!r}", "unknown_event", "type")
    try:
        parsed = model.model_validate(event)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        raise InvalidEvent(f"invalid {event['type']}: {param or 'event'}: {first['msg']}", param=param) from None
    if isinstance(parsed, SessionUpdate) and parsed.session is None and parsed.model is None:
        raise InvalidEvent("invalid session.update: session: Field required", param="session")
    return parsed


def _param(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as the field's path: `item.content[0].text`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None
