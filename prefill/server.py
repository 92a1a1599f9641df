"""Prefill replica: computes prompts' KV and leaves it for a decode replica to pull over NIXL.

Two kinds of work: a whole prompt (`prefill`: the router then calls decode), and streaming-input sessions that
live here between chunks, their KV resident, and hand off to decode at end of input. This module is the
deployment: the engine, whole prompts, the scheduler's settings and figures, Serve's hooks, and every method
Serve callers use. The sessions' work is done by its parts, each given what it uses (`_wire`):
- `SessionTable` (prefill/session_table.py): the sessions held here, looked up, streamed to the engine, closed;
- `SessionCalls` (prefill/session_api.py): the session calls, from `create_session` to `session_info`;
- `HandOffs` (prefill/handoff.py): an answer's hand-off to decode, its claim by a router, its outcome;
- `Preemptive` (prefill/preemptive.py): answers started while the user may still be talking;
- `Failover` (prefill/failover.py): sessions changing owner (a dead replica's, or a draining one's);
- `Sweeper` (prefill/sweep.py): what outlived its limits, closed or given up, every half second.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from typing import Any, Literal

from ray import serve

from core import logs, metrics
from core.autoscaling import OPEN_SESSIONS
from core.config import AppConfig
from core.protocol import Endpoint, error_payload, validate_openai_body
from core.scheduler_config import SchedulerSettings
from decode.client import DecodeClient
from engine.llm import Activity, Engine
from prefill.errors import overloaded, serialized, session_api
from prefill.failover import Failover
from prefill.handoff import HandOffs
from prefill.preemptive import Preemptive
from prefill.scheduler.profile import start_scheduler
from prefill.session import Session
from prefill.session_api import SessionCalls
from prefill.session_table import SessionTable
from prefill.store import make_store
from prefill.streaming import StreamingPrefill
from prefill.sweep import Sweeper

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
class PrefillServer:
    """The prefill deployment: owns the engine, the config, the clients and the parts below, and keeps every
    method Serve callers use; each session call is its part's, entered through `session_api` (errors as OpenAI
    error JSON, the session located first) and, for calls that change a session, `serialized` (its lock)."""

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
        self.store = make_store(self.config.prefill.session_store)  # sessions outlive this replica there
        self._scheduler_stats: dict[str, Any] = {}  # the engine scheduler's last figures (the sweeper reads them)
        self._stats_read_at: Activity | None = None  # the engine's activity when they were read
        self._wire()
        self._sweeper = asyncio.create_task(self.sweeper.run())

    def _wire(self) -> None:
        """The parts, each given what it uses (from the fields the constructor set)."""
        self.sessions: dict[str, Session] = {}
        self.preemptive = Preemptive(
            self.sessions, self.engine, self.config, lambda: self._scheduler_stats, self.prefill, self.decode
        )
        self.table = SessionTable(self.sessions, self.engine, self.config, self.preemptive)
        self.handoffs = HandOffs(self.table, self.preemptive, self.prefill, self.config)
        self.session_calls = SessionCalls(
            self.table, self.handoffs, self.preemptive, self.engine, self.config, self.replica, self.store
        )
        self.failover = Failover(
            self.table,
            self.handoffs,
            self.preemptive,
            self.store,
            self.replica,
            self.app_name,
            self.deployment,
            self.config,
        )
        self.sweeper = Sweeper(self.table, self.handoffs, self._export_scheduler_stats)

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
        """Read the engine scheduler's figures and export them, unless the engine did nothing since the last read:
        an idle replica then does not wake its engine core every second (`Engine.activity`)."""
        try:
            read = await self.engine.stats_since(self._stats_read_at)
        except Exception:
            logger.exception("reading scheduler stats failed")
            return  # (read again next time: stale figures would hold admission, `prefill`'s queue check, as they are)
        if read is None:
            return
        self._stats_read_at, stats = read[0], read[1]["scheduler"]
        previous, self._scheduler_stats = self._scheduler_stats, stats
        metrics.export_scheduler(stats, previous, self.replica)

    def record_routing_stats(self) -> dict[str, Any]:
        """Tells the routers' admission control (router/admission/gate.py) how full it is. KV figures are the
        engine's last step's (its stat logger)."""
        total = int(self.engine.client.vllm_config.cache_config.num_gpu_blocks or 1) - 1  # minus the null block
        return {
            "open_sessions": self.table.open_count(),
            "session_capacity": self.settings.session_capacity(self.engine.max_num_seqs),
            "kv_blocks_free": round(total * (1.0 - self.engine.totals.kv_cache_usage)),
            "kv_blocks_total": total,
            "queue_waiting": int(self._scheduler_stats.get("queue_waiting", 0)),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Open sessions hold KV between chunks: load for the autoscaler (core/autoscaling.py)."""
        return {OPEN_SESSIONS: float(self.table.open_count())}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def stats(self, request_id_prefix: str | None = None, route_to: str | None = None) -> dict[str, Any]:
        """(`route_to`: a replica id, to ask that replica; router/placement.py)"""
        stats = await self.engine.compute_stats(request_id_prefix)
        hold = self.table.rewrite_depth.hold_fraction()
        return {
            **stats,
            "sessions_open": self.table.open_count(),
            "replica": self.replica,
            "rewrite_hold_fraction": hold,
        }

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def pid(self, route_to: str | None = None) -> int:
        """This replica's process (fault tests kill it)."""
        return os.getpid()

    # --- sessions (prefill/session_api.py), their answers (prefill/handoff.py), failover (prefill/failover.py) ----
    async def _locate(self, session_id: str) -> None:
        await self.failover.locate(session_id)

    async def _close(self, session: Session, reason: str) -> None:
        await self.table.close(session, reason)

    @session_api
    async def create_session(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await self.session_calls.create(spec)

    @session_api
    @serialized
    async def session_chunk(
        self,
        *,
        session_id: str,
        sequence_id: int,
        payload: str,
        end_of_input: bool = False,
        mode: str = "append",
        offset: int | None = None,
        role: str = "user",
        tool_call_id: str | None = None,
        audio_start: bool = False,
    ) -> dict[str, Any]:
        return await self.session_calls.chunk(
            session_id=session_id,
            sequence_id=sequence_id,
            payload=payload,
            end_of_input=end_of_input,
            mode=mode,
            offset=offset,
            role=role,
            tool_call_id=tool_call_id,
            audio_start=audio_start,
        )

    @session_api
    @serialized
    async def session_message(
        self,
        *,
        session_id: str,
        role: str,
        content: str,
        tool_call_id: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return await self.session_calls.message(
            session_id=session_id, role=role, content=content, tool_call_id=tool_call_id, tool_calls=tool_calls
        )

    @session_api
    @serialized
    async def session_truncate(self, *, session_id: str, chars: int) -> dict[str, Any]:
        return await self.session_calls.truncate(session_id=session_id, chars=chars)

    @session_api
    @serialized
    async def session_buffer(self, *, session_id: str, op: str, text: str = "", offset: int = 0) -> dict[str, Any]:
        return await self.session_calls.buffer(session_id=session_id, op=op, text=text, offset=offset)

    @session_api
    @serialized
    async def session_preempt(self, *, session_id: str) -> dict[str, Any]:
        return await self.session_calls.preempt(session_id=session_id)

    @session_api
    @serialized
    async def session_update(
        self,
        *,
        session_id: str,
        instructions: str | None = None,
        params: dict[str, Any] | None = None,
        preemptive: dict[str, Any] | Literal[False] | None = None,
        view: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return await self.session_calls.update(
            session_id=session_id, instructions=instructions, params=params, preemptive=preemptive, view=view
        )

    @session_api
    @serialized
    async def session_finish(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.session_calls.finish(session_id=session_id, overrides=overrides)

    @session_api
    @serialized
    async def session_respond(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.session_calls.respond(session_id=session_id, overrides=overrides)

    @session_api
    @serialized
    async def session_delete(self, *, session_id: str) -> dict[str, Any]:
        return await self.session_calls.delete(session_id=session_id)

    @session_api
    async def session_attach(self, *, session_id: str, connection: str | None = None) -> dict[str, Any]:
        return await self.session_calls.attach(session_id=session_id, connection=connection)

    @session_api
    async def session_status(self, *, session_id: str) -> dict[str, Any]:
        return await self.session_calls.status(session_id=session_id)

    @session_api
    async def session_info(self, *, session_id: str) -> dict[str, Any]:
        return await self.session_calls.info(session_id=session_id)

    @session_api
    async def session_claim(
        self,
        *,
        session_id: str,
        turn: int | None = None,
        fresh: bool = False,
        adopts: bool = True,
        reclaim: bool = False,
        holding: str | None = None,
    ) -> dict[str, Any]:
        return await self.handoffs.claim(
            session_id=session_id, turn=turn, fresh=fresh, adopts=adopts, reclaim=reclaim, holding=holding
        )

    @session_api
    async def session_answer_done(self, *, session_id: str, turn: int, outcome: dict[str, Any]) -> dict[str, Any]:
        return await self.handoffs.answer_done(session_id=session_id, turn=turn, outcome=outcome)

    @session_api
    async def session_streaming(self, *, session_id: str, turn: int, decode: dict[str, Any]) -> dict[str, Any]:
        return await self.handoffs.streaming_from(session_id=session_id, turn=turn, decode=decode)

    @session_api
    async def session_alive(self, *, session_id: str, turn: int) -> dict[str, Any]:
        return await self.handoffs.reader_alive(session_id=session_id, turn=turn)

    @session_api
    async def session_cancel(self, *, session_id: str) -> dict[str, Any]:
        return await self.handoffs.cancel(session_id=session_id)

    @session_api
    async def session_result(self, *, session_id: str, turn: int | None = None, wait: bool = True) -> dict[str, Any]:
        return await self.handoffs.result(session_id=session_id, turn=turn, wait=wait)

    async def adopt_sessions(
        self, *, owner: str, journals: list[list[dict[str, Any]]], session_id: str = "", route_to: str = ""
    ) -> dict[str, Any]:
        """A draining peer's sessions (`session_id`, `route_to`: read by the request router only)."""
        return await self.failover.adopt_sessions(owner, journals)

    async def drain(self) -> None:
        await self.failover.drain()

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
