"""A slow realtime reader (router/realtime/response.py) gets fewer, larger deltas, never less text, and never holds
the source: decode's frames queue in the router's `DecodeStream` (router/streams/feeds.py) as fast as they come, and
each send to the client carries everything queued since the last one."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from core.config import AppConfig
from core.protocol import SSE_DONE, sse
from prefill.client import PrefillClient
from router.realtime import response as realtime_response
from router.realtime import socket as realtime
from router.sessions.answers import AnswerReader
from router.streams.feeds import DecodeStream, _End
from tests.unit.router.test_realtime import MODEL, FakePrefill

pytestmark = pytest.mark.timeout(30)

TOKENS = [f"tok{i} " for i in range(200)]
SEND_S = 0.02  # the client takes 20 ms per event: 4 s for one event per token


def frame(content: str | None = None, finish: str | None = None) -> str:
    delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return sse(
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [choice]}
    )


class SlowSocket:
    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []

    async def send_text(self, text: str) -> None:
        await asyncio.sleep(SEND_S)
        self.events.append((time.monotonic(), json.loads(text)))


class Source:
    """Decode's frames, pushed into the answer's stream as the router's feed reader does (put_nowait: it never
    waits for the client), one per millisecond."""

    def __init__(self) -> None:
        self.stream = DecodeStream(SimpleNamespace(streams={}, stop=lambda _: None), "s1")  # type: ignore[arg-type]
        self.done_at = 0.0

    async def pump(self) -> None:
        for token in TOKENS:
            self.stream.queue.put_nowait((frame(token), None))  # (text, token ids)
            await asyncio.sleep(0.001)
        self.stream.queue.put_nowait((frame("", "stop") + SSE_DONE, None))
        self.stream.queue.put_nowait(_End(None))
        self.done_at = time.monotonic()


async def test_a_slow_reader_gets_coalesced_deltas_and_all_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    source = Source()

    class Reader(AnswerReader):
        async def open(self, stream: bool = True, retried: bool = False) -> dict[str, Any] | None:
            self.claim, self._stream, self._first = {"turn": 0, "endpoint": "chat"}, source.stream, frame()
            asyncio.get_running_loop().create_task(source.pump())
            return None

    monkeypatch.setattr(realtime_response, "AnswerReader", Reader)
    ingress = SimpleNamespace(
        config=SimpleNamespace(model_name=MODEL, limits=AppConfig().limits, speech=AppConfig().speech),
        prefill=PrefillClient(FakePrefill()),
    )
    socket = SlowSocket()
    connection = realtime.RealtimeConnection(socket, ingress, MODEL, beta=False)  # type: ignore[arg-type]
    connection.session_id = "sess-1"

    await realtime_response.ResponseStream(connection, connection.conversation, 0).task

    events = {e["type"]: e for _, e in socket.events}
    deltas = [(at, e["delta"]) for at, e in socket.events if e["type"] == "response.output_text.delta"]
    text = "".join(TOKENS)
    assert "".join(d for _, d in deltas) == text == events["response.output_text.done"]["text"]  # no text dropped
    assert len(deltas) < len(TOKENS) / 4  # fewer, larger deltas
    assert source.done_at < deltas[-1][0]  # the source was drained while the client was still reading
    assert source.stream.queue.empty()
    assert events["response.done"]["response"]["status"] == "completed"
