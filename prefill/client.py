"""The prefill role's client: what routers (and prefill's peers) call on prefill replicas, with typed arguments.

The methods are prefill/server.py's `PrefillServer`'s: `prefill`, `check_health`, a streaming-input session's calls
(done by prefill/session_api.py and prefill/handoff.py) and `adopt_sessions` (prefill/failover.py). Calls go by
value over gRPC (`_by_reference=False`, serve_app/serve_env.py); each method's Serve handle is made once (a handle's
attribute builds a new handle on every access). A session call goes to the session's owner (router/placement.py):
the one its id names, or `route_to`, the replica a router learnt holds it now (router/sessions/owner.py). Every
session call carries `tenant`, the caller's key id; one that changes the session carries a `call_id`, so that a
retry after its owner died is not applied twice (router/sessions/owner.py reuses it across retries)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Literal, TypedDict

from ray.serve.handle import DeploymentHandle

from core.handles import MethodHandles
from core.protocol import Endpoint

__all__ = [
    "AnswerReply",
    "AnswerSummary",
    "ClaimReply",
    "DeletedReply",
    "InfoReply",
    "PrefillClient",
    "PrefillReply",
    "Reply",
    "SessionReply",
    "StatusReply",
]


# --- what comes back (JSON-shaped: the router forwards much of it as is) ------------------------------------------
class Reply(TypedDict, total=False):
    """Every reply may be an error instead: `{"error": <OpenAI error object>}` (core/protocol.py)."""

    error: dict[str, Any]


class PrefillReply(Reply, total=False):
    """`prefill`: where the KV is for decode (with the prompt's ids for a chat) and the prompt's length."""

    kv_transfer_params: dict[str, Any]
    prompt_tokens: int


class AnswerSummary(TypedDict, total=False):
    """One answer of a session (prefill/answer.py `Answer.summary`)."""

    turn: int
    status: str  # preparing, ready, streaming, done, failed, cancelled
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    response: dict[str, Any]
    tool_calls: list[dict[str, Any]] | None
    timing: dict[str, float]


class SessionReply(Reply, total=False):
    """A session as its owner describes it (prefill/session.py `Session.describe`), with what the call adds."""

    session_id: str
    state: str
    endpoint: str
    next_sequence_id: int
    pending: list[int]
    payload_bytes: int
    input_ended: bool
    turns: int
    resident_tokens: int
    rewrites: int
    invalidated_tokens: int
    coalesced: int
    streaming: bool
    prefilled: bool
    buffered: bool
    preemptive: dict[str, Any]
    audio: dict[str, Any]
    expires_in: float
    duplicate: bool  # session_chunk: a retried chunk, applied before
    applied: list[int]  # session_chunk: the sequence ids this call applied
    started: bool  # session_chunk: the input ended and the answer started
    preempting: bool  # session_preempt: a preemptive answer starts now


class AnswerReply(SessionReply, total=False):
    """`session_finish`, `session_respond`, `session_cancel`, `session_result`: the session and its answer (`pending`
    instead while `session_result` has none yet); `stop`: the decode stream a cancel stops."""

    answer: AnswerSummary | None
    stop: dict[str, Any]


class ClaimReply(Reply, total=False):
    """`session_claim`: `pending` (no answer yet; `provisional`: the preemptive answer a reader may hold), the decode
    request to start (`request`) or to adopt (`adopt`), or the answer's summary when it cannot be streamed."""

    pending: bool
    provisional: dict[str, Any] | None
    turn: int
    endpoint: str
    include_usage: bool
    timing: dict[str, float]
    adopt: dict[str, Any]
    request: dict[str, Any]
    answer: AnswerSummary
    last_chunk_time: float


class StatusReply(Reply, total=False):
    session_id: str
    state: str
    answer_status: str | None


class DeletedReply(Reply, total=False):
    session_id: str
    deleted: bool


class InfoReply(SessionReply, total=False):
    """`session_info`: the session, what a re-attaching client needs, and its work and scheduler figures."""

    close_reason: str | None
    instructions: str | None
    buffer: str
    sampling: dict[str, Any]
    request_ids: list[str]
    prompt_tokens_computed: int
    block_size: int
    work: dict[str, Any]
    answers: list[AnswerSummary]
    scheduler: dict[str, Any]


class StreamingReply(Reply, total=False):
    """`session_streaming`, `session_alive`: `stop` names the decode stream to stop (the answer was cancelled)."""

    stop: dict[str, Any]


class AdoptedReply(Reply, total=False):
    """`adopt_sessions`: the sessions this replica took over."""

    adopted: list[str]
    by: str


class PrefillClient:
    """Each call returns what its handle returns: an awaitable of the replica's reply (the types above)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._method = MethodHandles(handle)

    def _session(self, name: str, route_to: str | None, **kwargs: Any) -> Awaitable[Any]:
        # No `route_to` unless given: the request router then takes the replica the session id names.
        route = {"route_to": route_to} if route_to is not None else {}
        return self._method(name).remote(**kwargs, **route)

    # --- whole prompts and health -------------------------------------------------------------------
    def prefill(self, endpoint: Endpoint, body: dict[str, Any]) -> Awaitable[PrefillReply]:
        """A one-token prefill leaving the KV for decode: `{"kv_transfer_params": ...}` or `{"error": ...}`."""
        return self._method("prefill").remote(endpoint, body)

    def check_health(self) -> Awaitable[None]:
        return self._method("check_health").remote()

    # --- sessions -----------------------------------------------------------------------------------
    def create_session(self, spec: dict[str, Any]) -> Awaitable[SessionReply]:
        """A new session on some replica (`spec["tenant"]` owns it): its description, or an error (429: full)."""
        return self._method("create_session").remote(spec)

    def session_chunk(
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
        tenant: str,
        call_id: str,
        route_to: str | None = None,
    ) -> Awaitable[SessionReply]:
        return self._session(
            "session_chunk",
            route_to,
            session_id=session_id,
            sequence_id=sequence_id,
            payload=payload,
            end_of_input=end_of_input,
            mode=mode,
            offset=offset,
            role=role,
            tool_call_id=tool_call_id,
            audio_start=audio_start,
            tenant=tenant,
            call_id=call_id,
        )

    def session_message(
        self,
        *,
        session_id: str,
        role: str,
        content: str,
        tool_call_id: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        tenant: str,
        call_id: str,
        route_to: str | None = None,
    ) -> Awaitable[SessionReply]:
        return self._session(
            "session_message",
            route_to,
            session_id=session_id,
            role=role,
            content=content,
            tool_call_id=tool_call_id,
            tool_calls=tool_calls,
            tenant=tenant,
            call_id=call_id,
        )

    def session_truncate(
        self, *, session_id: str, chars: int, tenant: str, route_to: str | None = None
    ) -> Awaitable[SessionReply]:
        return self._session("session_truncate", route_to, session_id=session_id, chars=chars, tenant=tenant)

    def session_buffer(
        self,
        *,
        session_id: str,
        op: str,
        text: str = "",
        offset: int = 0,
        tenant: str,
        call_id: str,
        route_to: str | None = None,
    ) -> Awaitable[SessionReply]:
        return self._session(
            "session_buffer",
            route_to,
            session_id=session_id,
            op=op,
            text=text,
            offset=offset,
            tenant=tenant,
            call_id=call_id,
        )

    def session_preempt(self, *, session_id: str, tenant: str, route_to: str | None = None) -> Awaitable[SessionReply]:
        return self._session("session_preempt", route_to, session_id=session_id, tenant=tenant)

    def session_update(
        self,
        *,
        session_id: str,
        instructions: str | None = None,
        params: dict[str, Any] | None = None,
        preemptive: dict[str, Any] | Literal[False] | None = None,
        view: dict[str, Any] | None = None,
        tenant: str,
        call_id: str,
        route_to: str | None = None,
    ) -> Awaitable[SessionReply]:
        return self._session(
            "session_update",
            route_to,
            session_id=session_id,
            instructions=instructions,
            params=params,
            preemptive=preemptive,
            view=view,
            tenant=tenant,
            call_id=call_id,
        )

    def session_finish(
        self,
        *,
        session_id: str,
        overrides: dict[str, Any] | None = None,
        tenant: str,
        call_id: str,
        route_to: str | None = None,
    ) -> Awaitable[AnswerReply]:
        return self._session(
            "session_finish", route_to, session_id=session_id, overrides=overrides, tenant=tenant, call_id=call_id
        )

    def session_respond(
        self,
        *,
        session_id: str,
        overrides: dict[str, Any] | None = None,
        tenant: str,
        call_id: str,
        route_to: str | None = None,
    ) -> Awaitable[AnswerReply]:
        return self._session(
            "session_respond", route_to, session_id=session_id, overrides=overrides, tenant=tenant, call_id=call_id
        )

    def session_delete(self, *, session_id: str, tenant: str, route_to: str | None = None) -> Awaitable[DeletedReply]:
        return self._session("session_delete", route_to, session_id=session_id, tenant=tenant)

    def session_attach(
        self, *, session_id: str, connection: str | None = None, tenant: str, route_to: str | None = None
    ) -> Awaitable[SessionReply]:
        return self._session("session_attach", route_to, session_id=session_id, connection=connection, tenant=tenant)

    def session_status(self, *, session_id: str, tenant: str, route_to: str | None = None) -> Awaitable[StatusReply]:
        return self._session("session_status", route_to, session_id=session_id, tenant=tenant)

    def session_info(self, *, session_id: str, tenant: str, route_to: str | None = None) -> Awaitable[InfoReply]:
        return self._session("session_info", route_to, session_id=session_id, tenant=tenant)

    # --- answers (prefill/handoff.py) ---------------------------------------------------------------
    def session_claim(
        self,
        *,
        session_id: str,
        turn: int | None = None,
        fresh: bool = False,
        adopts: bool = True,
        reclaim: bool = False,
        holding: str | None = None,
        tenant: str,
        route_to: str | None = None,
    ) -> Awaitable[ClaimReply]:
        return self._session(
            "session_claim",
            route_to,
            session_id=session_id,
            turn=turn,
            fresh=fresh,
            adopts=adopts,
            reclaim=reclaim,
            holding=holding,
            tenant=tenant,
        )

    def session_answer_done(
        self, *, session_id: str, turn: int, outcome: dict[str, Any], tenant: str, route_to: str | None = None
    ) -> Awaitable[AnswerSummary]:
        return self._session(
            "session_answer_done", route_to, session_id=session_id, turn=turn, outcome=outcome, tenant=tenant
        )

    def session_streaming(
        self, *, session_id: str, turn: int, decode: dict[str, Any], tenant: str, route_to: str | None = None
    ) -> Awaitable[StreamingReply]:
        return self._session(
            "session_streaming", route_to, session_id=session_id, turn=turn, decode=decode, tenant=tenant
        )

    def session_alive(
        self, *, session_id: str, turn: int, tenant: str, route_to: str | None = None
    ) -> Awaitable[StreamingReply]:
        return self._session("session_alive", route_to, session_id=session_id, turn=turn, tenant=tenant)

    def session_cancel(self, *, session_id: str, tenant: str, route_to: str | None = None) -> Awaitable[AnswerReply]:
        return self._session("session_cancel", route_to, session_id=session_id, tenant=tenant)

    def session_result(
        self, *, session_id: str, turn: int | None = None, wait: bool = True, tenant: str, route_to: str | None = None
    ) -> Awaitable[AnswerReply]:
        return self._session("session_result", route_to, session_id=session_id, turn=turn, wait=wait, tenant=tenant)

    # --- peers (prefill/failover.py) ----------------------------------------------------------------
    def adopt_sessions(
        self,
        *,
        owner: str,
        journals: list[list[dict[str, Any]]],
        session_id: str | None = None,
        route_to: str | None = None,
    ) -> Awaitable[AdoptedReply]:
        """A draining replica's sessions taken over: `{"adopted": [ids], "by": replica}`. `session_id` and
        `route_to` only steer the call (to its adopter); without them any replica takes it."""
        steer = {"session_id": session_id} if session_id is not None else {}
        return self._session("adopt_sessions", route_to, owner=owner, journals=journals, **steer)
