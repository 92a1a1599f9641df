"""The ingress: OpenAI-compatible HTTP on FastAPI, forwarding each request prefill → decode.

A request goes to a prefill replica (one token, KV left for remote decode), then with the returned
`kv_transfer_params` to a decode replica that pulls the KV over NIXL and streams the answer. The SSE
frames are vLLM's own; this router relays them, several frames per Ray item when they are ready together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from router import realtime, sessions
from router.ndjson import streaming_input_chat
from serve_app import metrics
from serve_app.config import AppConfig
from serve_app.protocol import SSE_DONE, Endpoint, error_body, error_response, error_status, sse

logger = logging.getLogger(__name__)

app = FastAPI(title="realtime-pd", version="0.1.0")
app.include_router(sessions.api)
app.include_router(realtime.api)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), status_code=self.status)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{exc.status}")
    return exc.response()


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return JSONResponse(error_body(500, f"internal error: {exc}"), status_code=500)


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


async def relay(first: str, stream: DeploymentResponseGenerator) -> AsyncGenerator[str, None]:
    """SSE relay. A failure after the stream started becomes an SSE error event, then `[DONE]`."""
    try:
        yield first
        async for text in stream:
            yield text
    except Exception as e:  # the decode replica failed mid-stream
        logger.exception("decode stream failed")
        metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="mid_stream")
        yield sse(error_body(500, f"decode failed mid-stream: {e}"))
        yield SSE_DONE
    finally:
        stream.cancel()  # client gone or stream over: nothing may keep running on the decode engine


@serve.deployment(name="router", max_ongoing_requests=4096)
@serve.ingress(app)
class Router:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, app_config: dict[str, Any]) -> None:
        self.config = AppConfig.model_validate(app_config)
        self.prefill = prefill
        self.decode = decode.options(stream=True)
        self.created = int(time.time())
        app.state.ingress = self  # the session and realtime routes reach the handles through it

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "realtime-pd",
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        if request.headers.get("x-streaming-input", "").lower() == "true":
            return await streaming_input_chat(self, request)
        return await self._disaggregated("chat", request)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._disaggregated("completion", request)

    async def read_body(self, request: Request) -> dict[str, Any]:
        return await read_json_object(request)

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.setdefault("model", self.config.model_name)
        if model != self.config.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    async def _disaggregated(self, endpoint: Endpoint, request: Request) -> Response:
        started = time.perf_counter()
        body = await read_json_object(request)
        self.check_model(body)
        body["request_id"] = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex

        prefilled = await self.prefill.prefill.remote(endpoint, body)
        if "error" in prefilled:
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{error_status(prefilled)}")
            return error_response(prefilled)

        stream = self.decode.generate.remote(endpoint, {**body, "kv_transfer_params": prefilled["kv_transfer_params"]})
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "decode returned nothing") from None
        except asyncio.CancelledError:  # the client left before the first token: stop decode too
            stream.cancel()
            raise
        if isinstance(first, dict):  # an error before any output, or a complete non-streaming answer
            status = error_status(first) if "error" in first else 200
            if status != 200:
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{status}")
            return JSONResponse(first, status_code=status)
        metrics.observe(metrics.TTFT, time.perf_counter() - started, "time to first token", endpoint=endpoint)
        return StreamingResponse(
            relay(first, stream),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": body["request_id"]},
        )
