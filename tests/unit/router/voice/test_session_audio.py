"""REST sessions' audio chunks (router/sessions/audio.py), on a fake speech pool and owner: when the session id
hashes to a new speech replica (the pool grew) while an older one holds the turn, the chunk still reaches the
turn's audio, through any router replica; only when no replica holds it is it refused (409)."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import pytest

from core.protocol import error_body, error_status
from router.openai.schemas import ChunkBody
from router.sessions import audio as session_audio
from speech.client import SpeechClient


class Replica:
    """One speech replica's audio turns: the chunks' labels in order."""

    def __init__(self, name: str) -> None:
        self.name, self.turns = name, {}

    def append(self, session_id: str, label: str, end: bool) -> dict[str, Any]:
        start = session_id not in self.turns
        heard = self.turns.setdefault(session_id, [])
        heard.append(label)
        text = " ".join(heard)
        if end:
            del self.turns[session_id]
        return {"text": text, "final": end, "start": start, "replica": self.name}


class Pool:
    """The speech deployment's handle: `route_to` when given and alive, else the replica the id 'hashes' to."""

    def __init__(self, *names: str) -> None:
        self.replicas = {name: Replica(name) for name in names}
        self.hashes_to = names[0]
        self.session_audio = self._method(
            lambda r, kw: r.append(kw["session_id"], LABELS[kw["pcm16"]], kw["end_of_input"])
        )
        self.session_audio_close = self._method(lambda r, kw: r.turns.pop(kw["session_id"], None))
        self.session_audio_holds = self._method(lambda r, kw: {"holds": kw["session_id"] in r.turns, "replica": r.name})

    def options(self, **options: Any) -> Pool:  # (the speech client's handle options)
        return self

    def _method(self, fn: Any) -> Any:
        pool = self

        class Method:
            def remote(self, **kw: Any) -> Any:
                name = kw.get("route_to") if kw.get("route_to") in pool.replicas else pool.hashes_to
                kw["end"] = kw.get("end_of_input", False)

                async def call() -> Any:
                    return fn(pool.replicas[name], kw)

                return call()

        return Method()


LABELS: dict[bytes, str] = {}


def chunk(seq: int, label: str, end: bool = False) -> ChunkBody:
    pcm = label.encode().ljust(8, b"\0")[:8]
    LABELS[pcm] = label
    payload = base64.b64encode(pcm).decode()
    return ChunkBody.model_validate({"sequence_id": seq, "payload": payload, "modality": "audio", "end_of_input": end})


@pytest.fixture
def owner(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The session's owner: its turn's transcript, refusing a transcript that starts a turn which has one."""
    state: dict[str, Any] = {"transcript": None}

    async def session_info(ingress: Any, session_id: str) -> dict[str, Any]:
        return {"audio": {"rate": 16000}}

    async def session_chunk(ingress: Any, session_id: str, **kw: Any) -> dict[str, Any]:
        assert kw["mode"] == "transcript"  # (the speech replica's transcript of the audio chunk)
        if kw["audio_start"] and state["transcript"] is not None:
            return error_body(409, "the speech replica that held this turn's audio stopped", "sequence_id")
        state["transcript"] = None if kw["end_of_input"] else kw["payload"]
        state["last"] = kw["payload"]
        return {"accepted": kw["sequence_id"]}

    # (the session's other owner calls would reach the ingress, which has no prefill client here)
    monkeypatch.setattr(session_audio.owner, "session_info", session_info)
    monkeypatch.setattr(session_audio.owner, "session_chunk", session_chunk)
    return state


def another_router() -> None:
    """The next chunk comes through another router replica: it has learnt nothing of this session."""
    session_audio._HOLDERS.clear()
    session_audio._RATES.clear()


async def test_a_turn_held_by_an_older_replica_goes_on_there_after_the_pool_grows(
    owner: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = Pool("old", "new")
    monkeypatch.setattr(session_audio, "pool_replicas", lambda name: list(pool.replicas))
    ingress = SimpleNamespace(speech=SpeechClient(pool))
    assert (await session_audio.audio_chunk(ingress, "s1", chunk(0, "hello")))["transcript"] == "hello"
    pool.hashes_to = "new"  # a replica added: the session id hashes there now
    assert (await session_audio.audio_chunk(ingress, "s1", chunk(1, "there")))["transcript"] == "hello there"
    another_router()
    done = await session_audio.audio_chunk(ingress, "s1", chunk(2, "friend", end=True))
    assert done["transcript"] == "hello there friend" and done["transcript_final"]
    assert owner["last"] == "hello there friend"
    assert pool.replicas["new"].turns == {} and pool.replicas["old"].turns == {}  # (the stray turn closed too)


async def test_a_turn_whose_replica_is_gone_is_refused_not_half_transcribed(
    owner: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = Pool("old", "new")
    monkeypatch.setattr(session_audio, "pool_replicas", lambda name: list(pool.replicas))
    ingress = SimpleNamespace(speech=SpeechClient(pool))
    await session_audio.audio_chunk(ingress, "s2", chunk(0, "hello"))
    del pool.replicas["old"]  # it stopped, and the turn's audio with it
    pool.hashes_to = "new"
    another_router()
    refused = await session_audio.audio_chunk(ingress, "s2", chunk(1, "there"))
    assert error_status(refused) == 409 and owner["last"] == "hello"
    assert pool.replicas["new"].turns == {}
