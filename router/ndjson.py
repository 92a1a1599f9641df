"""Chat completions with a streamed request body (the streaming-input RFC's single-connection mode).

With `X-Streaming-Input: true`, the request body is NDJSON sent with `Transfer-Encoding: chunked`:
the first line is an ordinary chat-completions request (its last user message may be partial, and it may
carry `start_policy`); every later line is `{"payload": "<text>"}` appended to the user's turn, and
`{"end_of_input": true}` (on such a line or alone) or the end of the body ends the input. Each line is
prefilled as it arrives; the response is what the same request sent whole would get (SSE or JSON).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.sessions import session_call, session_spec
from serve_app.protocol import SSE_DONE, error_body, error_response, parse_sse, sse


async def ndjson_lines(request: Request) -> AsyncGenerator[dict[str, Any], None]:
    buffer = b""
    async for chunk in request.stream():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
    if buffer.strip():
        yield json.loads(buffer)


class InputError(Exception):
    """The input could not be applied; `payload` is the OpenAI error JSON for the client."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload["error"]["message"])
        self.payload = payload


async def streaming_input_chat(ingress: Any, request: Request) -> Response:
    lines = ndjson_lines(request)
    try:
        first = await anext(lines)
    except (StopAsyncIteration, ValueError) as e:
        return JSONResponse(error_body(400, f"the first NDJSON line must be a chat request: {e}"), status_code=400)
    if not isinstance(first, dict) or "messages" not in first:
        return JSONResponse(error_body(400, "the first NDJSON line must be a chat request", "messages"), 400)
    ingress.check_model(first)
    stream, usage_asked = bool(first.get("stream")), bool((first.get("stream_options") or {}).get("include_usage"))
    messages = first.setdefault("messages", [])
    partial = messages.pop()["content"] if messages and messages[-1].get("role") == "user" else ""
    created = await ingress.prefill.create_session.remote(session_spec(first))
    if "error" in created:
        return error_response(created)
    session_id = created["session_id"]
    prefill = ingress.prefill

    async def chunk(seq: int, payload: str, end: bool) -> None:
        result = await session_call(
            ingress, "session_chunk", session_id=session_id, sequence_id=seq, payload=payload, end_of_input=end
        )
        if "error" in result:
            raise InputError(result)

    try:
        seq, ended = 0, False
        if partial:
            await chunk(seq, partial, False)
            seq += 1
        try:
            async for line in lines:
                payload = line.get("payload", line.get("delta", "")) if isinstance(line, dict) else None
                if not isinstance(payload, str):
                    raise InputError(error_body(400, 'each NDJSON line is {"payload": str}', "payload"))
                ended = bool(line.get("end_of_input"))
                await chunk(seq, payload, ended)
                seq += 1
                if ended:
                    break
        except ValueError as e:
            raise InputError(error_body(400, f"invalid NDJSON line: {e}")) from None
        if not ended:
            finished = await prefill.session_finish.remote(session_id=session_id)
            if "error" in finished:
                raise InputError(finished)
    except InputError as e:
        await prefill.session_delete.remote(session_id=session_id)
        return error_response(e.payload)

    events = prefill.options(stream=True).session_events.remote(session_id=session_id)
    header = await anext(events)
    if "error" in header:
        return error_response(header)

    async def frames() -> AsyncGenerator[str, None]:
        try:
            async for item in events:
                if isinstance(item, dict):
                    continue  # the summary: the SSE frames already carried everything
                if not usage_asked:  # the session always asks decode for usage; the client did not
                    done = SSE_DONE in item
                    item = "".join(sse(f) for f in parse_sse(item) if f.get("choices") != [] or "error" in f)
                    item += SSE_DONE if done else ""
                yield item
        finally:
            events.cancel()
            await prefill.session_delete.remote(session_id=session_id)

    if stream:
        headers = {"Cache-Control": "no-cache", "X-Session-Id": session_id}
        return StreamingResponse(frames(), media_type="text/event-stream", headers=headers)

    summary: dict[str, Any] = {}
    try:
        async for item in events:
            if isinstance(item, dict) and "done" in item:
                summary = item["done"]
    finally:
        await prefill.session_delete.remote(session_id=session_id)
    if summary.get("error"):
        err = {"error": summary["error"]}
        return error_response(err)
    message = {"role": "assistant", "content": summary.get("text", "")}
    body = {
        "id": f"chatcmpl-{session_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": first["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": summary.get("finish_reason")}],
        "usage": summary.get("usage"),
    }
    return JSONResponse(body, headers={"X-Session-Id": session_id})
