"""Calls on a session's owner prefill replica, from any router replica.

The session-affinity request router (router/placement.py) sends each call to the replica named in the session
id, or to the one this router learnt holds it now. When that replica is gone, the call reaches the replica the
session id hashes to, which adopts the session from its journal (prefill/failover.py) or says where it is (503
with `owner`); a call cut by its replica's death is retried with the same id. The client sees a delay.

Each prefill session method has its typed function here, named as on the replica (`session_buffer(ingress,
session_id, op=..., text=...)`), through `ingress.prefill` (prefill/client.py). The calls that change a session
make one `call_id` for all their tries, so that the owner applies them once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any, Literal, TypeVar, cast

from ray.exceptions import RayActorError

from core import metrics
from core.protocol import capacity_exhausted, error_body, error_status
from core.tasks import detached
from prefill.client import (
    AnswerReply,
    AnswerSummary,
    ClaimReply,
    DeletedReply,
    InfoReply,
    PrefillClient,
    SessionReply,
    StatusReply,
    StreamingReply,
)
from router.admission.gate import session_seen

# Whose request this is: the caller's API key id (router/keys/auth.py), "" without keys. Every session call carries
# it, and a session answers only calls with the id of the key that created it (others get 404).
current_tenant: ContextVar[str] = ContextVar("rtpd_tenant", default="")


def tenant() -> str:
    """The caller's key id (a function: code the Serve ingress pickles by value cannot hold a ContextVar)."""
    return current_tenant.get()


HANDOVER_RETRY_S = 0.25
CAPACITY_RETRY_S = 0.5  # a new session refused by a full prefill replica is asked for again this often
# How long a call keeps trying while its session changes owner: Serve notices a dead replica within seconds,
# and a drained replica's sessions are handed over within its drain timeout.
FAILOVER_WAIT_S = 30.0
MAX_KNOWN_OWNERS = 100_000
# Where sessions are now, as replicas answered (503 with `owner`): calls go straight there next time.
owners: OrderedDict[str, str] = OrderedDict()
R = TypeVar("R", bound=Mapping[str, Any])  # a session call's reply type (prefill/client.py)
# One try of a session call: the prefill client and the replica to send it to (None: the one the id names).
OwnerCall = Callable[[PrefillClient, str | None], Awaitable[R]]


def handing_over(result: Any) -> bool:
    return isinstance(result, dict) and isinstance(result.get("error"), dict) and error_status(result) == 503


def not_found(result: dict[str, Any]) -> dict[str, Any]:
    """The session did not settle on a live replica within the failover window: it counts as gone."""
    return error_body(404, f"session not found: {result['error']['message']}", "session_id")


def _learn(session_id: str, owner: str) -> None:
    owners[session_id] = owner
    owners.move_to_end(session_id)
    if len(owners) > MAX_KNOWN_OWNERS:
        owners.popitem(last=False)


def new_call_id() -> str:
    """A call that changes a session: made once per call, so that a retry after its owner died is acknowledged,
    not applied twice (prefill/errors.py `session_api`)."""
    return uuid.uuid4().hex


async def create_session(
    ingress: Any, spec: dict[str, Any], abandoned: Callable[[], None] | None = None
) -> SessionReply:
    """A new session on some prefill replica, owned by the caller's key (and within its session cap).

    The call runs in a task of its own (core/tasks.py): a client that leaves meanwhile (its request cancelled)
    does not cut it half-way; the session it makes is deleted, and `abandoned` runs at once (the caller's
    admission ticket: nothing the client left behind stays counted or open)."""
    spec = {**spec, "tenant": current_tenant.get()}
    admission = getattr(getattr(getattr(ingress, "config", None), "router", None), "admission", None)
    wait_s = admission.max_wait_s if admission is not None and admission.enabled else 0.0
    prefill: PrefillClient = ingress.prefill

    async def create() -> SessionReply:
        # Admission read the replicas' stats up to a second old: a replica found full when asked is asked again
        # (room frees as sessions end) within the admission's wait, rather than the client refused at once.
        deadline = time.monotonic() + wait_s
        while True:
            made = await prefill.create_session(spec)
            if not capacity_exhausted(made) or time.monotonic() + CAPACITY_RETRY_S > deadline:
                return made
            await asyncio.sleep(CAPACITY_RETRY_S)

    call = detached(create())
    try:
        return await asyncio.shield(call)
    except BaseException:
        if abandoned is not None:
            abandoned()
        call.add_done_callback(lambda done: _delete_made(ingress, done))
        raise


def _delete_made(ingress: Any, call: asyncio.Task[dict[str, Any]]) -> None:
    if not call.cancelled() and call.exception() is None and "session_id" in (made := call.result()):
        detached(session_delete(ingress, made["session_id"]))


async def session_call(ingress: Any, session_id: str, call: OwnerCall[R]) -> R:
    """A call on the session's owner replica. While the session changes owner (its replica died or drains),
    the call is tried again (the same `call`, so a mutating one keeps its `call_id`) until it lands where the
    session now is (bounded)."""
    result = await _owner_call(ingress, session_id, call)
    session_seen(ingress, session_id, result)  # (admission: active again, or gone)
    return result


async def _owner_call(ingress: Any, session_id: str, call: OwnerCall[R]) -> R:
    prefill: PrefillClient = ingress.prefill
    deadline = time.monotonic() + FAILOVER_WAIT_S
    while True:
        route = owners.get(session_id)
        try:
            result = await call(prefill, route)
        except RayActorError:  # the owner died with the call: the session's next owner answers the retry
            if time.monotonic() > deadline:
                raise
            metrics.inc(metrics.SESSION_CALL_RETRIES, 1, "session calls retried", why="replica_died")
            owners.pop(session_id, None)
            await asyncio.sleep(HANDOVER_RETRY_S)
            continue
        if not handing_over(result):
            return result
        moved = result["error"].get("owner")
        if time.monotonic() > deadline:
            return cast(R, not_found(result))  # (an error reply: any reply may be one)
        if moved is not None and moved != route:
            _learn(session_id, moved)  # held by that replica: straight there
            continue
        metrics.inc(metrics.SESSION_CALL_RETRIES, 1, "session calls retried", why="handing_over")
        await asyncio.sleep(HANDOVER_RETRY_S)


# --- the session calls (prefill/server.py methods, done by prefill/session_api.py and prefill/handoff.py) ---------
# Each carries the caller's key; those that change the session (chunk, message, buffer, update, finish, respond) a
# `call_id` too, made once for all their tries.
async def session_chunk(
    ingress: Any,
    session_id: str,
    *,
    sequence_id: int,
    payload: str,
    end_of_input: bool = False,
    mode: str = "append",
    offset: int | None = None,
    role: str = "user",
    tool_call_id: str | None = None,
    audio_start: bool = False,
) -> SessionReply:
    who, call_id = tenant(), new_call_id()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_chunk(
            session_id=session_id,
            sequence_id=sequence_id,
            payload=payload,
            end_of_input=end_of_input,
            mode=mode,
            offset=offset,
            role=role,
            tool_call_id=tool_call_id,
            audio_start=audio_start,
            tenant=who,
            call_id=call_id,
            route_to=route,
        ),
    )


async def session_message(
    ingress: Any,
    session_id: str,
    *,
    role: str,
    content: str,
    tool_call_id: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> SessionReply:
    who, call_id = tenant(), new_call_id()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_message(
            session_id=session_id,
            role=role,
            content=content,
            tool_call_id=tool_call_id,
            tool_calls=tool_calls,
            tenant=who,
            call_id=call_id,
            route_to=route,
        ),
    )


async def session_truncate(ingress: Any, session_id: str, *, chars: int) -> SessionReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_truncate(session_id=session_id, chars=chars, tenant=who, route_to=route),
    )


async def session_buffer(ingress: Any, session_id: str, *, op: str, text: str = "", offset: int = 0) -> SessionReply:
    who, call_id = tenant(), new_call_id()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_buffer(
            session_id=session_id, op=op, text=text, offset=offset, tenant=who, call_id=call_id, route_to=route
        ),
    )


async def session_preempt(ingress: Any, session_id: str) -> SessionReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_preempt(session_id=session_id, tenant=who, route_to=route),
    )


async def session_update(
    ingress: Any,
    session_id: str,
    *,
    instructions: str | None = None,
    params: dict[str, Any] | None = None,
    preemptive: dict[str, Any] | Literal[False] | None = None,
    view: dict[str, Any] | None = None,
) -> SessionReply:
    who, call_id = tenant(), new_call_id()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_update(
            session_id=session_id,
            instructions=instructions,
            params=params,
            preemptive=preemptive,
            view=view,
            tenant=who,
            call_id=call_id,
            route_to=route,
        ),
    )


async def session_finish(ingress: Any, session_id: str, *, overrides: dict[str, Any] | None = None) -> AnswerReply:
    who, call_id = tenant(), new_call_id()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_finish(
            session_id=session_id, overrides=overrides, tenant=who, call_id=call_id, route_to=route
        ),
    )


async def session_respond(ingress: Any, session_id: str, *, overrides: dict[str, Any] | None = None) -> AnswerReply:
    who, call_id = tenant(), new_call_id()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_respond(
            session_id=session_id, overrides=overrides, tenant=who, call_id=call_id, route_to=route
        ),
    )


async def session_delete(ingress: Any, session_id: str) -> DeletedReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_delete(session_id=session_id, tenant=who, route_to=route),
    )


async def session_attach(ingress: Any, session_id: str, *, connection: str | None = None) -> SessionReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_attach(
            session_id=session_id, connection=connection, tenant=who, route_to=route
        ),
    )


async def session_status(ingress: Any, session_id: str, tenant: str) -> StatusReply:
    """The session's state, asked by the router itself for admission (with the key that opened it): no
    client's call, so not counted as the session's activity here."""
    return await _owner_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_status(session_id=session_id, tenant=tenant, route_to=route),
    )


async def session_info(ingress: Any, session_id: str) -> InfoReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_info(session_id=session_id, tenant=who, route_to=route),
    )


async def session_claim(
    ingress: Any,
    session_id: str,
    *,
    turn: int | None = None,
    fresh: bool = False,
    adopts: bool = True,
    reclaim: bool = False,
    holding: str | None = None,
) -> ClaimReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_claim(
            session_id=session_id,
            turn=turn,
            fresh=fresh,
            adopts=adopts,
            reclaim=reclaim,
            holding=holding,
            tenant=who,
            route_to=route,
        ),
    )


async def session_answer_done(ingress: Any, session_id: str, *, turn: int, outcome: dict[str, Any]) -> AnswerSummary:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_answer_done(
            session_id=session_id, turn=turn, outcome=outcome, tenant=who, route_to=route
        ),
    )


async def session_streaming(ingress: Any, session_id: str, *, turn: int, decode: dict[str, Any]) -> StreamingReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_streaming(
            session_id=session_id, turn=turn, decode=decode, tenant=who, route_to=route
        ),
    )


async def session_alive(ingress: Any, session_id: str, *, turn: int) -> StreamingReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_alive(session_id=session_id, turn=turn, tenant=who, route_to=route),
    )


async def session_cancel(ingress: Any, session_id: str) -> AnswerReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_cancel(session_id=session_id, tenant=who, route_to=route),
    )


async def session_result(ingress: Any, session_id: str, *, turn: int | None = None, wait: bool = True) -> AnswerReply:
    who = tenant()
    return await session_call(
        ingress,
        session_id,
        lambda prefill, route: prefill.session_result(
            session_id=session_id, turn=turn, wait=wait, tenant=who, route_to=route
        ),
    )
