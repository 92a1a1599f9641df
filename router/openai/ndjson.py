"""Chat completions with a streamed request body (the streaming-input RFC's single-connection mode).

With `X-Streaming-Input: true`, the request body is NDJSON sent with `Transfer-Encoding: chunked`:
the first line is an ordinary chat-completions request (its last user message may be partial, and it may
carry `start_policy`, and `audio: {"rate"}` for audio lines); every later line is `{"payload": "<text>"}` appended
to the user's turn, or `{"modality": "audio", "payload": "<base64 PCM16>"}` transcribed into it (router/voice/), and
`{"end_of_input": true}` (on such a line or alone) or the end of the body ends the input. Each line is
prefilled as it arrives; the response is what the same request sent whole would get (SSE or JSON).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from core.protocol import error_body, error_response, streaming_response
from core.tasks import detached
from router.admission.gate import Refusal, admit_session
from router.openai import tool_calls
from router.openai.schemas import ChunkBody, CreateSessionBody, is_unicode, validation_error
from router.sessions import audio as session_audio
from router.sessions.answers import AnswerReader
from router.sessions.owner import create_session, session_chunk, session_delete, session_finish
from router.sessions.rest import session_spec

NDJSON_IDLE_S = 30.0  # a request body silent for this long is over (408), and its session with it


async def ndjson_lines(request: Request, limit: int) -> AsyncGenerator[dict[str, Any], None]:
    """The body's lines as JSON values; a line over `limit` bytes is refused (413) before it is read whole."""
    buffer = b""
    async for chunk in request.stream():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if len(line) > limit:
                raise InputError(error_body(413, f"an NDJSON line is over {limit} bytes, this server's limit"))
            if line.strip():
                yield _loads(line)
        if len(buffer) > limit:
            raise InputError(error_body(413, f"an NDJSON line is over {limit} bytes, this server's limit"))
    if buffer.strip():
        yield _loads(buffer)


def _loads(line: bytes) -> Any:
    try:
        value = json.loads(line)
    except RecursionError:  # nested past the parser's depth
        raise ValueError("nested too deeply") from None
    if not is_unicode(line, value):
        raise ValueError("an unpaired surrogate: the line's text is not Unicode")
    return value


class InputError(Exception):
    """The input could not be applied; `payload` is the OpenAI error JSON for the client."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload["error"]["message"])
        self.payload = payload


async def streaming_input_chat(ingress: Any, request: Request) -> Response:
    lines = ndjson_lines(request, ingress.config.limits.max_body_bytes)
    try:
        first = await anext(lines)
    except InputError as e:
        return error_response(e.payload)
    except (StopAsyncIteration, ValueError) as e:
        return JSONResponse(error_body(400, f"the first NDJSON line must be a chat request: {e}"), status_code=400)
    if not isinstance(first, dict) or not isinstance(first.get("messages"), list):
        return JSONResponse(error_body(400, "the first NDJSON line must be a chat request", "messages"), 400)
    try:
        CreateSessionBody.model_validate(first)
    except ValidationError as e:
        return error_response(validation_error(e))
    ingress.check_model(first)
    ingress.check_max_tokens(first)
    if (refused := tool_calls.refusal(first)) is not None:
        return error_response(refused)
    if first.get("audio") is not None and getattr(ingress, "speech", None) is None:
        return error_response(error_body(400, session_audio.NO_SPEECH, "audio"))
    stream = bool(first.get("stream"))
    messages = first.setdefault("messages", [])
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    partial = messages.pop()["content"] if last.get("role") == "user" and isinstance(last.get("content"), str) else ""
    # The session is this request's: it ends with its answer, and a body silent for NDJSON_IDLE_S is over.
    idle = min(ingress.config.limits.idle_timeout_s, NDJSON_IDLE_S)
    spec = session_spec(first)
    asked = spec.get("limits") if isinstance(spec.get("limits"), dict) else {}
    if isinstance(asked, dict) and isinstance(asked.get("idle_timeout_s"), (int, float)):
        idle = min(idle, asked["idle_timeout_s"])
    spec.update(ephemeral=True, limits={**(spec.get("limits") or {}), "idle_timeout_s": idle})
    spec["connection"] = getattr(ingress, "replica_name", None)  # (closed by its owner if this router replica dies)
    if isinstance(ticket := await admit_session(ingress), Refusal):
        return error_response(ticket.payload())  # the body's session, refused before it exists
    created = await create_session(ingress, spec, abandoned=ticket.release)
    if "error" in created:
        ticket.release()
        return error_response(created)
    session_id = created["session_id"]

    if first.get("audio") is not None:
        session_audio.remember(session_id, first["audio"])

    async def chunk(seq: int, payload: str, end: bool, modality: str = "text") -> None:
        if modality == "audio":
            body = ChunkBody(sequence_id=seq, modality="audio", payload=payload, end_of_input=end)
            result = await session_audio.audio_chunk(ingress, session_id, body)
        else:
            result = await session_chunk(ingress, session_id, sequence_id=seq, payload=payload, end_of_input=end)
        if "error" in result:
            raise InputError(result)

    try:
        seq, ended, spoken = 0, False, False
        if partial:
            await chunk(seq, partial, False)
            seq += 1
        try:
            while True:
                try:  # a body that stops sending without ending holds nothing forever
                    line = await asyncio.wait_for(anext(lines), idle)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise InputError(error_body(408, f"no NDJSON line came for {idle:g} s")) from None
                payload = line.get("payload", line.get("delta", "")) if isinstance(line, dict) else None
                if not isinstance(payload, str):
                    raise InputError(error_body(400, 'each NDJSON line is {"payload": str}', "payload"))
                ended = bool(line.get("end_of_input"))
                # (`{"end_of_input": true}` alone after audio lines ends the audio: its final transcript)
                modality = line.get("modality", "audio" if spoken and ended and not payload else "text")
                spoken = spoken or modality == "audio"
                if modality not in ("text", "audio"):
                    raise InputError(error_body(400, 'an NDJSON line\'s modality is "text" or "audio"', "modality"))
                await chunk(seq, payload, ended, modality)
                seq += 1
                if ended:
                    break
        except ValueError as e:
            raise InputError(error_body(400, f"invalid NDJSON line: {e}")) from None
        if not ended:
            finished = await session_finish(ingress, session_id)
            if "error" in finished:
                raise InputError(finished)
    except InputError as e:
        ticket.release()
        await session_delete(ingress, session_id)
        return error_response(e.payload)
    except BaseException:  # the client left mid-body (or the request was cancelled): nothing stays behind
        ticket.release()
        detached(session_delete(ingress, session_id))
        raise

    reader = AnswerReader(ingress, session_id)
    try:
        err = await reader.open(stream=stream)
    except BaseException:  # the client left: the delete runs in a task of its own (this one is cancelled)
        ticket.release()
        detached(session_delete(ingress, session_id))
        raise
    if err is not None:
        ticket.release()
        await session_delete(ingress, session_id)
        return error_response(err)
    headers = {"X-Session-Id": session_id}
    if not stream:
        try:
            body = await reader.whole()
        finally:  # in a task of its own: a cancelled request's awaits are cancelled too
            ticket.release()
            detached(session_delete(ingress, session_id))
        return JSONResponse(body, headers=headers)

    async def frames() -> AsyncGenerator[str, None]:
        async for forward, _ in reader.items():
            yield forward

    def close() -> None:  # however the response ends, even before its body ran: nothing stays behind
        reader.release()
        ticket.release()
        detached(session_delete(ingress, session_id))

    return streaming_response(frames(), close, headers)
