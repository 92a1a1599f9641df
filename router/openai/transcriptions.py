"""`POST /v1/audio/transcriptions`: OpenAI's REST transcription (a file upload), served by the speech role.

The form as OpenAI's (`file`, `model`, `language`, `prompt`, `response_format`, `temperature`, `stream`, ...);
the speech replica decodes the file, resamples it and runs vLLM's own transcription layer, so the answer (JSON,
text, verbose_json, or with `stream: true` SSE `transcript.text.delta`-style chunks) is vLLM's. Errors are OpenAI
error JSON: 400 for a missing or unreadable file or a bad field, 404 for an unknown model or with no speech
role, 413 past `limits.max_body_bytes`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from core import metrics
from core.protocol import error_body, error_response, error_status
from router.realtime.audio_settings import OPENAI_TRANSCRIBE_MODELS

api = APIRouter()
TEXT_FORMATS = {"text", "srt", "vtt"}


def _refuse(status: int, message: str, param: str | None = None) -> JSONResponse:
    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{status}")
    return JSONResponse(error_body(status, message, param), status_code=status)


@api.post("/v1/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    ingress = request.app.state.ingress
    speech = getattr(ingress, "speech", None)
    if speech is None:  # (as for a model this server does not serve)
        return _refuse(404, "this server has no speech model (`speech.model` in its config)", "model")
    limit = ingress.config.limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return _refuse(413, f"the request body is {declared} bytes; this server takes at most {limit}")
    try:
        form = await request.form(max_files=1, max_fields=64)
    except Exception as e:  # not multipart, or malformed
        return _refuse(400, f"the body must be multipart/form-data with a `file`: {e}")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        return _refuse(400, "`file` is required: the audio file to transcribe", "file")
    data = await upload.read(limit + 1)
    if len(data) > limit:
        return _refuse(413, f"the file is over {limit} bytes, this server's limit", "file")
    fields: dict[str, Any] = {k: v for k, v in form.items() if k != "file" and isinstance(v, str)}
    model = fields.get("model")
    names = {ingress.config.speech.model_name, *OPENAI_TRANSCRIBE_MODELS}
    if model is not None and model not in names:
        return _refuse(404, f"The model `{model}` does not exist.", "model")
    fields.pop("model", None)
    if "stream" in fields:
        fields["stream"] = fields["stream"].lower() in ("1", "true")
    stream = speech.transcription(data, fields)
    first = await anext(stream.__aiter__())
    if "stream" in first:

        async def frames() -> Any:
            async for frame in stream:
                yield frame

        return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    if "error" in first:
        metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{error_status(first)}")
        return error_response(first)
    response = first["response"]
    usage = response.get("usage") if isinstance(response, dict) else None
    if isinstance(usage, dict) and usage.get("type") == "duration":  # (vLLM's Whisper reports the audio's length)
        metrics.inc(metrics.VOICE_AUDIO_SECONDS, usage["seconds"], "audio seconds received", surface="transcriptions")
    if fields.get("response_format") in TEXT_FORMATS:
        return PlainTextResponse(response.get("text", "") if isinstance(response, dict) else str(response))
    return JSONResponse(response)
