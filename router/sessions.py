"""REST streaming-input sessions (the streaming-input RFC's multi-request mode).

    POST   /v1/streaming_input/sessions               {model, prompt | messages, sampling..., start_policy}
    POST   /v1/streaming_input/sessions/{id}/chunks    {sequence_id, modality: "text", payload, end_of_input}
    POST   /v1/streaming_input/sessions/{id}/finish    (idempotent)
    GET    /v1/streaming_input/sessions/{id}/events    SSE: {"type": "delta"} ... {"type": "done"}, [DONE]
    GET    /v1/streaming_input/sessions/{id}/result
    GET    /v1/streaming_input/sessions/{id}
    DELETE /v1/streaming_input/sessions/{id}

The session lives on its owner prefill replica; every call here is forwarded there by session id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app.protocol import SSE_DONE, choice_text, error_body, error_response, error_status, parse_sse, sse

api = APIRouter(prefix="/v1/streaming_input/sessions", tags=["streaming-input"])

SESSION_FIELDS = ("start_policy", "limits", "instructions")


class Chunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sequence_id: int = Field(ge=0)
    modality: Literal["text"] = "text"
    payload: str
    end_of_input: bool = False
    # Update mode: "replace" swaps the current turn's input from character `offset` (default 0) for `payload`.
    mode: Literal["append", "replace"] = "append"
    offset: int | None = Field(default=None, ge=0)


def _ingress(request: Request) -> Any:
    return request.app.state.ingress


HANDOVER_RETRY_S = 0.25
HANDOVER_WAIT_S = 5.0  # a drained replica's sessions reappear on their adopter within a few seconds


def _handing_over(result: Any) -> bool:
    return isinstance(result, dict) and "error" in result and error_status(result) == 503


def _not_found(result: dict[str, Any]) -> dict[str, Any]:
    """No replica owns or adopted the session after the hand-over window: it does not exist (any more)."""
    message = result["error"]["message"].replace("is being handed over; retry", "not found")
    return error_body(404, message, "session_id")


async def session_call(ingress: Any, method: str, **kwargs: Any) -> dict[str, Any]:
    """A call on the session's owner replica, retried while the session is being handed over (503)."""
    waited = 0.0
    while True:
        result = await getattr(ingress.prefill, method).remote(**kwargs)
        if not _handing_over(result):
            return result
        if waited >= HANDOVER_WAIT_S:
            return _not_found(result)
        await asyncio.sleep(HANDOVER_RETRY_S)
        waited += HANDOVER_RETRY_S


def _reply(result: dict[str, Any], status: int = 200) -> JSONResponse:
    if "error" in result:
        return error_response(result)
    return JSONResponse(result, status_code=status)


def session_spec(body: dict[str, Any]) -> dict[str, Any]:
    """Split a create body into the OpenAI request the answer is made from and the session's own settings."""
    policy = body.get("start_policy")
    if isinstance(policy, str):
        policy = {"type": policy, **({"min_tokens": body["min_tokens"]} if "min_tokens" in body else {})}
    request = {k: v for k, v in body.items() if k not in (*SESSION_FIELDS, "min_tokens", "stream", "stream_options")}
    return {"request": request, "start_policy": policy, "limits": body.get("limits"), "instructions": None}


@api.post("")
async def create_session(request: Request) -> Response:
    ingress = _ingress(request)
    body = await ingress.read_body(request)
    ingress.check_model(body)
    result = await ingress.prefill.create_session.remote(session_spec(body))
    if "error" in result:
        return _reply(result)
    return JSONResponse(
        {"object": "streaming_input.session", **result, "session_id": result["session_id"]}, status_code=201
    )


@api.post("/{session_id}/chunks")
async def add_chunk(session_id: str, request: Request) -> Response:
    ingress = _ingress(request)
    body = await ingress.read_body(request)
    try:
        chunk = Chunk.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        return JSONResponse(error_body(400, f"{param}: {first['msg']}", param), status_code=400)
    result = await session_call(
        ingress,
        "session_chunk",
        session_id=session_id,
        sequence_id=chunk.sequence_id,
        payload=chunk.payload,
        end_of_input=chunk.end_of_input,
        mode=chunk.mode,
        offset=chunk.offset,
    )
    return _reply(result, 202)


@api.post("/{session_id}/finish")
async def finish(session_id: str, request: Request) -> Response:
    return _reply(await session_call(_ingress(request), "session_finish", session_id=session_id), 202)


@api.get("/{session_id}")
async def describe(session_id: str, request: Request) -> Response:
    return _reply(await session_call(_ingress(request), "session_info", session_id=session_id))


@api.get("/{session_id}/result")
async def result(session_id: str, request: Request, wait: bool = True) -> Response:
    return _reply(await session_call(_ingress(request), "session_result", session_id=session_id, wait=wait))


@api.delete("/{session_id}")
async def delete(session_id: str, request: Request) -> Response:
    return _reply(await session_call(_ingress(request), "session_delete", session_id=session_id))


async def answer_events(ingress: Any, session_id: str) -> AsyncGenerator[Any, None]:
    """The owner's answer stream as (kind, payload): `("start", header)`, `("delta", text)`, `("done", summary)`,
    or one `("error", payload)`."""
    waited = 0.0
    while True:  # a session being handed over answers 503 until its adopter is known
        stream = ingress.prefill.options(stream=True).session_events.remote(session_id=session_id)
        first = await anext(stream)
        if not _handing_over(first):
            break
        if waited >= HANDOVER_WAIT_S:
            first = _not_found(first)
            break
        stream.cancel()
        await asyncio.sleep(HANDOVER_RETRY_S)
        waited += HANDOVER_RETRY_S

    async def items() -> AsyncGenerator[Any, None]:
        yield first
        async for item in stream:
            yield item

    try:
        async for item in items():
            if isinstance(item, dict):
                kind = "error" if "error" in item else "done" if "done" in item else "start"
                yield kind, item.get("done", item)
                continue
            for chunk in parse_sse(item):
                if "error" in chunk:
                    yield "error", chunk
                    continue
                text, _ = choice_text(chunk)
                if text:
                    yield "delta", text
    finally:
        stream.cancel()


@api.get("/{session_id}/events")
async def events(session_id: str, request: Request) -> Response:
    ingress = _ingress(request)
    source = answer_events(ingress, session_id)
    kind, first = await anext(source)
    if kind == "error":
        await source.aclose()
        return error_response(first)

    async def frames() -> AsyncGenerator[str, None]:
        turn = first.get("turn")
        try:
            async for kind, payload in source:
                if kind == "delta":
                    yield sse({"type": "delta", "turn": turn, "delta": payload})
                elif kind == "done":
                    yield sse({"type": "done", **payload})
                else:
                    yield sse(payload)
            yield SSE_DONE
        finally:
            await source.aclose()

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
