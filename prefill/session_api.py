"""A prefill replica's streaming-input sessions: the calls that create them, feed them input and end them.

Each session's input is streamed to the engine as it arrives (prefill/streaming.py), so that its KV is resident
when the input ends; its answer is handed off to decode (prefill/handoff.py). A session's methods take
`session_id` as a keyword: the session-affinity request router (router/placement.py) sends them to the replica
named in the id, whichever router replica they come through. The deployment (prefill/server.py) turns their
errors into OpenAI error JSON and holds a session's lock around each call that changes it (prefill/errors.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import ValidationError

from core import metrics
from core.config import AppConfig, PreemptiveOptions
from core.placement import new_session_id
from core.protocol import Endpoint, validate_openai_body
from core.scheduler_config import SchedulerSettings
from prefill.errors import overloaded
from prefill.handoff import HandOffs
from prefill.journal import Journal, create_record
from prefill.preempt_state import PreemptState
from prefill.session import Session, SessionError, SessionLimits, SessionState, StartPolicy
from prefill.session_table import SessionTable
from prefill.store import SessionStore

if TYPE_CHECKING:
    from engine.llm import Engine

logger = logging.getLogger(__name__)
MAX_VIEW_BYTES = 64 << 10  # a realtime connection's own settings kept for its re-attach (`update`'s `view`)


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


class SessionPreemption(Protocol):
    """What the session calls need of the preemptive answers (prefill/preemptive.py `Preemptive`)."""

    def rearm(self, session: Session) -> None: ...

    def start_now(self, session: Session) -> bool: ...

    def close(self, session: Session) -> None: ...


class SessionCalls:
    """The session calls a router makes on a session's owner replica (the deployment's `create_session` and
    `session_*` methods delegate here). Each change is journaled (prefill/journal.py) before the call returns,
    so that the session outlives this replica."""

    def __init__(
        self,
        table: SessionTable,
        handoffs: HandOffs,
        preemptive: SessionPreemption,
        engine: Engine,
        config: AppConfig,
        replica: str,
        store: SessionStore | None,
    ) -> None:
        self.table = table
        self.sessions = table.sessions
        self.handoffs = handoffs
        self.preemptive = preemptive
        self.engine = engine
        self.config = config
        self.replica = replica
        self.store = store  # where journals outlive this replica (None: not journaled, as in unit tests)

    @property
    def settings(self) -> SchedulerSettings:
        return self.config.prefill.scheduler

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        request = _text_input(dict(spec.get("request") or {}))
        endpoint: Endpoint = "chat" if "messages" in request else "completion"
        self.table.check_max_tokens(request)
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
        session = Session(session_id, endpoint, request, policy, limits, self.table.streaming(session_id))
        session.conversation.instructions = spec.get("instructions")
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
            await self.table.prefill_stable(session)
        except BaseException:  # nothing half-made stays behind
            await self.table.close(session, "its creation failed")
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

    async def chunk(
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
        session = self.table.get(session_id)
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
                await self.handoffs.start_answer(session, {})
            else:
                await self.table.prefill_stable(session)
                self.preemptive.rearm(session)
        if recorded is not None:
            await recorded
        return {**session.describe(), **result, "started": session.state != SessionState.OPEN}

    async def message(
        self,
        *,
        session_id: str,
        role: str,
        content: str,
        tool_call_id: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        session = self.table.get(session_id)
        if role not in ("user", "system", "assistant", "developer", "tool"):
            raise SessionError(400, f"role {role!r} is not a conversation role", "role")
        session.add_message(role, content, tool_call_id, tool_calls)
        extra = {k: v for k, v in {"tool_call_id": tool_call_id, "tool_calls": tool_calls}.items() if v}
        await session.record("message", role=role, content=content, **extra)
        _count_input(1, len(content.encode()))
        await self.table.prefill_stable(session)
        self.preemptive.rearm(session)
        return session.describe()

    async def truncate(self, *, session_id: str, chars: int) -> dict[str, Any]:
        """Realtime `conversation.item.truncate` with `text_end`: the last answer keeps what the user heard; the
        resident KV is cut back to the longest common prefix with the conversation as it now reads."""
        session = self.table.get(session_id)
        session.touch()
        if session.answering:
            raise SessionError(409, "the answer is still being generated: cut it once it has ended", "item_id")
        if session.conversation.truncate_answer(chars):
            await session.record("truncate", chars=chars)
            await self.table.prefill_stable(session)
            self.preemptive.rearm(session)
        return session.describe()

    async def buffer(self, *, session_id: str, op: str, text: str = "", offset: int = 0) -> dict[str, Any]:
        """Realtime `input_text_buffer.*`: append to, replace from `offset`, commit or clear the in-progress
        user text."""
        session = self.table.get(session_id)
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
        await self.table.prefill_stable(session)
        self.preemptive.rearm(session)
        return session.describe()

    async def preempt(self, *, session_id: str) -> dict[str, Any]:
        """The input may be whole now (a spoken turn paused): a session with `preemptive` options starts its
        preemptive answer at once instead of after `after_idle_ms` (prefill/preemptive.py `start_now`)."""
        session = self.table.get(session_id)
        session.touch()
        return {**session.describe(), "preempting": self.preemptive.start_now(session)}

    async def update(
        self,
        *,
        session_id: str,
        instructions: str | None = None,
        params: dict[str, Any] | None = None,
        preemptive: dict[str, Any] | Literal[False] | None = None,
        view: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Instructions, sampling parameters and `preemptive` options (None: unchanged; False: off); `view`: keys of
        the connection's own settings, merged into what is kept for a connection that re-attaches."""
        session = self.table.get(session_id)
        if view is not None and len(json.dumps(view, ensure_ascii=False).encode()) > MAX_VIEW_BYTES:
            # (not the client's fault: it never sent `view`; a re-attached connection starts from the defaults)
            logger.warning(
                "session %s: the connection's settings are over %d bytes: not kept", session_id, MAX_VIEW_BYTES
            )
            view = None
        self.table.check_max_tokens(params or {})
        _check_request(session.endpoint, {**session.full_request(), **(params or {})})
        options = (
            _validated(PreemptiveOptions, "preemptive", {"preemptive": preemptive or {}})
            if preemptive not in (None, False)
            else None
        )
        if instructions is not None:
            session.conversation.instructions = instructions or None
        session.request.update(params or {})
        if options is not None or preemptive is False:
            if session.preempt is not None:
                self.preemptive.close(session)
            session.preempt = PreemptState(options) if options is not None else None
        extra = {} if preemptive is None else {"preemptive": options.model_dump() if options else False}
        if view is not None:
            session.view, extra["view"] = {**(session.view or {}), **view}, view
        await session.record("update", instructions=instructions, params=params, **extra)
        await self.table.prefill_stable(session)
        self.preemptive.rearm(session)
        return session.describe()

    async def finish(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """End of input: hand the KV off for the answer. Idempotent."""
        session = self.table.get(session_id)
        if session.pending:
            raise SessionError(409, f"chunks {sorted(session.pending)} wait for missing sequence id {session.next_seq}")
        self.handoffs.check_overrides(overrides or {})
        last = session.answers[-1] if session.answers else None
        # Idempotent, except that an answer that failed without output (e.g. refused with 429) is tried again.
        if not (session.input_ended and last is not None and not (last.status == "failed" and not last.text)):
            session.input_ended = True
            await self.handoffs.start_answer(session, overrides or {})
        return {**session.describe(), "answer": session.answers[-1].summary()}

    async def respond(self, *, session_id: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Realtime `response.create`: answer the conversation so far (input may go on afterwards)."""
        session = self.table.get(session_id)
        if session.answering:
            raise SessionError(409, "a response is already in progress", "response")
        self.handoffs.check_overrides(overrides or {})
        changes = {k: v for k, v in (overrides or {}).items() if k != "instructions"}
        _check_request(session.endpoint, {**session.full_request(), **changes})
        session.input_ended = True
        await self.handoffs.start_answer(session, overrides or {})
        return {**session.describe(), "answer": session.answers[-1].summary()}

    async def delete(self, *, session_id: str) -> dict[str, Any]:
        session = self.table.get(session_id, allow_closed=True)
        await self.table.close(session, "deleted")
        self.sessions.pop(session_id, None)
        return {"session_id": session_id, "deleted": True}

    async def attach(self, *, session_id: str, connection: str | None = None) -> dict[str, Any]:
        """A client re-attached to the session through the router replica `connection` (its connection's holder
        now: the session no longer dies with the old one)."""
        session = self.table.get(session_id)
        session.connection, session.orphaned_at = connection, None
        if session.journal is not None:
            await session.journal.write("attach", connection=connection)
        return session.describe()

    async def status(self, *, session_id: str) -> dict[str, Any]:
        """Whether a session still holds room a router admitted it to: its state and its last answer's status
        (cheap: a router asks it of the REST sessions it admitted that went quiet there)."""
        session = self.table.get(session_id, allow_closed=True)
        last = session.answers[-1].status if session.answers else None
        return {"session_id": session_id, "state": session.state.value, "answer_status": last}

    async def info(self, *, session_id: str) -> dict[str, Any]:
        session = self.table.get(session_id, allow_closed=True)
        stats = await self.engine.compute_stats(session_id)
        return {
            **session.describe(),
            "close_reason": session.close_reason,
            # What a client re-attaching to the session needs (router/realtime/socket.py `attach`).
            "instructions": session.conversation.instructions,
            "buffer": session.buffer,
            "view": session.view,
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
