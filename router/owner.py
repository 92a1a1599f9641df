"""Calls on a session's owner prefill replica, from any router replica.

The session-affinity request router (router/placement.py) sends each call to the replica named in the session
id. While a draining replica hands its sessions over, a call answers 503 until routers learn the adopter:
such calls are retried for a few seconds, after which the session counts as gone (404).
"""

from __future__ import annotations

import asyncio
from typing import Any

from serve_app.protocol import error_body, error_status

HANDOVER_RETRY_S = 0.25
HANDOVER_WAIT_S = 5.0  # a drained replica's sessions reappear on their adopter within a few seconds


def handing_over(result: Any) -> bool:
    return isinstance(result, dict) and isinstance(result.get("error"), dict) and error_status(result) == 503


def not_found(result: dict[str, Any]) -> dict[str, Any]:
    """No replica owns or adopted the session after the hand-over window: it does not exist (any more)."""
    message = result["error"]["message"].replace("is being handed over; retry", "not found")
    return error_body(404, message, "session_id")


async def session_call(ingress: Any, method: str, **kwargs: Any) -> dict[str, Any]:
    """A call on the session's owner replica, retried while the session is being handed over (503)."""
    waited = 0.0
    while True:
        result = await getattr(ingress.prefill, method).remote(**kwargs)
        if not handing_over(result):
            return result
        if waited >= HANDOVER_WAIT_S:
            return not_found(result)
        await asyncio.sleep(HANDOVER_RETRY_S)
        waited += HANDOVER_RETRY_S
