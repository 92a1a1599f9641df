"""A prefill replica's streaming-input sessions: the calls that create them, feed them input and end them.

Each session's input is streamed to the engine as it arrives (prefill/streaming.py), so that its KV is resident
when the input ends; its answer is handed off to decode (prefill/handoff.py). A session's methods take
`session_id` as a keyword: the session-affinity request router (router/placement.py) sends them to the replica
named in the id, whichever router replica they come through.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Literal

from pydantic import ValidationError

from core import metrics
from core.config import PreemptiveOptions
from core.placement import new_session_id
from core.protocol import Endpoint, over_max_tokens, validate_openai_body
from prefill.errors import caller, overloaded, serialized, session_api
from prefill.failover import Failover
from prefill.handoff import HandOff
from prefill.journal import Journal, create_record
from prefill.preemptive import Preemptive, PreemptState
from prefill.rewrite_depth import RewriteDepth
from prefill.session import (
    Session,
    SessionError,
    SessionLimits,
    SessionState,
    StartPolicy,
)
from prefill.streaming import StreamingPrefill

logger = logging.getLogger(__name__)
CLOSED_SESSION_RETENTION_S = 60.0
RESIDENCY_WINDOW_S = 30.0  # a session with input this recent counts as streaming (residency control)


def _validated(model: Any, field: str, spec: dict[str, Any]) -> Any:
    try:
        return model.model_validate(spec.get(field) or {})
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in (field, *first["loc"]))
        raise SessionError(400, f"{param}: {first['msg']}", param) from None


def _text_input(request: dict[str, Any]) -> dict[str, Any]:
    """A session's input is text (it grows by text chunks): message content given as text parts becomes the
    text; anything else (images, token ids, a list of prompts) is refused before anything is made."""
    if "messages" in request:
        messages = request["messages"]
        if not isinstance(messages, list):
            raise SessionError(400, "messages: must be a list", "messages")
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise SessionError(400, f"messages.{i}: must be an object", f"messages.{i}")
            content = message.get("content")
            if isinstance(content, list):
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise SessionError(
                        400, f"messages.{i}.content: a session takes text parts only", f"messages.{i}.content"
                    )
                message = {**message, "content": "".join(p["text"] for p in content)}
            elif content is not None and not isinstance(content, str):
                raise SessionError(400, f"messages.{i}.content: must be text", f"messages.{i}.content")
            out.append(message)
        request["messages"] = out
    elif not isinstance(request.get("prompt", ""), str):
        raise SessionError(400, "prompt: a session's prompt is one string (its input grows as text)", "prompt")
    return request


def _check_request(endpoint: Endpoint, request: dict[str, Any]) -> None:
    """`request` is one vLLM takes, its input still to come (400 naming the field; nothing is applied)."""
    probe = {**request, "stream": False}
    probe.pop("stream_options", None)
    if endpoint == "completion" and not probe.get("prompt"):
        probe["prompt"] = " "  # the input is still to come; validate everything else now
    if (err := validate_openai_body(endpoint, probe)) is not None:
        raise SessionError(400, err["error"]["message"], err["error"]["param"])


def _work(session: Session, stats: dict[str, Any]) -> dict[str, Any]:
    """What the session cost the prefill engine: tokens computed by kind, against its prompt (1.0: each prompt
    token computed once, as a request sent whole costs)."""
    scheduler = stats.get("session_scheduler", {})
    prompt = next((a.usage.get("prompt_tokens") for a in reversed(session.answers) if a.usage), None)
    computed = stats.get("prompt_tokens_computed", 0)
    return {
        "computed_tokens": computed,
        **{f"{kind}_tokens": n for kind, n in (stats.get("prompt_tokens_computed_by_kind") or {}).items()},
        "recomputed_tokens": scheduler.get("recomputed_tokens", 0),
        "invalidated_tokens": session.streaming.invalidated_tokens,
        "superseded_chunks": session.streaming.superseded_chunks,
        "coalesced_versions": session.streaming.coalesced,
        "prompt_tokens": prompt,
        "work_ratio": computed / prompt if prompt else None,
    }


def _count_input(chunks: int, nbytes: int) -> None:
    metrics.inc(metrics.SESSION_CHUNKS, chunks, "session input chunks applied")
    metrics.inc(metrics.SESSION_INPUT_BYTES, nbytes, "session input bytes")


class SessionAPI(HandOff, Failover, Preemptive):
    """Mixin of `PrefillServer`: the session calls a router makes on a session's owner replica. Each change is
    journaled (prefill/journal.py) before the call returns, so that the session outlives this replica."""

    engine: Any
    replica: str
    _export_scheduler_stats: Any

    @functools.cached_property
    def rewrite_depth(self) -> RewriteDepth:
        """How deep this replica's sessions rewrite (prefill/rewrite_depth.py): their senders hold the rest."""
        return RewriteDepth()

    def _streaming(self, session_id: str) -> StreamingPrefill:
        settings = self.settings
        return StreamingPrefill(
            self.engine,
            session_id,
            settings.admission_timeout_s,
            max_chunk_tokens=settings.partial_chunk_tokens,
            depth=self.rewrite_depth,
        )

    @session_api
    async def create_session(self, spec: dict[str, Any]) -> dict[str, Any]:
        request = _text_input(dict(spec.get("request") or {}))
        endpoint: Endpoint = "chat" if "messages" in request else "completion"
        self._check_max_tokens(request)
        _check_request(endpoint, request)
        if (request.get("n") or 1) != 1:
            raise SessionError(400, "streaming-input sessions produce one choice: n must be 1", "n")
        policy = _validated(StartPolicy, "start_policy", spec)
        preemptive = _validated(PreemptiveOptions, "preemptive", spec)
        limits = self._session_limits(spec.get("limits"))
        open_sessions = sum(s.state != SessionState.CLOSED for s in self.sessions.values())
        if open_sessions >= self.settings.session_capacity(self.engine.max_num_seqs):
            return overloaded(self.settings.retry_after_s, f"{open_sessions} sessions open, the replica's limit")
        tenant = str(spec.get("tenant") or "")
        per_key = self.config.limits.max_sessions_per_key
        mine = sum(s.state != SessionState.CLOSED and s.tenant == tenant for s in self.sessions.values())
        if tenant and per_key is not None and mine >= per_key:
            return overloaded(self.settings.retry_after_s, f"this API key has {mine} sessions open, its limit")
        session_id = new_session_id(self.replica)
        logger.info("session %s created (%s, start policy %s)", session_id, endpoint, policy.type)
        session = Session(session_id, endpoint, request, policy, limits, self._streaming(session_id))
        session.instructions = spec.get("instructions")
        session.ephemeral = bool(spec.get("ephemeral"))
        session.close_after_answer = bool(spec.get("close_after_answer"))
        if spec.get("preemptive") is not None:
            session.preempt = PreemptState(preemptive)
        session.audio = spec.get("audio")  # (checked by the router, which alone reads it)
        session.connection = spec.get("connection")
        session.tenant = tenant
        self.sessions[session_id] = session
        try:
            if self.store is not None:
                session.journal = Journal(self.store, session_id)
                await asyncio.gather(
                    self.store.set_owner(session_id, self.replica), session.record("create", **create_record(session))
                )
            await self._prefill_stable(session)
        except BaseException:  # nothing half-made stays behind
            await self._close(session, "its creation failed")
            self.sessions.pop(session_id, None)
            raise
        return session.describe()

    def _session_limits(self, asked: Any) -> SessionLimits:
        """The server's limits (the app config's `limits`), lowered where the client asked."""
        if asked is not None and not isinstance(asked, dict):
            raise SessionError(400, "limits: must be an object", "limits")
        try:
            return SessionLimits.of_server(self.config.limits).within(asked or {})
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in ("limits", *first["loc"]))
            raise SessionError(400, f"{param}: {first['msg']}", param) from None
        except ValueError as e:
            raise SessionError(400, f"limits.{e.args[0]}", f"limits.{e.args[1]}") from None

    def _check_max_tokens(self, request: dict[str, Any]) -> None:
        """`max_tokens` within the server's limit (the model's context length unless set lower)."""
        if (over := over_max_tokens(request, self.config.limits.max_tokens or self.engine.max_model_len)) is not None:
            raise SessionError(400, over[1], over[0])

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
        session = self._get(session_id)
        result = session.add_chunk(sequence_id, payload, end_of_input, mode, offset, role, tool_call_id, audio_start)
        recorded = None
        if not result["duplicate"]:
            chunk = {"seq": sequence_id, "payload": payload, "eoi": end_of_input, "mode": mode, "offset": offset}
            if role == "tool":
                chunk.update(role=role, tool_call_id=tool_call_id)
            recorded = session.record("chunk", **chunk)
        if result["applied"]:
            applied = session.chunk_log[-len(result["applied"]) :]
            _count_input(len(applied), sum(len(c["payload"].encode()) for c in applied))
            # At end of input the hand-off prefills whatever was not streamed yet; starting the answer with no
            # await after the input ended means a reader never sees the input ended and no answer for it.
            if session.input_ended:
                await self._start_answer(session, {})
            else:
                await self._prefill_stable(session)
                self._preempt_rearm(session)
        if recorded is not None:
            await recorded
        return {**session.describe(), **result, "started": session.state != SessionState.OPEN}

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
        session = self._get(session_id)
        if role not in ("user", "system", "assistant", "developer", "tool"):
            raise SessionError(400, f"role {role!r} is not a conversation role", "role")
        session.add_message(role, content, tool_call_id, tool_calls)
        extra = {k: v for k, v in {"tool_call_id": tool_call_id, "tool_calls": tool_calls}.items() if v}
        await session.record("message", role=role, content=content, **extra)
        _count_input(1, len(content.encode()))
        await self._prefill_stable(session)
        self._preempt_rearm(session)
        return session.describe()

    @session_api
    @serialized
    async def session_truncate(self, *, session_id: str, chars: int) -> dict[str, Any]:
        """Realtime `conversation.item.truncate` with `text_end`: the last answer keeps what the user heard; the
        resident KV is cut back to the longest common prefix with the conversation as it now reads."""
        session = self._get(session_id)
        session.touch()
        if session.answering:
            raise SessionError(409, "the answer is still being generated: cut it once it has ended", "item_id")
        if session.truncate_answer(chars):
            await session.record("truncate", chars=chars)
            await self._prefill_stable(session)
            self._preempt_rearm(session)
        return session.describe()

    @session_api
    @serialized
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
        await session.record("buffer", kind=op, text=text, offset=offset)
        await self._prefill_stable(session)
        self._preempt_rearm(session)
        return session.describe()

    @session_api
    @serialized
    async def session_preempt(self, *, session_id: str) -> dict[str, Any]:
        """The input may be whole now (a spoken turn paused): a session with `preemptive` options starts its
        preemptive answer at once instead of after `after_idle_ms` (prefill/preemptive.py `_preempt_now`)."""
        session = self._get(session_id)
        session.touch()
        return {**session.describe(), "preempting": self._preempt_now(session)}

    @session_api
    @serialized
    async def session_update(
        self,
        *,
        session_id: str,
        instructions: str | None = None,
        params: dict[str, Any] | None = None,
        preemptive: dict[str, Any] | Literal[False] | None = None,
    ) -> dict[str, Any]:
        """Instructions, sampling parameters and `preemptive` options (None: unchanged; False: off)."""
        session = self._get(session_id)
        self._check_max_tokens(params or {})
        _check_request(session.endpoint, {**session.full_request(), **(params or {})})
        options = (
            _validated(PreemptiveOptions, "preemptive", {"preemptive": preemptive or {}})
            if preemptive not in (None, False)
            else None
        )
        if instructions is not None:
            session.instructions = instructions or None
        session.request.update(params or {})
        if options is not None or preemptive is False:
            if session.preempt is not None:
                self._preempt_close(session)
            session.preempt = PreemptState(options) if options is not None else None
        extra = {} if preemptive is None else {"preemptive": options.model_dump() if options else False}
        await session.record("update", instructions=instructions, params=params, **extra)
        await self._prefill_stable(session)
        self._preempt_rearm(session)
        return session.describe()

    @session_api
    @serialized
    async def session_finish(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """End of input: hand the KV off for the answer. Idempotent."""
        session = self._get(session_id)
        if session.pending:
            raise SessionError(409, f"chunks {sorted(session.pending)} wait for missing sequence id {session.next_seq}")
        self._check_overrides(overrides or {})
        last = session.answers[-1] if session.answers else None
        # Idempotent, except that an answer that failed without output (e.g. refused with 429) is tried again.
        if not (session.input_ended and last is not None and not (last.status == "failed" and not last.text)):
            session.input_ended = True
            await self._start_answer(session, overrides or {})
        return {**session.describe(), "answer": session.answers[-1].summary()}

    @session_api
    @serialized
    async def session_respond(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Realtime `response.create`: answer the conversation so far (input may go on afterwards)."""
        session = self._get(session_id)
        if session.answering:
            raise SessionError(409, "a response is already in progress", "response")
        self._check_overrides(overrides or {})
        changes = {k: v for k, v in (overrides or {}).items() if k != "instructions"}
        _check_request(session.endpoint, {**session.full_request(), **changes})
        session.input_ended = True
        await self._start_answer(session, overrides or {})
        return {**session.describe(), "answer": session.answers[-1].summary()}

    @session_api
    @serialized
    async def session_delete(self, *, session_id: str) -> dict[str, Any]:
        session = self._get(session_id, allow_closed=True)
        await self._close(session, "deleted")
        self.sessions.pop(session_id, None)
        return {"session_id": session_id, "deleted": True}

    @session_api
    async def session_attach(self, *, session_id: str, connection: str | None = None) -> dict[str, Any]:
        """A client re-attached to the session through the router replica `connection` (its connection's holder
        now: the session no longer dies with the old one)."""
        session = self._get(session_id)
        session.connection, session.orphaned_at = connection, None
        if session.journal is not None:
            await session.journal.write("attach", connection=connection)
        return session.describe()

    @session_api
    async def session_status(self, *, session_id: str) -> dict[str, Any]:
        """Whether a session still holds room a router admitted it to: its state and its last answer's status
        (cheap: a router asks it of the REST sessions it admitted that went quiet there)."""
        session = self._get(session_id, allow_closed=True)
        last = session.answers[-1].status if session.answers else None
        return {"session_id": session_id, "state": session.state.value, "answer_status": last}

    @session_api
    async def session_info(self, *, session_id: str) -> dict[str, Any]:
        session = self._get(session_id, allow_closed=True)
        stats = await self.engine.compute_stats(session_id)
        return {
            **session.describe(),
            "close_reason": session.close_reason,
            # What a client re-attaching to the session needs (router/realtime.py `attach`).
            "instructions": session.instructions,
            "buffer": session.buffer,
            "sampling": {k: session.request.get(k) for k in ("temperature", "max_tokens", "tools", "tool_choice")},
            "request_ids": session.streaming.request_ids,
            "prompt_tokens_computed": stats["prompt_tokens_computed"],
            "block_size": stats["block_size"],
            "work": _work(session, stats),
            "answers": [a.summary() for a in session.answers],
            # This session's admissions, evictions by kind, swapped blocks and bytes, tokens recomputed after
            # eviction or given back by the prefix cache, invalidated tokens; and the replica's scheduler.
            "scheduler": {
                **stats.get("session_scheduler", {}),
                "replica": {"replica": self.replica, **stats.get("scheduler", {})},
            },
        }

    # --- internals ---------------------------------------------------------------------------------
    def _get(self, session_id: str, allow_closed: bool = False) -> Session:
        session = self.sessions.get(session_id)
        if session is not None and session.tenant != caller.get():
            session = None  # another key's session does not exist for this caller
        if session is None:
            raise SessionError(404, f"session {session_id} not found", "session_id")
        if not allow_closed:
            session.check_open()
        return session

    async def _prefill_stable(self, session: Session) -> None:
        """Stream the input's stable tokens to the engine, if the start policy allows it yet."""
        if session.answering or session.state == SessionState.CLOSED:
            return  # the conversation grows again once the answer is in; a closed session never again
        tokens = session.stable_tokens(self.engine.tokenizer)
        if len(tokens) >= self.engine.max_model_len:
            await self._close(session, "input exceeds the model's context length")
            raise SessionError(400, f"session input exceeds the context length of {self.engine.max_model_len} tokens")
        if session.streaming.active or (session.may_start(len(tokens)) and self._room_to_stream(session, tokens)):
            await session.streaming.sync(tokens)
            if tokens:
                session.state = SessionState.PREFILLING

    def _room_to_stream(self, session: Session, tokens: list[int]) -> bool:
        """Residency control: whether a session not streaming yet may start, its KV and that of every session
        streaming now within `streaming_kv_fraction` of the KV cache (one session alone always may). Otherwise
        its input waits, as `on_end_only`'s does; a later chunk asks again."""
        cache = getattr(getattr(getattr(self.engine, "client", None), "vllm_config", None), "cache_config", None)
        if cache is None or not cache.num_gpu_blocks or not tokens or self.settings.policy == "vllm":
            return True  # (the `vllm` policy is the paper's streaming baseline: every session streams)
        block = cache.block_size
        # Sessions streaming now: input within the last RESIDENCY_WINDOW_S. One idle for longer is the
        # scheduler's to evict, not a reason to keep others from streaming (clients that left, say).
        now = time.monotonic()
        streaming = [
            s
            for s in self.sessions.values()
            if s is not session and s.streaming.active and now - s.last_active < RESIDENCY_WINDOW_S
        ]
        held = sum(-(-len(s.streaming.target) // block) for s in streaming)
        if (
            not streaming
            or held + -(-len(tokens) // block) <= self.settings.streaming_kv_fraction * cache.num_gpu_blocks
        ):
            return True
        if not session.buffered:
            session.buffered = True
            metrics.inc(metrics.SESSIONS_BUFFERED, 1, "sessions whose input waited for KV room to stream")
        return False

    async def _promote_buffered(self) -> None:
        """Residency control's other half: a session whose input waited for room starts streaming once room frees
        (another session ended or went quiet), without waiting for its next chunk, which may be its last. Oldest
        first; the first that still does not fit waits for the next tick, and so do those behind it."""
        waiting = sorted(
            (
                s
                for s in self.sessions.values()
                if s.buffered and s.state == SessionState.OPEN and not s.streaming.active and not s.lock.locked()
            ),
            key=lambda s: s.created_at,
        )
        for session in waiting:
            try:
                async with session.lock:
                    if session.state != SessionState.OPEN or session.streaming.active:
                        continue
                    await self._prefill_stable(session)
                    if not session.streaming.active:
                        return  # no room yet (or nothing to stream): it keeps its place
                metrics.inc(metrics.SESSIONS_PROMOTED, 1, "buffered sessions that streamed once room freed")
            except Exception:
                logger.exception("promoting session %s failed", session.id)

    async def _close(self, session: Session, reason: str) -> None:
        if session.state == SessionState.CLOSED:
            return
        session.state = SessionState.CLOSED
        session.close_reason = reason
        logger.info("session %s closed: %s", session.id, reason)
        session.closed_at = time.monotonic()
        if session.answering and (task := session.answers[-1].task) is not None and not task.done():
            task.cancel()  # a hand-off in progress; an answer a router streams ends on its own
        if session.preempt is not None:
            self._preempt_close(session)
            if session.answers and (last := session.answers[-1]).adopt is not None and last.status == "ready":
                self._preempt_release(last.adopt)  # adopted by its answer, never claimed: its decode stream goes
        await session.streaming.close()
        if session.journal is not None:  # nothing left to take over
            await session.journal.forget()
        async with session.changed:
            session.changed.notify_all()

    def _connections_alive(self) -> dict[str, bool]:
        """Whether each router replica holding an open session's connection is alive (a Ray actor lookup)."""
        names = {s.connection for s in self.sessions.values() if s.connection and s.state != SessionState.CLOSED}
        return {name: _actor_alive(name) for name in names}

    async def _sweep(self) -> None:
        """Expire idle sessions, sessions whose chunk gap never filled and answers whose reader vanished;
        forget closed sessions; export the scheduler's figures."""
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
            await self._promote_buffered()
            alive = self._connections_alive() if ticks % 10 == 0 else None  # (every 5 s: a GCS lookup each)
            for session in list(self.sessions.values()):
                if session.lock.locked():
                    continue  # a call is applying input to it: next tick
                try:
                    if session.state == SessionState.CLOSED:
                        if now - (session.closed_at or now) > CLOSED_SESSION_RETENTION_S:
                            self.sessions.pop(session.id, None)
                    elif (gap := session.expired_gap(now)) is not None:
                        await self._close(session, f"chunk {gap} never arrived")
                    elif (why := self._expire_answer(session, now)) is not None:
                        await self._give_up_answer(session, why)
                    elif not session.answering and now - session.last_active > session.limits.idle_timeout_s:
                        await self._close(session, "expired")
                    elif alive is not None and session.orphaned(now, alive.get(session.connection or "", True)):
                        await self._close(session, "its client's connection ended with its router replica")
                    elif not session.answering and now - session.created_at > session.limits.max_session_s:
                        await self._close(session, "expired: the session's time limit passed")
                except asyncio.CancelledError:
                    # Only the sweeper's own cancellation (shutdown) ends it: one session's close cancelled from
                    # inside must not stop every later expiry on this replica.
                    if (task := asyncio.current_task()) is not None and task.cancelling():
                        raise
                    logger.exception("sweeping session %s was cancelled", session.id)
                except Exception:
                    logger.exception("sweeping session %s failed", session.id)


def _actor_alive(name: str) -> bool:
    """Whether the named Ray actor (a Serve replica: its full id is its actor's name) is alive."""
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:  # (no such live actor)
        return False
    except Exception:  # the GCS unreachable a moment: assume alive, ask again next time
        return True
    return True
