"""Errors a prefill replica answers with, as OpenAI error JSON (the router turns them into HTTP or Realtime)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from core import metrics
from core.protocol import CAPACITY_EXHAUSTED, error_body
from prefill.conversation import SessionError
from prefill.journal import current_call

if TYPE_CHECKING:
    from core.scheduler_config import SchedulerSettings
    from prefill.session import Session


def overloaded(retry_after: int, why: str = "no KV memory could be freed in time") -> dict[str, Any]:
    """429 with `Retry-After`: the replica is at capacity (KV memory held by work that cannot be evicted,
    or every session slot taken)."""
    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="overloaded")
    body = error_body(429, f"{CAPACITY_EXHAUSTED}: {why}; retry later")
    body["error"]["retry_after"] = retry_after
    return body


# The caller's key id (router/keys/auth.py; "" without keys), for the duration of a session call: a session answers
# only calls made with the key that created it (prefill/session_table.py `get`).
caller: ContextVar[str] = ContextVar("rtpd_caller", default="")


class SessionGate(Protocol):
    """What the decorators below need of the object whose session calls they wrap (prefill/server.py)."""

    @property
    def sessions(self) -> Mapping[str, Session]: ...

    @property
    def settings(self) -> SchedulerSettings: ...

    async def _locate(self, session_id: str) -> None: ...

    async def _close(self, session: Session, reason: str) -> None: ...


# The wrappers below only call module-level functions: Serve pickles the deployment class by value, and with it
# these closures, whose globals must then pickle (the context variables do not; the functions go by reference).
def serialized(method: Callable[..., Awaitable[dict[str, Any]]]) -> Callable[..., Awaitable[dict[str, Any]]]:
    """The call holds its session's lock: calls on one session apply one at a time, in arrival order (asyncio's
    lock is fair), however many the replica runs at once. Used for every call that changes a session."""

    @functools.wraps(method)
    async def wrapper(self: SessionGate, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await _serialized_call(method, self, args, kwargs)

    return wrapper


async def _serialized_call(
    method: Callable[..., Awaitable[dict[str, Any]]], self: SessionGate, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    session = self.sessions.get(kwargs.get("session_id", ""))
    if session is None:
        return await method(self, *args, **kwargs)
    async with session.lock:
        return await method(self, *args, **kwargs)


def session_api(method: Callable[..., Awaitable[dict[str, Any]]]) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A session call's errors become OpenAI error JSON; a broken input also closes the session (a refused
    chunk does not: past a limit nothing is applied, and the session keeps what it had).
    `tenant`, the caller's key id, is taken from the call and checked where the session is looked up.
    A session held elsewhere is located first (prefill/failover.py: adopted here if its owner died, or the
    router is told where it is), and a call retried after a failover (`call_id`) that was applied already is
    acknowledged, not applied twice."""

    @functools.wraps(method)
    async def wrapper(self: SessionGate, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await _session_call(method, self, args, kwargs)

    return wrapper


async def _session_call(
    method: Callable[..., Awaitable[dict[str, Any]]], self: SessionGate, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    token = caller.set(str(kwargs.pop("tenant", "") or ""))
    kwargs.pop("route_to", None)  # (read by the request router, router/placement.py)
    call_id = kwargs.pop("call_id", None)
    call_token = current_call.set(call_id)
    session_id = kwargs.get("session_id")
    try:
        if isinstance(session_id, str) and session_id not in self.sessions:
            await self._locate(session_id)
        session = self.sessions.get(session_id or "")
        if call_id is not None and session is not None and call_id in session.applied_calls:
            metrics.inc(metrics.SESSION_CALL_RETRIES, 1, "session calls retried", why="already_applied")
            reply = session.describe()
            return {**reply, "answer": session.answers[-1].summary()} if session.answers else reply
        result = await method(self, *args, **kwargs)
        if call_id is not None and session is not None and "error" not in result:
            session.remember_call(call_id)
        return result
    except SessionError as e:
        metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"session_{e.status}")
        if e.close and (session := self.sessions.get(kwargs.get("session_id", ""))):
            await self._close(session, e.message)
        body = error_body(e.status, e.message, e.param)
        if (owner := getattr(e, "owner", None)) is not None:
            body["error"]["owner"] = owner  # where the session is now (router/sessions/owner.py goes there)
        return body
    except TimeoutError:  # a bounded wait on the engine ran out: the input is kept, the client retries
        return overloaded(self.settings.retry_after_s)
    finally:
        current_call.reset(call_token)
        caller.reset(token)
