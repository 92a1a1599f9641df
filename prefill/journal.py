"""A session's journal: every change to it, in order, kept in the session store (prefill/store.py).

The owner appends a record for each change before it acknowledges the call that made it, so whatever a client
was told has been applied is in the journal. `replay` rebuilds the session from it on another replica, with the
same methods the calls used (no engine involved: the new owner prefills the rebuilt input afterwards).

    create   the session's spec               chunk    a chunk as sent (applied or held out of order)
    message  a conversation item              buffer   an in-progress text edit (append, replace, commit, clear)
    update   instructions, parameters,        answer   an answer started (end of input, finish, respond)
             preemptive options, the view
    attach   a client re-attached through another router replica (the one holding its connection now)
    claimed  a router streams answer `turn`   released its reader left before any text
    ended    answer `turn` is over (its summary: text, usage, status)

Records carry the id of the client call that made them (`call`, router/sessions/owner.py), so that a call retried
after its owner died is recognised as already applied rather than applied twice.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

from core import metrics
from core.config import PreemptiveOptions
from prefill.answer import Answer
from prefill.preempt_state import PreemptState
from prefill.session import Session, SessionLimits, SessionState, StartPolicy
from prefill.store import SessionStore
from prefill.streaming import StreamingPrefill

logger = logging.getLogger(__name__)
# The id of the client call being applied (set by prefill/errors.py `session_api`), recorded with its changes.
current_call: contextvars.ContextVar[str | None] = contextvars.ContextVar("rtpd_call", default=None)


class Journal:
    """Appends one session's records. A record's place is fixed when the change is made (`write` is called
    right after it, with no await between), and a write resolves only once every earlier record has landed too:
    an acknowledged change is never behind a gap, which replay would stop at."""

    def __init__(self, store: SessionStore, session_id: str, next_n: int = 0) -> None:
        self.store, self.session_id, self.n = store, session_id, next_n
        self._tail: asyncio.Future[None] | None = None
        self.forgotten = False  # the session is over: a late record (an answer's end) must not bring it back

    def write(self, op: str, **fields: Any) -> asyncio.Future[None]:
        if self.forgotten:
            return asyncio.ensure_future(asyncio.sleep(0))
        record = {"op": op, **fields}
        if (call := current_call.get()) is not None:
            record["call"] = call
        self._tail = asyncio.ensure_future(self._put(self.n, record, self._tail))
        self.n += 1
        # Shielded: a caller cancelled while it waits (its client left mid-call) must not cancel the write, which
        # every later write and `flush` (a DELETE's) wait on.
        return asyncio.shield(self._tail)

    async def _put(self, n: int, record: dict[str, Any], previous: asyncio.Future[None] | None) -> None:
        try:
            await self.store.append(self.session_id, n, record)
        except Exception:  # the session goes on here; only its failover is at risk (and counted)
            logger.exception("session %s: journal write failed", self.session_id)
            metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="journal_write")
        if previous is not None:
            await asyncio.wait([previous])  # (landed or not: its outcome is its own)

    async def flush(self) -> None:
        """Until every record written so far has landed (cancelling the caller leaves the writes be)."""
        if self._tail is not None:
            await asyncio.wait([self._tail])

    async def forget(self) -> None:
        self.forgotten = True
        await self.flush()
        try:
            await self.store.delete(self.session_id)
        except Exception:
            logger.exception("session %s: deleting its journal failed", self.session_id)


def create_record(session: Session) -> dict[str, Any]:
    return {
        "id": session.id,
        "endpoint": session.endpoint,
        "request": session.request,
        "instructions": session.conversation.instructions,
        "policy": session.policy.model_dump(),
        "limits": session.limits.model_dump(),
        "tenant": session.tenant,
        "ephemeral": session.ephemeral,
        "close_after_answer": session.close_after_answer,
        "audio": session.audio,
        "connection": session.connection,
        "preemptive": session.preempt.options.model_dump() if session.preempt is not None else None,
    }


def replay(records: list[dict[str, Any]], streaming: StreamingPrefill) -> Session:
    """The session as its last owner held it (answers in progress as they stood; the caller resumes them)."""
    spec = records[0]
    assert spec["op"] == "create", "a journal starts with its session's creation"
    session = Session(
        streaming.base_id,
        spec["endpoint"],
        spec["request"],
        StartPolicy.model_validate(spec["policy"]),
        SessionLimits.model_validate(spec["limits"]),
        streaming,
    )
    session.conversation.instructions = spec["instructions"]
    session.tenant, session.ephemeral = spec["tenant"], spec["ephemeral"]
    session.close_after_answer = spec.get("close_after_answer", False)
    session.audio = spec.get("audio")
    session.connection = spec.get("connection")
    if spec.get("preemptive") is not None:
        session.preempt = PreemptState(PreemptiveOptions.model_validate(spec["preemptive"]))
    for record in records[1:]:
        _apply(session, record)
        if (call := record.get("call")) is not None:
            session.remember_call(call)
    return session


def _apply(session: Session, record: dict[str, Any]) -> None:
    op = record["op"]
    if op == "chunk":
        session.add_chunk(
            record["seq"],
            record["payload"],
            record["eoi"],
            record["mode"],
            record["offset"],
            role=record.get("role", "user"),
            tool_call_id=record.get("tool_call_id"),
        )
    elif op == "truncate":
        session.conversation.truncate_answer(record["chars"])
    elif op == "message":
        session.add_message(record["role"], record["content"], record.get("tool_call_id"), record.get("tool_calls"))
    elif op == "buffer":
        {
            "append": lambda: session.append_text(record["text"]),
            "replace": lambda: session.replace_text(record["offset"], record["text"]),
            "commit": session.commit_buffer,
            "clear": session.clear_text,
        }[record["kind"]]()
    elif op == "attach":
        session.connection = record["connection"]
    elif op == "update":
        if record["instructions"] is not None:
            session.conversation.instructions = record["instructions"] or None
        session.request.update(record["params"] or {})
        if record.get("preemptive") is False:  # turned off
            session.preempt = None
        elif record.get("preemptive") is not None:
            session.preempt = PreemptState(PreemptiveOptions.model_validate(record["preemptive"]))
        if record.get("view") is not None:  # (its keys, merged as the owner merged them)
            session.view = {**(session.view or {}), **record["view"]}
    elif op == "answer":
        session.input_ended = True
        session.commit_buffer()
        session.answers.append(Answer(turn=len(session.answers), overrides=record["overrides"]))
        session.state = SessionState.ANSWERING
    elif op == "claimed":
        session.answers[record["turn"]].status = "streaming"
    elif op == "released":
        session.answers[record["turn"]].status = "ready"
    elif op == "ended":
        answer, summary = session.answers[record["turn"]], record["summary"]
        answer.text, answer.finish_reason = summary.get("text") or "", summary.get("finish_reason")
        answer.usage, answer.response = summary.get("usage"), summary.get("response") or {}
        answer.tool_calls = summary.get("tool_calls") or None
        answer.finish(summary["status"], summary.get("error"))
        session.conversation.add_answer(answer.text, failed=answer.status == "failed", tool_calls=answer.tool_calls)
        session.state = SessionState.OPEN
    else:
        raise ValueError(f"unknown journal record {op!r}")
