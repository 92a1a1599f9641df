"""Prefill replica: computes prompts' KV and leaves it for a decode replica to pull over NIXL.

Two kinds of work: a whole prompt (`prefill`, the router then calls decode), and streaming-input sessions
that live here between chunks (their KV stays resident) and hand off to decode at end of input. A session's
methods take `session_id` as a keyword: the session-affinity request router (router/placement.py) sends
them to the replica named in the id, whichever router replica they come through.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from prefill.scheduler.config import SchedulerSettings
from prefill.session import (
    Answer,
    Session,
    SessionError,
    SessionLimits,
    SessionState,
    StartPolicy,
    new_session_id,
    owner_of,
)
from prefill.streaming import StreamingPrefill
from serve_app import metrics
from serve_app.autoscaling import OPEN_SESSIONS
from serve_app.config import AppConfig
from serve_app.engine import Engine
from serve_app.protocol import Endpoint, error_body, error_payload, validate_openai_body

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
CLOSED_SESSION_RETENTION_S = 60.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request turned into a one-token prefill that asks for remote decode."""
    out = {k: v for k, v in copy.deepcopy(body).items() if k not in _DROP}
    if isinstance(out.get("vllm_xargs"), dict):  # the scheduler's ranking keys are the server's to set
        out["vllm_xargs"] = {k: v for k, v in out["vllm_xargs"].items() if not str(k).startswith("rtpd_")}
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if out.get("request_id"):
        out["request_id"] = f"{out['request_id']}-prefill"
    return out


def _validated(model: Any, field: str, spec: dict[str, Any]) -> Any:
    try:
        return model.model_validate(spec.get(field) or {})
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in (field, *first["loc"]))
        raise SessionError(400, f"{param}: {first['msg']}", param) from None


def _count_input(chunks: int, nbytes: int) -> None:
    metrics.inc(metrics.SESSION_CHUNKS, chunks, "session input chunks applied")
    metrics.inc(metrics.SESSION_INPUT_BYTES, nbytes, "session input bytes")


def overloaded(retry_after: int, why: str = "no KV memory could be freed in time") -> dict[str, Any]:
    """429 with `Retry-After`: the replica is at capacity (KV memory held by work that cannot be evicted,
    or every session slot taken)."""
    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="overloaded")
    body = error_body(429, f"prefill capacity exhausted: {why}; retry later")
    body["error"]["retry_after"] = retry_after
    return body


def session_api(method: Callable[..., Awaitable[dict[str, Any]]]) -> Callable[..., Awaitable[dict[str, Any]]]:
    """Session errors become OpenAI error JSON (the router turns them into HTTP or Realtime errors)."""

    @functools.wraps(method)
    async def wrapper(self: PrefillServer, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return await method(self, *args, **kwargs)
        except SessionError as e:
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"session_{e.status}")
            if (e.status == 413 or e.close) and (session := self.sessions.get(kwargs.get("session_id", ""))):
                await self._close(session, "payload cap exceeded" if e.status == 413 else e.message)
            return error_body(e.status, e.message, e.param)
        except TimeoutError:  # a bounded wait on the engine ran out: the input is kept, the client retries
            return overloaded(self.settings.retry_after_s)

    return wrapper


@serve.deployment(name="prefill", max_ongoing_requests=1024, health_check_period_s=10)
class PrefillServer:
    async def __init__(self, app_config: dict[str, Any], decode: DeploymentHandle | None = None) -> None:
        self.config = AppConfig.model_validate(app_config)
        self.engine = Engine(self.config, "prefill")
        await self.engine.start()
        self.decode = decode.options(stream=True) if decode is not None else None
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.app_name, self.deployment = context.app_name, context.deployment
        self.sessions: dict[str, Session] = {}
        self.adopted_owners: set[str] = set()  # drained replicas whose sessions this one took over
        self._scheduler_stats: dict[str, Any] = {}  # the engine scheduler's last figures (the sweeper reads them)
        self._sweeper = asyncio.create_task(self._sweep())

    @property
    def settings(self) -> SchedulerSettings:
        return self.config.prefill.scheduler

    def _streaming(self, session_id: str) -> StreamingPrefill:
        return StreamingPrefill(self.engine, session_id, self.settings.admission_timeout_s)

    # --- whole prompts -----------------------------------------------------------------------------
    async def prefill(
        self, endpoint: Endpoint, body: dict[str, Any], session: StreamingPrefill | None = None
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
        request = prefill_body(body)
        if session is not None:  # a session's hand-off ranks with its session (prefill/scheduler/policy.py)
            request["vllm_xargs"] = {**(request.get("vllm_xargs") or {}), **session.extra_args}
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
        return {"kv_transfer_params": result.kv_transfer_params, "prompt_tokens": result.usage.prompt_tokens}

    # --- sessions ----------------------------------------------------------------------------------
    @session_api
    async def create_session(self, spec: dict[str, Any]) -> dict[str, Any]:
        request = dict(spec.get("request") or {})
        endpoint: Endpoint = "chat" if "messages" in request else "completion"
        probe = {**request, "stream": False}
        if endpoint == "completion" and not probe.get("prompt"):
            probe["prompt"] = " "  # the input is still to come; validate everything else now
        if (err := validate_openai_body(endpoint, probe)) is not None:
            raise SessionError(400, err["error"]["message"], err["error"]["param"])
        if (request.get("n") or 1) != 1:
            raise SessionError(400, "streaming-input sessions produce one choice: n must be 1", "n")
        policy = _validated(StartPolicy, "start_policy", spec)
        limits = _validated(SessionLimits, "limits", spec)
        open_sessions = sum(s.state != SessionState.CLOSED for s in self.sessions.values())
        if open_sessions >= self.settings.session_capacity(self.engine.max_num_seqs):
            return overloaded(self.settings.retry_after_s, f"{open_sessions} sessions open, the replica's limit")
        session_id = new_session_id(self.replica)
        logger.info("session %s created (%s, start policy %s)", session_id, endpoint, policy.type)
        session = Session(session_id, endpoint, request, policy, limits, self._streaming(session_id))
        session.instructions = spec.get("instructions")
        self.sessions[session_id] = session
        await self._prefill_stable(session)
        return session.describe()

    @session_api
    async def session_chunk(
        self,
        *,
        session_id: str,
        sequence_id: int,
        payload: str,
        end_of_input: bool = False,
        mode: str = "append",
        offset: int | None = None,
    ) -> dict[str, Any]:
        session = self._get(session_id)
        result = session.add_chunk(sequence_id, payload, end_of_input, mode, offset)
        if result["applied"]:
            applied = session.chunk_log[-len(result["applied"]) :]
            _count_input(len(applied), sum(len(c["payload"].encode()) for c in applied))
            await self._prefill_stable(session)
        if session.input_ended and result["applied"]:
            await self._start_answer(session, {})
        return {**session.describe(), **result, "started": session.state != SessionState.OPEN}

    @session_api
    async def session_message(self, *, session_id: str, role: str, content: str) -> dict[str, Any]:
        session = self._get(session_id)
        session.add_message(role, content)
        _count_input(1, len(content.encode()))
        await self._prefill_stable(session)
        return session.describe()

    @session_api
    async def session_buffer(self, *, session_id: str, op: str, text: str = "", offset: int = 0) -> dict[str, Any]:
        """Realtime `input_text_buffer.*`: append to, replace from `offset`, commit or clear the in-progress
        user text."""
        session = self._get(session_id)
        session.touch()
        if op == "append":
            session.append_text(text)
            _count_input(1, len(text.encode()))
        elif op == "replace":
            session.replace_text(offset, text)
            _count_input(1, len(text.encode()))
        elif op == "commit":
            session.commit_buffer()
        elif op == "clear":
            session.clear_text()
        else:
            raise SessionError(400, f"unknown buffer operation {op!r}")
        await self._prefill_stable(session)
        return session.describe()

    @session_api
    async def session_update(
        self, *, session_id: str, instructions: str | None = None, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        session = self._get(session_id)
        if instructions is not None:
            session.instructions = instructions or None
        session.request.update(params or {})
        await self._prefill_stable(session)
        return session.describe()

    @session_api
    async def session_finish(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """End of input: hand the KV to decode and start the answer. Idempotent."""
        session = self._get(session_id)
        if session.pending:
            raise SessionError(409, f"chunks {sorted(session.pending)} wait for missing sequence id {session.next_seq}")
        if not (session.input_ended and session.answers):
            session.input_ended = True
            await self._start_answer(session, overrides or {})
        return {**session.describe(), "answer": session.answers[-1].summary()}

    @session_api
    async def session_respond(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Realtime `response.create`: answer the conversation so far (input may go on afterwards)."""
        session = self._get(session_id)
        if session.answering:
            raise SessionError(409, "a response is already in progress", "response")
        session.input_ended = True
        await self._start_answer(session, overrides or {})
        return {**session.describe(), "answer": session.answers[-1].summary()}

    async def session_events(self, *, session_id: str, turn: int | None = None) -> AsyncGenerator[Any, None]:
        """The answer's decode SSE text as it arrives (replayed from the start), then `{"done": summary}`."""
        try:
            session = self._get(session_id)
            answer = await self._wait_answer(session, turn)
        except SessionError as e:
            yield error_body(e.status, e.message, e.param)
            return
        yield {"turn": answer.turn, "endpoint": session.endpoint}
        sent = 0
        while True:
            async with answer.changed:
                await answer.changed.wait_for(lambda n=sent: len(answer.batches) > n or answer.done)
                new = answer.batches[sent:]
            sent += len(new)
            if new:
                yield "".join(new)
            if answer.done and sent == len(answer.batches):
                break
        yield {"done": answer.summary()}

    @session_api
    async def session_result(self, *, session_id: str, turn: int | None = None, wait: bool = True) -> dict[str, Any]:
        session = self._get(session_id)
        answer = await self._wait_answer(session, turn) if wait else (session.answers or [None])[-1]
        if answer is None:
            return {**session.describe(), "answer": None}
        if wait:
            async with answer.changed:
                await answer.changed.wait_for(lambda: answer.done)
        return {**session.describe(), "answer": answer.summary()}

    @session_api
    async def session_cancel(self, *, session_id: str) -> dict[str, Any]:
        session = self._get(session_id)
        if session.answering and (task := session.answers[-1].task) is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return {**session.describe(), "answer": session.answers[-1].summary() if session.answers else None}

    @session_api
    async def session_delete(self, *, session_id: str) -> dict[str, Any]:
        session = self._get(session_id)
        await self._close(session, "deleted")
        self.sessions.pop(session_id, None)
        return {"session_id": session_id, "deleted": True}

    @session_api
    async def session_info(self, *, session_id: str) -> dict[str, Any]:
        session = self._get(session_id, allow_closed=True)
        stats = await self.engine.compute_stats(session_id)
        return {
            **session.describe(),
            "close_reason": session.close_reason,
            "request_ids": session.streaming.request_ids,
            "prompt_tokens_computed": stats["prompt_tokens_computed"],
            "block_size": stats["block_size"],
            "answers": [a.summary() for a in session.answers],
            # This session's admissions, evictions by kind, swapped blocks and bytes, tokens recomputed after
            # eviction or given back by the prefix cache, invalidated tokens; and the replica's scheduler.
            "scheduler": {
                **stats.get("session_scheduler", {}),
                "replica": {"replica": self.replica, **stats.get("scheduler", {})},
            },
        }

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

    # --- internals ---------------------------------------------------------------------------------
    def _get(self, session_id: str, allow_closed: bool = False) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            owner = owner_of(session_id)
            if owner is not None and owner != self.replica and owner not in self.adopted_owners:
                # Its owner is draining or gone, and routers have not yet learnt who adopted it.
                raise SessionError(503, f"session {session_id} is being handed over; retry", "session_id")
            raise SessionError(404, f"session {session_id} not found", "session_id")
        if not allow_closed:
            session.check_open()
        return session

    async def _prefill_stable(self, session: Session) -> None:
        """Stream the input's stable tokens to the engine, if the start policy allows it yet."""
        if session.answering:
            return  # the conversation grows again once the answer is in
        tokens = session.stable_tokens(self.engine.tokenizer)
        if len(tokens) >= self.engine.max_model_len:
            await self._close(session, "input exceeds the model's context length")
            raise SessionError(400, f"session input exceeds the context length of {self.engine.max_model_len} tokens")
        if session.streaming.active or session.may_start(len(tokens)):
            await session.streaming.sync(tokens)
            if tokens:
                session.state = SessionState.PREFILLING

    async def _wait_answer(self, session: Session, turn: int | None) -> Answer:
        deadline = time.monotonic() + session.limits.idle_timeout_s
        while not session.answers or (turn is not None and turn >= len(session.answers)):
            if session.state == SessionState.CLOSED or time.monotonic() > deadline:
                raise SessionError(
                    409, f"session {session.id} has no answer ({session.close_reason or 'no input end'})"
                )
            await asyncio.sleep(0.05)
        return session.answers[-1 if turn is None else turn]

    async def _start_answer(self, session: Session, overrides: dict[str, Any]) -> None:
        if (overrides.get("n") or 1) != 1:
            raise SessionError(400, "n must be 1", "n")
        session.commit_buffer()
        answer = Answer(turn=len(session.answers))
        session.answers.append(answer)
        answer.task = asyncio.create_task(self._answer(session, answer, overrides))

    async def _answer(self, session: Session, answer: Answer, overrides: dict[str, Any]) -> None:
        stream = None
        try:
            if session.streaming.active:
                await session.streaming.wait_computed()  # so the hand-off finds every block cached
            overrides = dict(overrides)
            request = {**session.full_request(overrides.pop("instructions", None)), **overrides, "stream": True}
            request["stream_options"] = {"include_usage": True}
            request["request_id"] = f"{session.id}-t{answer.turn}"
            handoff = await self.prefill(session.endpoint, request, session.streaming)
            if "error" in handoff:
                answer.error, answer.status = handoff["error"], "failed"
                return
            session.state = SessionState.ANSWERING
            assert self.decode is not None, "sessions need a decode deployment"
            request["kv_transfer_params"] = handoff["kv_transfer_params"]
            stream = self.decode.generate.remote(session.endpoint, request)
            async for item in stream:
                async with answer.changed:
                    if isinstance(item, dict):  # an error before any output
                        answer.error = item.get("error", item)
                    else:
                        first = answer.first_token_at is None
                        answer.absorb(item)
                        answer.batches.append(item)
                        if first and answer.first_token_at is not None and session.last_chunk_at is not None:
                            waited = answer.first_token_at - session.last_chunk_at
                            metrics.observe(
                                metrics.LAST_CHUNK_TO_FIRST_TOKEN, waited, "last input chunk to first token"
                            )
                    answer.changed.notify_all()
            answer.status = "failed" if answer.error else "completed"
            if answer.error:
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="session_answer")
        except asyncio.CancelledError:
            answer.status = "cancelled"
            if stream is not None:
                stream.cancel()
        except TimeoutError:  # the session's input could not be prefilled in time
            answer.error, answer.status = overloaded(self.settings.retry_after_s)["error"], "failed"
        except Exception as e:
            logger.exception("session %s answer failed", session.id)
            answer.error, answer.status = {"message": str(e), "type": "InternalServerError", "code": 500}, "failed"
        finally:
            session.add_answer(answer.text)
            async with answer.changed:
                answer.changed.notify_all()
            if session.state != SessionState.CLOSED:
                session.state = SessionState.OPEN
                session.touch()
                # Keep the conversation resident: the next turn prefills only what is new.
                try:
                    await self._prefill_stable(session)
                except Exception:
                    logger.exception("session %s: re-prefill after answer failed", session.id)

    async def _close(self, session: Session, reason: str) -> None:
        if session.state == SessionState.CLOSED:
            return
        session.state = SessionState.CLOSED
        session.close_reason = reason
        logger.info("session %s closed: %s", session.id, reason)
        session.closed_at = time.monotonic()
        if session.answering and (task := session.answers[-1].task) is not None:
            task.cancel()
        await session.streaming.close()

    async def _sweep(self) -> None:
        """Expire idle sessions and sessions whose chunk gap never filled; forget closed ones; export the
        scheduler's figures."""
        ticks = 0
        while True:
            await asyncio.sleep(0.5)
            ticks += 1
            if ticks % 2 == 0:
                await self._export_scheduler_stats()
            now = time.monotonic()
            for state in SessionState:
                count = sum(s.state == state for s in self.sessions.values())
                metrics.set_gauge(metrics.SESSIONS_OPEN, count, "sessions by state", state=state.value)
            for session in list(self.sessions.values()):
                try:
                    if session.state == SessionState.CLOSED:
                        if now - (session.closed_at or now) > CLOSED_SESSION_RETENTION_S:
                            self.sessions.pop(session.id, None)
                    elif (gap := session.expired_gap(now)) is not None:
                        await self._close(session, f"chunk {gap} never arrived")
                    elif not session.answering and now - session.last_active > session.limits.idle_timeout_s:
                        await self._close(session, "expired")
                except Exception:
                    logger.exception("sweeping session %s failed", session.id)

    async def _export_scheduler_stats(self) -> None:
        try:
            stats = (await self.engine.compute_stats())["scheduler"]
        except Exception:
            logger.exception("reading scheduler stats failed")
            return
        previous, self._scheduler_stats = self._scheduler_stats, stats
        metrics.export_scheduler(stats, previous, self.replica)

    # --- draining: finish answers, hand open sessions over -----------------------------------------
    async def adopt_sessions(self, owner: str, states: list[dict[str, Any]]) -> dict[str, Any]:
        """Take over a draining replica's sessions: re-prefill each one's kept input here."""
        for state in states:
            session = Session.adopt(state, self._streaming(state["id"]))
            self.sessions[session.id] = session
            try:
                await self._prefill_stable(session)
            except SessionError:
                logger.exception("adopting session %s", session.id)
        self.adopted_owners.add(owner)
        logger.info("adopted %d sessions from drained replica %s", len(states), owner)
        return {"adopted": [s["id"] for s in states], "by": self.replica}

    def record_routing_stats(self) -> dict[str, Any]:
        """Tells the session-affinity router whose sessions this replica adopted."""
        return {"adopted_owners": sorted(self.adopted_owners)}

    async def drain(self) -> None:
        """Before this replica stops: let running answers finish, then hand every open session to another
        replica of the deployment (Serve no longer routes to a stopping replica)."""
        answers = [s.answers[-1].task for s in self.sessions.values() if s.answering and s.answers[-1].task]
        await asyncio.gather(*answers, return_exceptions=True)
        states = [s.export() for s in self.sessions.values() if s.state != SessionState.CLOSED]
        if not states:
            return
        handle = serve.get_deployment_handle(self.deployment, self.app_name)
        result = await handle.adopt_sessions.remote(self.replica, states)
        logger.info("handed %d sessions to replica %s", len(result["adopted"]), result["by"])

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Open sessions hold KV between chunks: load for the autoscaler (serve_app/autoscaling.py)."""
        return {OPEN_SESSIONS: float(sum(s.state != SessionState.CLOSED for s in self.sessions.values()))}

    async def stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        stats = await self.engine.compute_stats(request_id_prefix)
        open_sessions = [s for s in self.sessions.values() if s.state != SessionState.CLOSED]
        return {**stats, "sessions_open": len(open_sessions), "replica": self.replica}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def __del__(self) -> None:
        # Serve awaits an async destructor during graceful shutdown (scale-down, redeploy).
        try:
            await self.drain()
        except Exception:
            logger.exception("handing sessions over failed")
        finally:
            self.engine.shutdown()
