"""REST streaming-input sessions (the streaming-input RFC's multi-request mode).

    POST   /v1/streaming_input/sessions               {model, prompt | messages, sampling..., start_policy}
    POST   /v1/streaming_input/sessions/{id}/chunks    {sequence_id, modality: "text" | "audio", payload, end_of_input}
    POST   /v1/streaming_input/sessions/{id}/finish    (idempotent)
    POST   /v1/streaming_input/sessions/{id}/cancel    stop the answer in progress
    GET    /v1/streaming_input/sessions/{id}/events    SSE: the chat (or completion) chunks, [DONE]
    GET    /v1/streaming_input/sessions/{id}/result    the chat.completion (or text_completion) object
    GET    /v1/streaming_input/sessions/{id}
    DELETE /v1/streaming_input/sessions/{id}

The session lives on its owner prefill replica; every input call here is forwarded there by session id. The
answer streams from decode straight through this router (router/sessions/answers.py): `/events` carries exactly the
frames the same request sent whole would get (`stream_options.include_usage` as given at creation), then,
after `[DONE]` where OpenAI parsers stop reading, one `event: session.done` with the answer's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from core.protocol import error_body, error_response, error_status, sse, streaming_response
from core.tasks import detached
from router.admission.gate import Refusal, admit_session, bind_session, release_session
from router.openai import tool_calls
from router.openai.schemas import ChunkBody, CreateSessionBody, openapi_body, validation_error
from router.sessions import audio as session_audio
from router.sessions import owner
from router.sessions.answers import AnswerReader
from router.sessions.owner import (
    current_tenant,
    session_cancel,
    session_chunk,
    session_delete,
    session_finish,
    session_info,
    session_result,
    session_status,
)
from router.sessions.provisional import Provisional

QUIET_S = 10.0  # a REST session with no call through this router this long is looked up at its owner
ANSWER_DONE = frozenset({"completed", "cancelled", "failed"})  # (prefill/answer.py DONE)

api = APIRouter(prefix="/v1/streaming_input/sessions", tags=["streaming-input"])

SESSION_FIELDS = ("start_policy", "limits", "instructions", "close_after_answer", "preemptive", "audio")


def _ingress(request: Request) -> Any:
    return request.app.state.ingress


def _reply(result: dict[str, Any], status: int = 200) -> JSONResponse:
    if "error" in result:
        return error_response(result)
    return JSONResponse(result, status_code=status)


def session_spec(body: dict[str, Any]) -> dict[str, Any]:
    """Split a create body into the OpenAI request the answer is made from and the session's own settings."""
    policy = body.get("start_policy")
    if isinstance(policy, str):
        policy = {"type": policy, **({"min_tokens": body["min_tokens"]} if "min_tokens" in body else {})}
    request = {k: v for k, v in body.items() if k not in (*SESSION_FIELDS, "min_tokens", "stream")}
    spec = {"request": request, "start_policy": policy, "limits": body.get("limits"), "instructions": None}
    extra = {"preemptive": body.get("preemptive"), "audio": body.get("audio")}
    return {**spec, "close_after_answer": bool(body.get("close_after_answer")), **extra}


@api.post("", status_code=201, openapi_extra=openapi_body(CreateSessionBody))
async def create_session(request: Request) -> Response:
    ingress = _ingress(request)
    body = await ingress.read_body(request)
    try:
        CreateSessionBody.model_validate(body)
    except ValidationError as e:
        return error_response(validation_error(e))
    ingress.check_model(body)
    ingress.check_max_tokens(body)
    if (refused := tool_calls.refusal(body)) is not None:
        return error_response(refused)
    if body.get("audio") is not None and getattr(ingress, "speech", None) is None:
        return error_response(error_body(400, session_audio.NO_SPEECH, "audio"))
    if isinstance(ticket := await admit_session(ingress), Refusal):
        return error_response(ticket.payload())  # (calls on sessions already made are never refused)
    result = await owner.create_session(ingress, session_spec(body), abandoned=ticket.release)
    if "error" in result:
        ticket.release()
        return _reply(result)
    tenant = current_tenant.get()
    bind_session(ingress, result["session_id"], ticket, result.get("expires_in"), tenant)  # until it ends (or idles)
    if body.get("audio") is not None:
        session_audio.remember(result["session_id"], body["audio"])
    return JSONResponse(
        {"object": "streaming_input.session", **result, "session_id": result["session_id"]}, status_code=201
    )


@api.post("/{session_id}/chunks", status_code=202, openapi_extra=openapi_body(ChunkBody))
async def add_chunk(session_id: str, request: Request) -> Response:
    ingress = _ingress(request)
    body = await ingress.read_body(request)
    try:
        chunk = ChunkBody.model_validate(body)
    except ValidationError as e:
        return error_response(validation_error(e))
    if chunk.modality == "audio":  # transcribed by the speech role into the turn (router/sessions/audio.py)
        return _reply(await session_audio.audio_chunk(ingress, session_id, chunk), 202)
    if chunk.end_of_input:  # a text end: an audio turn in progress ends with its transcript so far
        detached(session_audio.close(ingress, session_id, forget=False))
    # An empty end chunk may release a preemptive answer a reader here holds, before the owner has the chunk
    # (router/sessions/provisional.py); the owner refusing the chunk revokes it.
    held = ingress.feeds.held.get(session_id) if chunk.end_of_input and not chunk.payload else None
    if held is not None and not (chunk.mode == "append" and chunk.role == "user" and held.release(chunk.sequence_id)):
        held = None
    try:
        result = await _forward_chunk(ingress, session_id, chunk)
    except Exception as e:
        if held is not None:
            held.revoke(error_body(502, f"the end chunk did not reach the session: {e!r}")["error"])
        raise
    # (A 409 says the turn is over or the session closed: the reader's claim, answered at once, says whether the
    # answer is the one it released. A cancelled call may have reached the owner: the claim says that too.)
    if held is not None and "error" in result and error_status(result) != 409:
        held.revoke(result["error"])
    return _reply(result, 202)


async def _forward_chunk(ingress: Any, session_id: str, chunk: ChunkBody) -> dict[str, Any]:
    return await session_chunk(
        ingress,
        session_id,
        sequence_id=chunk.sequence_id,
        payload=chunk.payload,
        end_of_input=chunk.end_of_input,
        mode=chunk.mode,
        offset=chunk.offset,
        role=chunk.role,
        tool_call_id=chunk.tool_call_id if chunk.role == "tool" else None,  # (a user chunk's is not sent on)
    )


@api.post("/{session_id}/finish")
async def finish(session_id: str, request: Request) -> Response:
    detached(session_audio.close(_ingress(request), session_id, forget=False))  # (an audio turn: as it stands)
    return _reply(await session_finish(_ingress(request), session_id), 202)


@api.post("/{session_id}/cancel")
async def cancel(session_id: str, request: Request) -> Response:
    """Stop the answer in progress (it ends `cancelled`, keeping the text it had; the session goes on)."""
    ingress = _ingress(request)
    result = await session_cancel(ingress, session_id)
    if (stop := result.pop("stop", None)) is not None:
        await ingress.feeds.decode.stop(**stop)  # the answer's decode replica (router/placement.py pins it)
    return _reply(result, 202)


@api.get("/{session_id}")
async def describe(session_id: str, request: Request) -> Response:
    return _reply(await session_info(_ingress(request), session_id))


@api.get("/{session_id}/result")
async def result(
    session_id: str, request: Request, wait: bool = True, turn: Annotated[int | None, Query(ge=0)] = None
) -> Response:
    """The answer as the object a non-streaming request returns, with the session's fields beside it
    (`wait=false`: the session and its answer so far, without waiting)."""
    ingress = _ingress(request)
    if not wait:
        return _reply(await session_result(ingress, session_id, turn=turn, wait=False))
    reader = AnswerReader(ingress, session_id, turn)
    if (err := await reader.open(stream=False)) is not None:
        return error_response(err)
    body = await reader.whole()
    release_session(ingress, session_id)  # answered: no longer in flight for admission
    summary = reader.summary or {"turn": reader.turn, **reader.outcome.as_dict()}
    return JSONResponse({**body, "session_id": session_id, "turn": reader.turn, "answer": summary})


@api.delete("/{session_id}")
async def delete(session_id: str, request: Request) -> Response:
    release_session(_ingress(request), session_id)
    detached(session_audio.close(_ingress(request), session_id))
    return _reply(await session_delete(_ingress(request), session_id))


@api.get("/{session_id}/events")
async def events(session_id: str, request: Request, turn: Annotated[int | None, Query(ge=0)] = None) -> Response:
    """The answer's SSE stream, as a streaming chat (or completion) request would get it. A session with
    `preemptive.stream` gets its preemptive answers' text before the turn ends, as named events
    (`rtpd.provisional`, then `rtpd.provisional.done` with `confirmed` or `discarded`) that OpenAI parsers
    skip; the answer's own frames follow as always."""
    provisional: asyncio.Queue[Provisional] = asyncio.Queue()
    reader = AnswerReader(_ingress(request), session_id, turn, provisional=provisional)
    opening = asyncio.ensure_future(reader.open())
    early: asyncio.Future[Provisional] = asyncio.ensure_future(provisional.get())
    try:
        await asyncio.wait({opening, early}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client left while waiting for its turn to end
        opening.cancel()
        raise
    finally:
        if not early.done():
            early.cancel()
    first = [early.result()] if early.done() and not early.cancelled() else []
    if opening.done() and (err := opening.result()) is not None and not first:
        return error_response(err)

    async def frames() -> AsyncGenerator[str, None]:
        try:
            for event in first:
                yield provisional_event(event)
            while not opening.done():  # the turn goes on: its preemptive answers' text, provisional
                get = asyncio.ensure_future(provisional.get())
                await asyncio.wait({opening, get}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield provisional_event(get.result())
                else:
                    get.cancel()
            while not provisional.empty():
                yield provisional_event(provisional.get_nowait())
            if (err := opening.result()) is not None:  # (the stream began: the error goes as its frame)
                yield sse(err)
                return
            async for forward, _ in reader.items():
                yield forward
            done = reader.summary or {"turn": reader.turn, **reader.outcome.as_dict()}
            yield f"event: session.done\ndata: {json.dumps({'session_id': session_id, **done})}\n\n"
        finally:
            if not opening.done():
                opening.cancel()
            reader.release()  # the client left before the end (a no-op once the outcome is reported)

    headers = {"X-Session-Id": session_id}
    if opening.done():
        headers["X-Session-Turn"] = str(reader.turn)
    if reader.server_timing:
        headers["Server-Timing"] = ", ".join(f"{k};dur={v:.2f}" for k, v in reader.server_timing.items())

    def close() -> None:  # however the response ends: answered (or left), no longer in flight for admission
        if opening.done():
            reader.release()
        else:  # the client left while its turn went on (provisional events had started the response)
            opening.cancel()
            opening.add_done_callback(lambda _: reader.release())
        release_session(_ingress(request), session_id)

    return streaming_response(frames(), close, headers)


def provisional_event(event: Provisional) -> str:
    """A preemptive answer's text (or its end) as a named SSE event: OpenAI clients skip it."""
    kind, fields = event
    name = "rtpd.provisional" if kind == "delta" else "rtpd.provisional.done"
    return f"event: {name}\ndata: {json.dumps(fields)}\n\n"


def ended_for_admission(status: dict[str, Any]) -> bool:
    """Whether a session no longer holds the room its router admitted it to: gone, closed, or its last answer over
    (as when its answer is read to its end through this router)."""
    if "error" in status:
        return error_status(status) == 404
    return status.get("state") == "closed" or (
        status.get("state") != "answering" and status.get("answer_status") in ANSWER_DONE
    )


async def reconcile_sessions(ingress: Any, period_s: float = QUIET_S) -> None:
    """Forever: the REST sessions this router admitted that went quiet here are looked up at their owners, and
    the ones that ended (deleted, or answered, through another router replica) no longer count here; otherwise
    their room stayed taken until their idle timeout (the chaos run left 21 counted on one of two routers)."""
    while True:
        await asyncio.sleep(period_s)
        for session_id, tenant in ingress.admission.quiet_sessions(period_s):
            with contextlib.suppress(Exception):  # (its owner failing over: asked again next time)
                if ended_for_admission(await session_status(ingress, session_id, tenant)):
                    release_session(ingress, session_id)
