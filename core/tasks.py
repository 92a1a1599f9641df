"""Tasks that belong to no client request: the router's decode feed readers, and what a cancelled request must
still do (the router's reports to owners, prefill's release of a given-up preemptive hand-off on decode).

When a client leaves, Serve cancels its request, and Ray cancels it *recursively*: every Ray call in flight
from the request's asyncio context is cancelled too, including calls made by the tasks it spawned (a task
copies its creator's context). A feed reader carries every stream between a router and a decode replica,
and a report tells an owner how an answer ended: neither is the request's that happened to start it. The storm
found it: one client leaving mid-answer ended every other answer streaming from the same decode replica.
`detached` runs such work in a context without the request's identity (Ray's `async_task_id` and Serve's
request context), so that only its own cancellation stops it; other context (the caller's API key) is kept.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

_kept: set[asyncio.Task[Any]] = set()  # running detached tasks (the loop keeps only weak references)


def detached(call: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run `call` to its end in a task of its own, outside any request; its failure is logged."""
    context = contextvars.copy_context()
    context.run(_forget_request)
    task = asyncio.get_running_loop().create_task(call, context=context)
    _kept.add(task)
    task.add_done_callback(_finished)
    return task


def _forget_request() -> None:
    from ray import _raylet  # (imported here: Serve pickles the router's ingress app by value)
    from ray.serve import context

    _raylet.async_task_id.set(None)  # type: ignore[attr-defined]
    context._serve_request_context.set(None)  # type: ignore[arg-type]


def _finished(task: asyncio.Task[Any]) -> None:
    _kept.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("detached task failed", exc_info=error)
