"""Decode replica: pulls a prompt's KV from the prefill replica over NIXL and streams the answer."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.engine import Endpoint, Engine, coalesce
from serve_app.protocol import error_payload

logger = logging.getLogger(__name__)


@serve.deployment(name="decode", max_ongoing_requests=1024, health_check_period_s=10)
class DecodeServer:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        self.config = AppConfig.model_validate(app_config)
        self.engine = Engine(self.config, "decode")
        await self.engine.start()

    async def generate(self, endpoint: Endpoint, body: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """Stream one OpenAI request whose `kv_transfer_params` point at a prefill replica's KV.

        Yields a dict first when there is no stream (`{"error": ...}` or the full response JSON);
        otherwise SSE text, each item holding every frame ready at that moment (see `coalesce`).
        Cancelling the call (client gone) closes vLLM's generator, which aborts the engine request.
        """
        result = await self.engine.openai(endpoint, body)
        if hasattr(result, "error") and not hasattr(result, "__aiter__"):
            yield error_payload(result)
            return
        if not hasattr(result, "__aiter__"):
            yield result.model_dump(mode="json")
            return
        async for text in coalesce(result):
            yield text

    async def stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        return await self.engine.compute_stats(request_id_prefix)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        self.engine.shutdown()
