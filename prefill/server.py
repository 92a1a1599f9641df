"""Prefill replica: computes prompts' KV and leaves it for a decode replica to pull over NIXL.

Two kinds of work: a whole prompt (`prefill`: the router then calls decode), and streaming-input sessions that
live here between chunks, their KV resident (prefill/session_api.py), and hand off to decode at end of input
(prefill/handoff.py). This module is the deployment: the engine, whole prompts, the scheduler's settings and
figures; sessions changing owner (a dead replica's, or a draining one's) are prefill/failover.py's.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from typing import Any

from ray import serve

from core import logs, metrics
from core.autoscaling import OPEN_SESSIONS
from core.config import AppConfig
from core.protocol import Endpoint, error_payload, validate_openai_body
from core.scheduler_config import SchedulerSettings
from decode.client import DecodeClient
from engine.llm import Engine
from prefill.errors import overloaded
from prefill.scheduler.profile import start_scheduler
from prefill.session import Session, SessionState
from prefill.session_api import SessionAPI
from prefill.store import make_store
from prefill.streaming import StreamingPrefill

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


def prefill_body(body: dict[str, Any], endpoint: Endpoint = "chat") -> dict[str, Any]:
    """The client's request turned into a one-token prefill that asks for remote decode."""
    out = {k: v for k, v in copy.deepcopy(body).items() if k not in _DROP}
    if isinstance(out.get("vllm_xargs"), dict):  # the scheduler's ranking keys are the server's to set
        out["vllm_xargs"] = {k: v for k, v in out["vllm_xargs"].items() if not str(k).startswith("rtpd_")}
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if out.get("request_id"):
        out["request_id"] = f"{out['request_id']}-prefill"
    if reuses_ids(endpoint, body):  # the prompt's ids go to decode with the KV (`decode_params`)
        out["return_token_ids"] = True
    return out


def reuses_ids(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Whether decode starts from the prefill's prompt ids: a chat, unless the client asked for the rendered
    prompt's text back (`return_prompt_text`, `echo`), which vLLM has only when it renders the prompt itself."""
    return endpoint == "chat" and not body.get("return_prompt_text") and not body.get("echo")


def decode_params(endpoint: Endpoint, body: dict[str, Any], result: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` decode gets from a prefill's response: where the KV is, and for a chat the
    prompt's token ids (vLLM's decode-side token reuse: decode starts from them instead of rendering the chat
    template and tokenizing again, ~3 ms a request here, and its prompt is the KV's by construction). Not when
    the client asked for the rendered prompt's text (`return_prompt_text`, `echo`): decode needs to render it."""
    params = result.kv_transfer_params
    ids = getattr(result, "prompt_token_ids", None)
    if params is None or not ids or not reuses_ids(endpoint, body):
        return params
    return {**params, "prompt_token_ids": ids}


@serve.deployment(name="prefill", max_ongoing_requests=1024, health_check_period_s=10)
class PrefillServer(SessionAPI):
    async def __init__(self, app_config: dict[str, Any], decode: Any = None) -> None:
        logs.setup()
        self.config = AppConfig.model_validate(app_config)
        # Preemptive answers start decode themselves (prefill/preemptive.py); their tokens never come here.
        self.decode = DecodeClient(decode) if decode is not None else None
        self.engine = Engine(self.config, "prefill")
        await self.engine.start()
        await start_scheduler(self.engine, self.settings)
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.app_name, self.deployment = context.app_name, context.deployment
        self.sessions: dict[str, Session] = {}
        self.store = make_store(self.config.prefill.session_store)  # sessions outlive this replica there
        self._scheduler_stats: dict[str, Any] = {}  # the engine scheduler's last figures (the sweeper reads them)
        self._sweeper = asyncio.create_task(self._sweep())

    @property
    def settings(self) -> SchedulerSettings:
        return self.config.prefill.scheduler

    # --- whole prompts -----------------------------------------------------------------------------
    async def prefill(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        session: StreamingPrefill | None = None,
        preemptive: bool = False,
    ) -> dict[str, Any]:
        """Returns `{"kv_transfer_params", "prompt_tokens"}` or `{"error": ...}` (OpenAI error JSON).

        Bounded: a prefill that cannot get KV memory within the admission timeout is aborted and
        answered 429, and with too many requests already queued it is refused at once.
        """
        # Validate what the client sent in full before any KV exists, so that a request decode would
        # reject never strands blocks on this replica.
        if (err := validate_openai_body(endpoint, body)) is not None:
            return err
        if self._scheduler_stats.get("queue_waiting", 0) >= self.settings.max_queued_requests:
            return overloaded(self.settings.retry_after_s, "the engine's queue is full")
        request = prefill_body(body, endpoint)
        if session is not None:  # a session's hand-off ranks with its session (prefill/scheduler/policy.py)
            request["vllm_xargs"] = {**(request.get("vllm_xargs") or {}), **session.extra_args}
        if preemptive:  # a preemptive answer's hand-off: below all other work (prefill/preemptive.py)
            request["vllm_xargs"] = {**(request.get("vllm_xargs") or {}), "rtpd_preemptive": True}
        task = asyncio.ensure_future(self.engine.openai(endpoint, request))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.settings.admission_timeout_s)
        except asyncio.CancelledError:  # the caller left: so does the engine request
            task.cancel()
            raise
        if not done:  # cancelling vLLM's generator aborts the request and frees its blocks
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            why = f"the prefill did not finish within {self.settings.admission_timeout_s:g} s"
            return overloaded(self.settings.retry_after_s, why)
        result = task.result()
        if hasattr(result, "error"):
            return error_payload(result)
        params = decode_params(endpoint, body, result)
        return {"kv_transfer_params": params, "prompt_tokens": result.usage.prompt_tokens}

    async def configure_scheduler(self, **changes: Any) -> dict[str, Any]:
        """Change the streaming scheduler's settings on this replica (policy, eviction, limits)."""
        settings = SchedulerSettings.model_validate({**self.settings.model_dump(), **changes})
        applied = await self.engine.utility("rtpd_configure", settings.model_dump())
        if settings.eviction == "cost" and self.settings.eviction != "cost":
            from prefill.scheduler.profile import load_or_profile

            model = await load_or_profile(self.engine, settings)
            await self.engine.utility("rtpd_set_latency_model", model.to_json())
        self.config.prefill.scheduler = settings
        logger.info("scheduler settings now %s", applied)
        return applied

    async def _export_scheduler_stats(self) -> None:
        try:
            stats = (await self.engine.compute_stats())["scheduler"]
        except Exception:
            logger.exception("reading scheduler stats failed")
            return
        previous, self._scheduler_stats = self._scheduler_stats, stats
        metrics.export_scheduler(stats, previous, self.replica)

    def record_routing_stats(self) -> dict[str, Any]:
        """Tells the routers' admission
        control (router/admission.py) how full it is. KV figures are the engine's last step's (its stat logger)."""
        total = int(self.engine.client.vllm_config.cache_config.num_gpu_blocks or 1) - 1  # minus the null block
        return {
            "open_sessions": sum(s.state != SessionState.CLOSED for s in self.sessions.values()),
            "session_capacity": self.settings.session_capacity(self.engine.max_num_seqs),
            "kv_blocks_free": round(total * (1.0 - self.engine.totals.kv_cache_usage)),
            "kv_blocks_total": total,
            "queue_waiting": int(self._scheduler_stats.get("queue_waiting", 0)),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Open sessions hold KV between chunks: load for the autoscaler (core/autoscaling.py)."""
        return {OPEN_SESSIONS: float(sum(s.state != SessionState.CLOSED for s in self.sessions.values()))}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def stats(self, request_id_prefix: str | None = None, route_to: str | None = None) -> dict[str, Any]:
        """(`route_to`: a replica id, to ask that replica; router/placement.py)"""
        stats = await self.engine.compute_stats(request_id_prefix)
        open_sessions = [s for s in self.sessions.values() if s.state != SessionState.CLOSED]
        hold = self.rewrite_depth.hold_fraction()
        return {**stats, "sessions_open": len(open_sessions), "replica": self.replica, "rewrite_hold_fraction": hold}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def pid(self, route_to: str | None = None) -> int:
        """This replica's process (fault tests kill it)."""
        return os.getpid()

    async def __del__(self) -> None:
        # Serve awaits an async destructor during graceful shutdown (scale-down, redeploy).
        if not hasattr(self, "sessions"):  # its constructor failed before the replica held anything
            if hasattr(self, "engine"):
                self.engine.shutdown()
            return
        try:
            await self.drain()
        except Exception:
            logger.exception("handing sessions over failed")
        finally:
            self.engine.shutdown()
