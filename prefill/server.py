"""Prefill replica: computes a prompt's KV and leaves it for a decode replica to pull over NIXL."""

from __future__ import annotations

import copy
import logging
from typing import Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.engine import Endpoint, Engine
from serve_app.protocol import error_payload, validate_openai_body

logger = logging.getLogger(__name__)

# What a prefill request must not carry: it produces one throw-away token and a KV hand-off.
_DROP = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo")
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request turned into a one-token prefill that asks for remote decode."""
    out = {k: v for k, v in copy.deepcopy(body).items() if k not in _DROP}
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if out.get("request_id"):
        out["request_id"] = f"{out['request_id']}-prefill"
    return out


@serve.deployment(name="prefill", max_ongoing_requests=1024, health_check_period_s=10)
class PrefillServer:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        self.config = AppConfig.model_validate(app_config)
        self.engine = Engine(self.config, "prefill")
        await self.engine.start()

    async def prefill(self, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
        """Returns `{"kv_transfer_params", "prompt_tokens"}` or `{"error": ...}` (OpenAI error JSON)."""
        # Validate what the client sent in full before any KV exists, so that a request decode would
        # reject never strands blocks on this replica.
        if (err := validate_openai_body(endpoint, body)) is not None:
            return err
        result = await self.engine.openai(endpoint, prefill_body(body))
        if hasattr(result, "error"):
            return error_payload(result)
        return {"kv_transfer_params": result.kv_transfer_params, "prompt_tokens": result.usage.prompt_tokens}

    async def stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        return await self.engine.compute_stats(request_id_prefix)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        self.engine.shutdown()
