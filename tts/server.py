"""TTS replica: speaks text for the router (tts/engine.py and its backend), nothing else.

The router sends an answer a sentence at a time (or a whole `/v1/audio/speech` input) and streams the audio on as
it comes: each item of `synthesize` is PCM16 mono at 24 kHz with the words that start in it. A replica holds no
state between calls, so any replica takes any call, and one that dies costs the calls it was making. It reports
its syntheses in flight for autoscaling (`record_autoscaling_stats`, as speech and decode report theirs), and the
audio seconds it made, its real-time factor and the syntheses its backend failed as Prometheus metrics.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from core import logs, metrics
from core.autoscaling import ACTIVE_STREAMS
from core.config import AppConfig
from tts.client import SpeechChunk, TtsInfo
from tts.engine import TtsEngine


@serve.deployment(name="tts", max_ongoing_requests=256, health_check_period_s=10)
class TtsServer:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        logs.setup()
        self.config = AppConfig.model_validate(app_config)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine = TtsEngine(self.config, self.replica)
        await self.engine.start()

    async def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncGenerator[SpeechChunk, None]:
        """`text` spoken by `voice` at `speed`: audio and words as they are made, or one error item."""
        async for chunk in self.engine.synthesize(text, voice=voice, speed=speed):
            yield chunk

    def info(self) -> TtsInfo:
        """The model name clients may use, the backend, the audio rate, the voices."""
        return self.engine.info()

    def record_autoscaling_stats(self) -> dict[str, float]:
        in_flight = self.engine.in_flight
        metrics.set_gauge(metrics.TTS_IN_FLIGHT, in_flight, "syntheses in flight", replica=self.replica)
        return {ACTIVE_STREAMS: float(in_flight)}

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def pid(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "replica": self.replica}

    async def check_health(self) -> None:
        """Nothing to check beyond the replica answering: an embedded backend has no process of its own, and a
        remote server's failures are its calls' errors (a replica restarted for them would not bring it back)."""
