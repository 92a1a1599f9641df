"""REST sessions' audio chunks (`modality: "audio"`): transcribed by the speech role into the session's input.

The chunk's audio goes to the speech replica that holds the session's audio turn (speech/sessions.py): the one this
router learnt holds it, else the one the session id hashes to. When speech replicas are added, the id may hash to a
new one while an older one holds the turn (and another router replica may have taken the turn's earlier chunks): the
new one starts a turn, the owner refuses its transcript (409: the turn has one), and the router asks the replicas
which holds the turn and sends the chunk there; only when none does is the audio lost (the 409 says so).

The speech replica's answer, the turn's transcript so far, goes to the session's owner as a `transcript` chunk with
the client's sequence id (prefill/session.py: it replaces the turn's last transcript, and only the changed suffix is
prefilled again). The end chunk carries the whole turn's final transcript. The 202's body adds `transcript`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any

from core import metrics
from core.placement import pool_replicas
from core.protocol import error_body, error_status
from router.openai.schemas import ChunkBody
from router.sessions import owner
from router.voice.audio import AudioError, b64decode
from speech.client import SpeechClient

NO_SPEECH = "this server has no speech model (`speech.model` in its config): audio input is not supported"
_RATES: OrderedDict[str, dict[str, Any]] = OrderedDict()  # session id -> its audio settings (read from its owner)
_RATES_KEPT = 10_000
_HOLDERS: OrderedDict[str, str] = OrderedDict()  # session id -> the speech replica holding its audio turn (learnt)


async def audio_settings(ingress: Any, session_id: str) -> dict[str, Any] | None:
    """The session's `audio` settings as created (any router replica may get its chunks: read once from the
    owner, then kept here); None if the session is not there."""
    if (known := _RATES.get(session_id)) is not None:
        return known
    info = await owner.session_info(ingress, session_id)
    if "error" in info:
        return None
    remember(session_id, info.get("audio") or {})
    return _RATES[session_id]


def remember(session_id: str, audio: dict[str, Any]) -> None:
    _RATES[session_id] = {"rate": 16000, **(audio or {})}
    while len(_RATES) > _RATES_KEPT:
        _RATES.popitem(last=False)


async def audio_chunk(ingress: Any, session_id: str, chunk: ChunkBody) -> dict[str, Any]:
    """One audio chunk: the owner's reply to its transcript chunk (with `transcript`), or an error body."""
    speech = getattr(ingress, "speech", None)
    if speech is None:
        return error_body(
            400,
            "this server has no speech model (`speech.model` in its config): audio chunks are not supported",
            "modality",
        )
    if chunk.mode != "append" or chunk.role != "user":
        return error_body(400, "an audio chunk appends the user's speech: mode must be append, role user", "mode")
    try:
        raw = b64decode(chunk.payload, "payload")
    except AudioError as e:
        return error_body(400, e.message, e.param)
    if len(raw) % 2:
        return error_body(400, f"`payload` holds {len(raw)} bytes: 16-bit PCM needs an even count", "payload")
    settings = await audio_settings(ingress, session_id)
    if settings is None:  # the owner's own error says why (not found, closed)
        return await owner.session_info(ingress, session_id)
    metrics.inc(
        metrics.VOICE_AUDIO_SECONDS, len(raw) / 2 / settings["rate"], "audio seconds received", surface="session"
    )
    call = {
        "session_id": session_id,
        "sequence_id": chunk.sequence_id,
        "pcm16": raw,
        "rate": settings["rate"],
        "end_of_input": chunk.end_of_input,
        "language": settings.get("language"),
    }
    result, heard = await _transcribed(ingress, speech, call, _HOLDERS.get(session_id))
    if "error" in result and error_status(result) == 409 and heard.get("start"):  # this replica holds no audio of it
        await speech.session_audio_close(session_id=session_id, replica=heard.get("replica"))
        holder = await _holder(speech, session_id, other_than=heard.get("replica"))
        if holder is not None:  # (the id hashes elsewhere since speech replicas were added)
            result, heard = await _transcribed(ingress, speech, call, holder)
    if "error" in result:
        return result
    _learn(session_id, None if heard.get("final") else heard.get("replica"))
    return {**result, "transcript": heard["text"], "transcript_final": bool(heard.get("final"))}


async def _transcribed(
    ingress: Any, speech: SpeechClient, call: dict[str, Any], holder: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chunk's audio into its turn on `holder` (None: the replica the session id hashes to), then the turn's
    transcript to the owner: (the owner's reply or an error body, the speech replica's answer)."""
    try:
        heard = await speech.session_audio(**call, replica=holder)
    except Exception as e:  # the speech replica died mid-call (Ray's actor errors): the client may retry
        metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="speech_replica")
        body = error_body(503, f"the speech replica holding this session's audio failed ({type(e).__name__}): retry")
        body["error"]["retry_after"] = 2
        return body, {}
    if "error" in heard:
        return heard, heard
    result = await owner.session_chunk(
        ingress,
        call["session_id"],
        sequence_id=call["sequence_id"],
        payload=heard["text"],
        end_of_input=call["end_of_input"],
        mode="transcript",
        audio_start=bool(heard.get("start")),
    )
    return result, heard


async def _holder(speech: SpeechClient, session_id: str, other_than: str | None) -> str | None:
    """The live speech replica that holds the session's audio turn, asked of each (None: none does)."""
    for replica in pool_replicas("speech"):
        if replica == other_than:
            continue
        with contextlib.suppress(Exception):  # (one stopping meanwhile holds nothing that can go on)
            held = await speech.session_audio_holds(session_id=session_id, replica=replica)
            if held.get("holds") and held.get("replica") == replica:
                return replica
    return None


def _learn(session_id: str, holder: str | None) -> None:
    _HOLDERS.pop(session_id, None)
    if holder is not None:  # (a turn ended: its next audio may start anywhere)
        _HOLDERS[session_id] = holder
        while len(_HOLDERS) > _RATES_KEPT:
            _HOLDERS.popitem(last=False)


async def close(ingress: Any, session_id: str, forget: bool = True) -> None:
    """The session is gone (`forget`), or its input ended some other way than an audio end chunk (a text end,
    `/finish`: the turn is answered from its transcript so far): so is its audio turn, if one is open."""
    _HOLDERS.pop(session_id, None)
    if forget:
        _RATES.pop(session_id, None)
    elif session_id not in _RATES:
        return  # (no audio sent through this router replica: most likely none at all)
    if (speech := getattr(ingress, "speech", None)) is not None:
        await speech.session_audio_close(session_id=session_id)
