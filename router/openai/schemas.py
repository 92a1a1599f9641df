"""The request bodies the router takes, as pydantic models: each body is validated by its model (400 with
OpenAI error JSON naming the field), and the models are the app's OpenAPI schema (`/openapi.json`, `/docs`).

Chat and completion requests are validated in full by vLLM's own request models where they are served; the
models here are their outline (the fields that are always there, others allowed), for the schema and for
refusing a body that is not even that shape before it travels.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.protocol import error_body


class _Open(BaseModel):
    """An OpenAI request: the fields named here are checked, any other is passed on to vLLM."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # Objects vLLM reads with `.get` before (or without) checking their type: a non-object was a 500.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Set between this server's own replicas (where a prefill replica left the KV, the prompt's token ids): a
    # client's would have decode read KV from wherever it says, or take a prompt the template did not render.
    kv_transfer_params: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("kv_transfer_params", mode="before")
    @classmethod
    def _server_only(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("set by the server between its own replicas; a request may not carry it")
        return value


class ChatBody(_Open):
    messages: list[dict[str, Any]]


class CompletionBody(_Open):
    prompt: str | list[Any]


class SessionAudio(BaseModel):
    """A REST session's audio chunks (`modality: "audio"`): base64 16-bit mono PCM at `rate` Hz."""

    model_config = ConfigDict(extra="forbid")
    rate: Literal[8000, 16000, 22050, 24000, 32000, 44100, 48000] = 16000
    language: str | None = Field(default=None, min_length=2, max_length=8)


class CreateSessionBody(_Open):
    """`POST /v1/streaming_input/sessions`: a chat (`messages`) or completion (`prompt`) request whose input
    is still to come, with the session's own settings (checked in full by the prefill replica)."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    start_policy: Literal["on_first_chunk", "on_min_length", "on_end_only"] | dict[str, Any] | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    limits: dict[str, float | int] | None = None
    # One turn only: the session closes when its answer ends, and its conversation is not prefilled again for a
    # next turn that will never come (the KV goes at once, not at the DELETE or the idle timeout).
    close_after_answer: bool = False
    # Start the answer while the user may still be talking (prefill/preemptive.py): `{after_idle_ms, max_tokens,
    # max_input_tokens, max_attempts, stream}`, checked in full by the prefill replica.
    preemptive: dict[str, Any] | None = None
    # Its audio chunks' format (`modality: "audio"`); 16 kHz if not given.
    audio: SessionAudio | None = None


class ChunkBody(BaseModel):
    """`POST /v1/streaming_input/sessions/{id}/chunks`."""

    model_config = ConfigDict(extra="forbid")
    sequence_id: int = Field(ge=0, le=2**63 - 1)
    # "audio": `payload` is base64 PCM16 at the session's `audio.rate`, transcribed into the turn (router/voice/).
    modality: Literal["text", "audio"] = "text"
    payload: str
    end_of_input: bool = False
    # Update mode: "replace" swaps the current turn's input from character `offset` (default 0) for `payload`.
    mode: Literal["append", "replace"] = "append"
    offset: int | None = Field(default=None, ge=0, le=2**63 - 1)
    # A tool's result (`role: "tool"`): the payload is the whole result, a `tool` message answering the call
    # `tool_call_id` of the session's last answer.
    role: Literal["user", "tool"] = "user"
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)


_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def is_unicode(raw: str | bytes, value: Any) -> bool:
    """Whether the JSON `value` parsed from `raw` holds only Unicode text: JSON's `\\ud800` escapes can make
    strings of unpaired surrogates, which nothing downstream can encode. Checked only where `raw` has such an
    escape (pairs, e.g. emoji, are fine)."""
    text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    if not _SURROGATE.search(text):
        return True
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring `model` as the JSON request body (the handler reads the body itself, to bound
    its size before parsing it)."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def validation_error(e: ValidationError) -> dict[str, Any]:
    """The first error as OpenAI error JSON (400), `param` the field's dotted path."""
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return error_body(400, f"{param}: {first['msg']}" if param else first["msg"], param)
