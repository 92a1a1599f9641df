"""A speech replica's REST audio turns (speech/sessions.py) with a fake transcription: retries answered the same,
out-of-order chunks refused (never dropped), a failed end chunk tried again, the turn gone once it ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from core.config import SpeechConfig
from speech.sessions import AudioSessions

PCM = b"\0\1" * 1600  # 100 ms at 16 kHz


class FakeServer:
    def __init__(self) -> None:
        self.config = SimpleNamespace(speech=SpeechConfig(model="local:tiny-whisper", partial_every_ms=100))
        self.engine = SimpleNamespace(max_clip_s=5.0)
        self.fail = 0
        self.calls = 0

    async def transcribe(self, pcm: bytes, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            return {"error": {"message": "the model failed", "code": 500}}
        return {"text": f"{len(pcm) // 32} ms"}


async def test_retries_out_of_order_chunks_and_a_failed_end() -> None:
    server = FakeServer()
    sessions = AudioSessions(server)
    first = await sessions.append("s", 0, PCM, 16000, False, None)
    assert first["start"] and not first["final"]
    await asyncio.sleep(0.05)
    second = await sessions.append("s", 2, PCM, 16000, False, None)  # (1 was a text chunk, say)
    assert not second["start"] and second["text"] == "100 ms"  # the partial of the first chunk
    assert (await sessions.append("s", 2, PCM, 16000, False, None))["duplicate"]  # a retry: the same answer
    late = await sessions.append("s", 1, PCM, 16000, False, None)  # never answered, below the last taken
    assert late["error"]["code"] == 409 and late["error"]["param"] == "sequence_id"
    server.fail = 1  # the end's transcription fails
    failed = await sessions.append("s", 3, PCM, 16000, True, None)
    assert failed["error"]["code"] == 502
    ended = await sessions.append("s", 3, PCM, 16000, True, None)  # tried again: its audio once, not twice
    assert ended["final"] and ended["text"] == "300 ms"
    assert "s" not in sessions.turns
    assert (await sessions.append("s", 3, PCM, 16000, True, None))["text"] == "300 ms"  # retried after the end
    next_turn = await sessions.append("s", 4, PCM, 16000, False, None)
    assert next_turn["start"]
    sessions.close("s")
    assert "s" not in sessions.turns
