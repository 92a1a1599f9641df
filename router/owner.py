"""Calls on a session's owner prefill replica, from any router replica.

The session-affinity request router (router/placement.py) sends each call to the replica named in the session
id. While a draining replica hands its sessions over, a call answers 503 until routers learn the adopter:
such calls are retried for a few seconds, after which the session counts as gone (404).
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

from serve_app.protocol import error_body, error_status

# Whose request this is: the caller's API key id (router/auth.py), "" without keys. Every session call carries
# it, and a session answers only calls with the id of the key that created it (others get 404).
current_tenant: ContextVar[str] = ContextVar("rtpd_tenant", default="")


def tenant() -> str:
    """The caller's key id (a function: code the Serve ingress pickles by value cannot hold a ContextVar)."""
    return current_tenant.get()


HANDOVER_RETRY_S = 0.25
HANDOVER_WAIT_S = 5.0  # a drained replica's sessions reappear on their adopter within a few seconds


def handing_over(result: Any) -> bool:
    return isinstance(result, dict) and isinstance(result.get("error"), dict) and error_status(result) == 503


def not_found(result: dict[str, Any]) -> dict[str, Any]:
    """No replica owns or adopted the session after the hand-over window: it does not exist (any more)."""
    message = result["error"]["message"].replace("is being handed over; retry", "not found")
    return error_body(404, message, "session_id")


async def create_session(ingress: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """A new session on some prefill replica, owned by the caller's key (and within its session cap)."""
    spec = {**spec, "tenant": current_tenant.get()}
    return await ingress.prefill.create_session.remote(spec)


async def session_call(ingress: Any, method: str, **kwargs: Any) -> dict[str, Any]:
    """A call on the session's owner replica, retried while the session is being handed over (503)."""
    kwargs.setdefault("tenant", current_tenant.get())
    waited = 0.0
    while True:
        result = await getattr(ingress.prefill, method).remote(**kwargs)
        if not handing_over(result):
            return result
        if waited >= HANDOVER_WAIT_S:
            return not_found(result)
        await asyncio.sleep(HANDOVER_RETRY_S)
        waited += HANDOVER_RETRY_S
