"""Calls on a session's owner prefill replica, from any router replica.

The session-affinity request router (router/placement.py) sends each call to the replica named in the session
id, or to the one this router learnt holds it now. When that replica is gone, the call reaches the replica the
session id hashes to, which adopts the session from its journal (prefill/failover.py) or says where it is (503
with `owner`); a call cut by its replica's death is retried with the same id. The client sees a delay.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from ray.exceptions import RayActorError

from core import metrics
from core.protocol import capacity_exhausted, error_body, error_status
from core.tasks import detached
from router.admission import session_seen

# Whose request this is: the caller's API key id (router/auth.py), "" without keys. Every session call carries
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
# Calls that change a session carry an id, so that one retried after its owner died is not applied twice.
MUTATING = frozenset(
    {"session_chunk", "session_message", "session_buffer", "session_update", "session_finish", "session_respond"}
)
# Where sessions are now, as replicas answered (503 with `owner`): calls go straight there next time.
owners: OrderedDict[str, str] = OrderedDict()


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


async def create_session(
    ingress: Any, spec: dict[str, Any], abandoned: Callable[[], None] | None = None
) -> dict[str, Any]:
    """A new session on some prefill replica, owned by the caller's key (and within its session cap).

    The call runs in a task of its own (core/tasks.py): a client that leaves meanwhile (its request cancelled)
    does not cut it half-way; the session it makes is deleted, and `abandoned` runs at once (the caller's
    admission ticket: nothing the client left behind stays counted or open)."""
    spec = {**spec, "tenant": current_tenant.get()}
    admission = getattr(getattr(getattr(ingress, "config", None), "router", None), "admission", None)
    wait_s = admission.max_wait_s if admission is not None and admission.enabled else 0.0

    async def create() -> dict[str, Any]:
        # Admission read the replicas' stats up to a second old: a replica found full when asked is asked again
        # (room frees as sessions end) within the admission's wait, rather than the client refused at once.
        deadline = time.monotonic() + wait_s
        while True:
            made = await ingress.prefill.create_session.remote(spec)
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
        detached(session_call(ingress, "session_delete", session_id=made["session_id"]))


async def session_call(ingress: Any, method: str, **kwargs: Any) -> dict[str, Any]:
    """A call on the session's owner replica. While the session changes owner (its replica died or drains),
    the call is retried, with the same `call_id`, until it lands where the session now is (bounded)."""
    result = await _owner_call(ingress, method, **kwargs)
    if (session_id := kwargs.get("session_id")) is not None:
        session_seen(ingress, session_id, result)  # (admission: active again, or gone)
    return result


async def session_status(ingress: Any, session_id: str, tenant: str) -> dict[str, Any]:
    """The session's state, asked by the router itself for admission: no client's call, so not counted as the
    session's activity here."""
    return await _owner_call(ingress, "session_status", session_id=session_id, tenant=tenant)


async def _owner_call(ingress: Any, method: str, **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("tenant", current_tenant.get())
    session_id = kwargs.get("session_id")
    if method in MUTATING:
        kwargs.setdefault("call_id", uuid.uuid4().hex)
    deadline = time.monotonic() + FAILOVER_WAIT_S
    while True:
        route = {"route_to": owners[session_id]} if session_id in owners else {}
        try:
            result = await getattr(ingress.prefill, method).remote(**kwargs, **route)
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
            return not_found(result)
        if moved is not None and moved != route.get("route_to"):
            _learn(session_id, moved)  # held by that replica: straight there
            continue
        metrics.inc(metrics.SESSION_CALL_RETRIES, 1, "session calls retried", why="handing_over")
        await asyncio.sleep(HANDOVER_RETRY_S)
