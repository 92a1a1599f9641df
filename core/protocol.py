"""Shared protocol helpers: OpenAI error JSON, request validation with vLLM's own request models."""

from __future__ import annotations

import json
from typing import Any, Literal

Endpoint = Literal["chat", "completion"]
PREEMPTIVE_CAP = "PreemptiveCap"  # the error type a parked preemptive answer ends with at its cap (decode/server.py)

# vLLM's error `type` names per HTTP status (vllm.entrypoints.utils.create_error_response).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, as vLLM's OpenAI server writes it."""
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def error_payload(response: Any) -> dict[str, Any]:
    """A vLLM `ErrorResponse` as plain JSON."""
    return {"error": response.error.model_dump()}


def error_headers(payload: dict[str, Any]) -> dict[str, str]:
    """`Retry-After` for refusals under load (429) and hand-overs (503), as OpenAI clients expect."""
    if error_status(payload) in (429, 503):
        return {"Retry-After": str(payload["error"].get("retry_after", 1))}
    return {}


def error_response(payload: dict[str, Any]) -> Any:
    """An OpenAI error JSON as the HTTP response: its status, and `Retry-After` where it applies."""
    from starlette.responses import JSONResponse

    return JSONResponse(payload, status_code=error_status(payload), headers=error_headers(payload))


CAPACITY_EXHAUSTED = "prefill capacity exhausted"  # how a prefill replica's 429 at its own capacity begins


def capacity_exhausted(payload: dict[str, Any]) -> bool:
    """A prefill replica's refusal at its own capacity (every session slot, or its KV, taken): room may free any
    moment, unlike a key's session cap."""
    error = payload.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return error_status(payload) == 429 and isinstance(message, str) and message.startswith(CAPACITY_EXHAUSTED)


def error_status(payload: dict[str, Any]) -> int:
    error = payload.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 500


def over_max_tokens(body: dict[str, Any], cap: int | None) -> tuple[str, str] | None:
    """(field, message) when the body asks for more than `cap` tokens (`max_tokens` or
    `max_completion_tokens`); None otherwise or without a cap."""
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if cap is not None and isinstance(value, int) and not isinstance(value, bool) and value > cap:
            return field, f"{field} is {value}, more than this server's limit of {cap}"
    return None


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def request_model(endpoint: Endpoint) -> Any:
    if endpoint == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def validate_openai_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | None:
    """Run vLLM's pydantic request model over `body`; an OpenAI error payload if it is invalid."""
    from pydantic import ValidationError

    try:
        request_model(endpoint).model_validate(body)
    except ValidationError as e:
        return validation_error_body(e)
    except Exception as e:  # vLLM's own validation errors (VLLMValidationError) name the parameter
        return error_body(400, str(e), getattr(e, "parameter", None))
    return None


def validation_error_body(e: Any) -> dict[str, Any]:
    """A pydantic ValidationError of vLLM's request model as OpenAI error JSON, `param` the field's path."""
    first = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)) or None
    return error_body(400, f"{loc or 'request'}: {first.get('msg', str(e))}", param=loc)


def parse_sse(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of `data:` frames in `text` (whole frames only; `[DONE]` skipped)."""
    frames = []
    for frame in text.split("\n\n"):
        if frame.startswith("data: ") and frame != "data: [DONE]":
            frames.append(json.loads(frame[6:]))
    return frames


def choice_text(chunk: dict[str, Any]) -> tuple[str, str | None]:
    """A completion or chat-completion chunk's first choice: (text delta, finish_reason)."""
    for choice in chunk.get("choices", []):
        return (choice.get("text") or (choice.get("delta") or {}).get("content") or "", choice.get("finish_reason"))
    return "", None


def streaming_response(body: Any, on_close: Any, headers: dict[str, str] | None = None) -> Any:
    """An SSE response that calls `on_close()` however it ends: a client that leaves before the body's
    generator ever ran (so its own `finally` never runs) still releases what the request holds."""
    from starlette.responses import StreamingResponse

    class _Closing(StreamingResponse):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                on_close()

    return _Closing(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})


def continuation_refusal(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """Why a continuation (router/streams/resume.py: the prompt's ids plus those generated, as a new completion)
    could not give exactly the answer the request would have had (None: it can)."""
    if (body.get("n") or 1) > 1 or body.get("use_beam_search"):
        return "n > 1"
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        return "tools"
    if any(body.get(k) for k in ("response_format", "structured_outputs", "guided_json", "guided_regex")):
        return "structured outputs"
    if (body.get("logprobs") if endpoint == "chat" else body.get("logprobs") is not None) or body.get(
        "prompt_logprobs"
    ) is not None:
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("stop"):  # the engine holds back text that may start a stop string: it would be lost
        return "stop strings"
    if body.get("presence_penalty") or body.get("frequency_penalty"):  # they count output tokens only
        return "presence/frequency penalties"
    return None
