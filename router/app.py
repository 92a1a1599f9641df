"""The ingress: OpenAI-compatible HTTP on FastAPI, forwarding each request prefill → decode.

A request goes to a prefill replica (one token, KV left for remote decode), then with the returned
`kv_transfer_params` to a decode replica that pulls the KV over NIXL and streams the answer; a short prompt,
or one that arrives while prefill is the bottleneck, is prefilled by decode itself (router/openai/disaggregation.py).
The SSE frames are vLLM's own; this router relays them from its decode replica's feed (router/streams/feeds.py): every
frame ready at each step, for all of this router's streams on that replica, in one Ray item. `/health` is 503
until both engines answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from core import logs, metrics
from core.config import AppConfig
from core.protocol import (
    SSE_DONE,
    Endpoint,
    error_body,
    error_response,
    error_status,
    over_max_tokens,
    sse,
    streaming_response,
)
from prefill.client import PrefillClient
from router.admission.gate import Admission, Refusal, Ticket
from router.keys.auth import APIKeys
from router.keys.quota import TokenBudgets
from router.openai import audio_speech, tool_calls, transcriptions
from router.openai.disaggregation import Disaggregation
from router.openai.ndjson import streaming_input_chat
from router.openai.schemas import ChatBody, CompletionBody, is_unicode, openapi_body, validation_error
from router.realtime import socket as realtime
from router.restart import RestartWatch
from router.sessions import rest as sessions
from router.sessions.owner import current_tenant, tenant
from router.streams.feeds import DecodeFailed, DecodeStream, Feeds
from router.streams.forward import ForwardResponse
from speech.client import SpeechClient
from tts.client import TtsClient

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 2.0
READY_RECHECK_S = 1.0

app = FastAPI(title="realtime-pd", version="0.1.0")
app.include_router(sessions.api)
app.include_router(realtime.api)
app.include_router(transcriptions.api)
app.include_router(audio_speech.api)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), status_code=self.status)


class Authenticate:
    """API keys (router/keys/auth.py), for every endpoint but /health when any key is set. Plain ASGI rather than
    Starlette's BaseHTTPMiddleware, which wraps streamed responses and delays the client-disconnect that
    aborts a stream on both engines."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ingress = getattr(scope["app"].state, "ingress", None) if scope["type"] == "http" and "app" in scope else None
        if ingress is not None:
            authorization = Headers(scope=scope).get("authorization")
            path, root = scope.get("path", ""), scope.get("root_path", "")
            if root and path.startswith(root):  # under a route prefix, Serve's `path` includes it
                path = path[len(root) :] or "/"
            if not ingress.api_keys.allows_http(path, authorization):
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="http_401")
                body = error_body(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            if ingress.api_keys.enabled:
                key_id = APIKeys.key_id(APIKeys.bearer(authorization))
                current_tenant.set(key_id)  # sessions belong to this key
                if scope.get("method") == "POST" and (wait := ingress.budgets.retry_after(key_id)) is not None:
                    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="http_429")
                    body = error_body(429, "This API key has used its tokens per minute; retry later.")
                    await JSONResponse(body, status_code=429, headers={"Retry-After": str(wait)})(scope, receive, send)
                    return
        await self.app(scope, receive, send)


app.add_middleware(Authenticate)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{exc.status}")
    return exc.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (no such route, method not allowed) in OpenAI's error form."""
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A path or query parameter of the wrong type: 400 naming it, as for bodies."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"][1:]) or None
    return JSONResponse(error_body(400, f"{param}: {first['msg']}", param), status_code=400)


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return JSONResponse(error_body(500, f"internal error: {exc}"), status_code=500)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object, read at most `limit` bytes far (413 past it, before reading it all)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this server takes at most {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes, this server's limit")
        parts.append(part)
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (RecursionError: nested past the parser's depth)
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if not is_unicode(raw, body):
        raise APIError(400, "request body holds an unpaired surrogate: its text is not Unicode")
    return body


def take_usage(text: str, keep: bool) -> tuple[str, dict[str, Any] | None]:
    """The usage frame's usage out of a relayed item; the item without that frame unless `keep`."""
    usage, frames = None, []
    for frame in text.split("\n\n"):
        if frame.startswith("data: {") and '"usage"' in frame:
            parsed = json.loads(frame[6:])
            if parsed.get("usage") and not parsed.get("choices"):
                usage = parsed["usage"]
                if not keep:
                    continue
        frames.append(frame)
    return "\n\n".join(frames), usage


async def relay(
    first: str,
    stream: DecodeStream,
    charge: Callable[[dict[str, Any] | None], None] | None = None,
    keep: bool = True,
    tools: str | None = None,
) -> AsyncGenerator[str, None]:
    """SSE relay for a stream whose frames the router reads on their way (any other goes through
    router/streams/forward.py). A failure after the stream started becomes an SSE error event, then `[DONE]`. With
    `charge` (per-key token budgets), the usage frame is read off the stream (and dropped if the client had not asked
    for it). With `tools` (the surface, for a request that has tools), its tool calls are counted."""
    try:
        text: str | None = first
        while text is not None:
            if tools is not None:
                tool_calls.count(tools, tool_calls.count_in_frames(text))
            if charge is not None and '"usage"' in text:
                text, usage = take_usage(text, keep)
                charge(usage)
            yield text
            text = await anext(stream, None)
    except DecodeFailed as e:  # the decode replica failed mid-stream
        logger.error("decode stream failed: %s", e)
        metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="mid_stream")
        yield sse({"error": e.error})
        yield SSE_DONE
    finally:
        stream.cancel()  # client gone or stream over: nothing may keep running on the decode engine


@serve.deployment(name="router", max_ongoing_requests=4096)
@serve.ingress(app)
class Router:
    def __init__(
        self,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        app_config: dict[str, Any],
        speech: DeploymentHandle | None = None,
        tts: DeploymentHandle | None = None,
    ) -> None:
        logs.setup()
        self.config = AppConfig.model_validate(app_config)
        # The speech role (speech/), when the config has a speech model: realtime audio, audio chunks of sessions
        # and /v1/audio/transcriptions (router/voice/). Its model's window is read once it answers.
        self.speech = SpeechClient(speech) if speech is not None else None
        self.speech_window_s: float | None = None
        # The speech-out role (tts/), when the config has a TTS backend: realtime audio output and /v1/audio/speech.
        self.tts = TtsClient(tts) if tts is not None else None
        if self.speech is not None:
            from router.voice.vad import warm_up

            warm_up()  # (the VAD model loads in the background: ~1.5 s, before the first audio)
        # Calls to prefill and decode go over gRPC, by value (their clients' handles), rather than through Ray's
        # object store: measured 1.7-1.9x the tokens/s at 32 and 128 streams (serve_app/serve_env.py: the proxy's half).
        self.prefill = PrefillClient(prefill)
        self.decode = decode.options(_by_reference=False)
        replica_id = serve.get_replica_context().replica_id
        feed, start = self.config.decode.feed, self.config.decode.start
        self.feeds = Feeds(self.decode, replica_id.unique_id, direct=feed == "direct", direct_start=start == "direct")
        # This replica's Ray actor name: the sessions whose client connection it holds (realtime, NDJSON) are
        # closed by their owners if it dies (prefill/session.py `orphaned`).
        self.replica_name = replica_id.to_full_id_str()
        self.created = int(time.time())
        self.api_keys = APIKeys(self.config.router.api_keys)
        self.budgets = TokenBudgets(self.config.limits.tokens_per_minute_per_key if self.api_keys.enabled else None)
        self.disaggregation = Disaggregation(self.config)
        self.disaggregation.start()
        # New work is refused while the pools are full (router/admission/gate.py), from their routing stats.
        self.admission = Admission(
            self.config.router.admission,
            self.config.engine_for("decode").max_num_seqs,
            max_hold_s=self.config.limits.max_session_s,
        )
        self.restart = RestartWatch()  # closes realtime connections with 1012 when this replica stops
        self.restart.start()
        # REST sessions admitted here and ended through another router replica stop counting here.
        self._reconcile = asyncio.get_running_loop().create_task(sessions.reconcile_sessions(self))
        self._ready_at = 0.0  # when both engines last answered
        app.state.ingress = self  # the session and realtime routes reach the handles through it

    def admission_state(self) -> dict[str, Any]:
        """This router replica's admission: work in flight by kind (tests check nothing is left counted)."""
        return self.admission.state()

    async def engines_ready(self) -> bool:
        """Every engine answers: prefill, decode, and speech and TTS where the config has them (checked at most once
        a second while ready). Serve does not route to a replica
        before its constructor, which loads the engine, has returned; the router itself is up long before."""
        if time.monotonic() - self._ready_at < READY_RECHECK_S:
            return True
        checks = [self.prefill.check_health(), self.feeds.decode.check_health()]
        if self.tts is not None:
            checks.append(self.tts.info())
        if self.speech is not None:
            checks.append(self.speech.info())  # (last: its answer is read below)
        try:
            answers = await asyncio.wait_for(asyncio.gather(*checks), READY_TIMEOUT_S)
        except Exception:  # a timeout (no replica ready yet) or a failed engine
            return False
        if self.speech is not None:
            self.speech_window_s = answers[-1].get("window_s")
        self._ready_at = time.monotonic()
        return True

    async def not_ready(self) -> JSONResponse | None:
        if await self.engines_ready():
            return None
        body = error_body(503, "the engines are still loading (or none is healthy); retry")
        body["error"]["retry_after"] = 5
        return error_response(body)

    @app.get("/health")
    async def health(self) -> Response:
        return await self.not_ready() or JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self) -> Any:
        if (refused := await self.not_ready()) is not None:
            return refused
        names = [self.config.model_name]
        if self.speech is not None and self.config.speech.model_name:  # listed as vLLM lists a speech model
            names.append(self.config.speech.model_name)
        if self.tts is not None:  # (the speech-out model: `/v1/audio/speech`'s `model`)
            names.append(self.config.tts.model_name)
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "realtime-pd"} for name in names]
        return {"object": "list", "data": cards}

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatBody))
    async def chat_completions(self, request: Request) -> Response:
        if request.headers.get("x-streaming-input", "").lower() == "true":
            return await streaming_input_chat(self, request)
        return await self._disaggregated("chat", request)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
    async def completions(self, request: Request) -> Response:
        return await self._disaggregated("completion", request)

    async def read_body(self, request: Request) -> dict[str, Any]:
        return await read_json_object(request, self.config.limits.max_body_bytes)

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.setdefault("model", self.config.model_name)
        if model != self.config.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def check_max_tokens(self, body: dict[str, Any]) -> None:
        """`limits.max_tokens` (when set; the engine itself refuses more than the context)."""
        if (over := over_max_tokens(body, self.config.limits.max_tokens)) is not None:
            raise APIError(400, over[1], over[0])

    def check_tools(self, body: dict[str, Any]) -> None:
        """Each tool's `parameters` is a JSON Schema (400 naming the tool otherwise)."""
        if (refused := tool_calls.refusal(body)) is not None:
            raise APIError(400, refused["error"]["message"], refused["error"]["param"])

    def charge(self, usage: dict[str, Any] | None) -> None:
        """The caller's key pays what its request used (router/keys/quota.py)."""
        self.budgets.charge(tenant(), usage)

    async def _disaggregated(self, endpoint: Endpoint, request: Request) -> Response:
        started = time.perf_counter()
        if isinstance(ticket := await self.admission.admit("request"), Refusal):  # before any work (the body unread)
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="http_429")
            return error_response(ticket.payload())
        try:  # the request is in flight for admission until its answer ends
            response = await self._forward(endpoint, request, started, ticket)
        except BaseException:
            ticket.release()
            raise
        if not isinstance(response, StreamingResponse | ForwardResponse):  # (a streamed answer releases it at its end)
            ticket.release()
        return response

    async def _forward(self, endpoint: Endpoint, request: Request, started: float, ticket: Ticket) -> Response:
        body = await self.read_body(request)
        try:
            (ChatBody if endpoint == "chat" else CompletionBody).model_validate(body)
        except ValidationError as e:
            return error_response(validation_error(e))
        self.check_model(body)
        self.check_max_tokens(body)
        self.check_tools(body)
        # Per-key token budgets read the usage off the stream (dropped again unless the client asked for it).
        charging = self.budgets.enabled and bool(tenant())
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if charging and body.get("stream"):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        body["request_id"] = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex

        where, why = self.disaggregation.choose(endpoint, body)
        decode_body = body
        decided = time.perf_counter()
        if where == "prefill":
            with self.disaggregation.prefilling():
                prefilled = await self.prefill.prefill(endpoint, body)
            if "error" not in prefilled:
                decode_body = {**body, "kv_transfer_params": prefilled["kv_transfer_params"]}
            elif error_status(prefilled) == 429 and self.config.router.disaggregation.fallback_on_overload:
                where, why = "decode", "prefill_refused"
            else:
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{error_status(prefilled)}")
                return error_response(prefilled)
        self.disaggregation.count(where, why)
        prefilled_at = time.perf_counter()

        opened = await self.feeds.open(endpoint, decode_body)
        first: Any
        if isinstance(opened, dict):  # an error before any output, or a complete non-streaming answer
            first = opened if "error" in opened else opened["response"]
        else:
            try:
                first = await anext(opened)
            except StopAsyncIteration:
                raise APIError(500, "decode returned nothing") from None
            except DecodeFailed as e:
                first = {"error": e.error}
            except asyncio.CancelledError:  # the client left before the first token: stop decode too
                opened.cancel()
                raise
        now = time.perf_counter()
        # Where the time to the first byte went (W3C Server-Timing; bench/ reads it): this router, the prefill
        # call (router → prefill replica → engine → back), decode's first item (NIXL pull, first token, hop).
        timing = {"router": decided - started, "prefill": prefilled_at - decided, "decode": now - prefilled_at}
        headers = {
            "X-Request-Id": body["request_id"],
            "X-Prefilled-By": where,
            "Server-Timing": ", ".join(f"{k};dur={v * 1000:.2f}" for k, v in timing.items()),
        }
        if isinstance(first, dict):  # an error before any output, or a complete non-streaming answer
            status = error_status(first) if "error" in first else 200
            if status != 200:
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{status}")
            else:
                if charging:
                    self.charge(first.get("usage"))
                if body.get("tools"):
                    calls = [(c.get("message") or {}).get("tool_calls") or [] for c in first.get("choices") or []]
                    tool_calls.count(endpoint, sum(map(len, calls)))
            return JSONResponse(first, status_code=status, headers=headers)
        metrics.observe(metrics.TTFT, now - started, "time to first token", endpoint=endpoint)
        assert isinstance(opened, DecodeStream)
        tools = endpoint if body.get("tools") else None

        def close() -> None:
            opened.cancel()
            ticket.release()

        if not charging and tools is None:  # its bytes go from the feed to the client (router/streams/forward.py)
            return ForwardResponse(first, opened, headers, close)
        frames = relay(first, opened, self.charge if charging else None, keep=wants_usage, tools=tools)
        return streaming_response(frames, close, headers)
