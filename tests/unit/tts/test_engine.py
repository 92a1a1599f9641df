"""The TTS role's engine (tts/engine.py), without Ray: requests out of bounds refused naming the field, the
backend's items passed on naming the replica, its failures as error items, the counts; and the real espeak-ng
backend behind it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from core.config import AppConfig
from tts.client import RATE, SpeechChunk
from tts.engine import TtsEngine


class FakeBackend:
    """One second of silence in two items per call; `fail` raises after the first, `refuse` answers an error."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []
        self.started: list[str] = []
        self.fail = self.refuse = False
        self.closed = 0

    async def start(self, voices: list[str]) -> None:
        self.started = voices

    async def synthesize(self, text: str, voice: str, speed: float) -> AsyncIterator[SpeechChunk]:
        self.calls.append((text, voice, speed))
        if self.refuse:
            yield {"error": {"message": "no", "type": "server_error", "param": None, "code": "tts_backend_error"}}
            yield {"audio": b"\0\0"}  # (never read: an error ends the call)
            return
        try:
            yield {"audio": bytes(RATE), "words": [{"start": 0, "end": 5, "audio_ms": 0.0}]}
            await asyncio.sleep(0)
            if self.fail:
                raise RuntimeError("boom")
            yield {"audio": bytes(RATE), "words": []}
        finally:
            self.closed += 1

    async def close(self) -> None:
        pass


def engine(tts: dict[str, Any] | None = None, backend: Any = None) -> TtsEngine:
    config = AppConfig.model_validate({"model": "local:tiny-llama", "tts": tts or {"max_input_chars": 40}})
    return TtsEngine(config, "replica-1", backend or FakeBackend())


async def items(tts: TtsEngine, text: str = "Hello world.", **kwargs: Any) -> list[SpeechChunk]:
    return [item async for item in tts.synthesize(text, **{"voice": "alloy", **kwargs})]


@pytest.mark.parametrize(
    ("text", "kwargs", "param", "code"),
    [
        ("Hello.", {"voice": "robot"}, "voice", "invalid_value"),
        ("Hello.", {"voice": "en-us"}, "voice", "invalid_value"),  # the backend's own name is not a client's
        ("Hello.", {"speed": 0.2}, "speed", "invalid_value"),
        ("Hello.", {"speed": 4.5}, "speed", "invalid_value"),
        ("Hello.", {"speed": float("nan")}, "speed", "invalid_value"),
        ("   ", {}, "input", "invalid_value"),
        ("x" * 41, {}, "input", "string_above_max_length"),
    ],
)
async def test_requests_out_of_bounds_are_refused_naming_the_field(
    text: str, kwargs: dict[str, Any], param: str, code: str
) -> None:
    tts = engine()
    (item,) = await items(tts, text, **kwargs)
    assert item["error"]["type"] == "invalid_request_error"
    assert (item["error"]["param"], item["error"]["code"]) == (param, code)
    assert item["replica"] == "replica-1"
    assert tts.backend.calls == [] and tts.syntheses == 0  # type: ignore[attr-defined]


async def test_the_backends_items_pass_with_the_replica_and_are_counted() -> None:
    tts = engine()
    await tts.start()
    assert tts.backend.started == sorted(set(tts.voices.values()))  # type: ignore[attr-defined]
    got = await items(tts, "x" * 40, voice="coral", speed=0.25)
    assert [len(i["audio"]) for i in got] == [RATE, RATE] and all(i["replica"] == "replica-1" for i in got)
    assert tts.backend.calls == [("x" * 40, "en-us+f3", 0.25)]  # type: ignore[attr-defined]
    stats = tts.stats()
    assert stats["syntheses"] == 1 and stats["audio_seconds"] == 1.0 and stats["in_flight"] == 0
    assert stats["busy_s"] > 0
    info = tts.info()
    assert info["backend"] == "fake" and info["rate"] == RATE and info["model"] == "espeak-ng"
    assert "alloy" in info["voices"] and info["default_voice"] == "alloy" and info["replica"] == "replica-1"


async def test_a_backend_that_fails_ends_the_call_with_an_error_item() -> None:
    tts = engine()
    tts.backend.fail = True  # type: ignore[attr-defined]
    got = await items(tts)
    assert len(got[0]["audio"]) == RATE
    assert got[1]["error"]["type"] == "server_error" and "boom" in got[1]["error"]["message"]
    assert len(got) == 2 and tts.in_flight == 0
    tts.backend.fail, tts.backend.refuse = False, True  # type: ignore[attr-defined]
    got = await items(tts)
    assert [set(i) for i in got] == [{"error", "replica"}]
    assert tts.backend.closed == 1  # type: ignore[attr-defined]


async def test_a_caller_that_leaves_closes_the_backends_stream() -> None:
    tts = engine()
    stream = tts.synthesize("Hello world.", voice="alloy")
    await anext(stream)
    assert tts.in_flight == 1
    await stream.aclose()
    assert tts.in_flight == 0 and tts.backend.closed == 1  # type: ignore[attr-defined]


async def test_the_default_backend_speaks() -> None:
    config = AppConfig.model_validate({"model": "local:tiny-llama"})
    tts = TtsEngine(config, "replica-1")
    await tts.start()
    got = await items(tts, "Hello there, how are you?", voice="shimmer", speed=1.5)
    audio = b"".join(i["audio"] for i in got)
    assert 0.5 < len(audio) / 2 / RATE < 2.5
    assert [w["start"] for i in got for w in i["words"]] == [0, 6, 13, 17, 21]
    assert tts.info()["backend"] == "espeak" and tts.stats()["audio_seconds"] == len(audio) / 2 / RATE


async def test_backend_failures_are_counted_by_code_and_refusals_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from core import metrics

    counted: list[tuple[str, float, str, dict[str, str]]] = []
    monkeypatch.setattr(
        metrics, "inc", lambda name, value=1.0, description="", **tags: counted.append((name, value, description, tags))
    )
    tts = engine()
    await items(tts, "Hello.", voice="robot")  # the request's fault: not the backend's
    await items(tts, "x" * 41)
    assert [c for c in counted if c[0] == metrics.TTS_ERRORS] == []
    tts.backend.fail = True  # type: ignore[attr-defined]
    await items(tts)
    tts.backend.fail, tts.backend.refuse = False, True  # type: ignore[attr-defined]
    await items(tts)
    failures = [(c[1], c[2], c[3]) for c in counted if c[0] == metrics.TTS_ERRORS]
    assert failures == [(1, metrics.TTS_FAILED, {"code": "tts_backend_error", "replica": "replica-1"})] * 2


async def test_the_realtime_factor_is_the_backends_time_not_a_slow_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that holds each item a while does not make the synthesis look slow."""
    from core import metrics

    observed: list[float] = []
    monkeypatch.setattr(metrics, "observe", lambda name, value, *a, **k: observed.append(value))
    tts = engine()
    async for _ in tts.synthesize("Hello world.", voice="alloy"):
        await asyncio.sleep(0.3)
    assert tts.stats()["audio_seconds"] == 1.0  # (two items of 0.5 s, held 0.3 s each)
    assert 0 < tts.stats()["busy_s"] < 0.1 and observed == [tts.stats()["busy_s"]]
