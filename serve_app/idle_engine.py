"""An engine whose only work is KV held for another engine to read waits for input instead of stepping every ms.

A prefill request that hands its KV to decode finishes at once, but vLLM keeps it until the NIXL connector says
decode has read the blocks (or their lease ends: `kv_transfer.lease_s`, 30 s here). Until then the scheduler
`has_requests()`, and vLLM's engine loop steps every millisecond (an empty step, then `time.sleep(0.001)`) so that
its worker polls the connector: measured, a whole core between the engine-core and worker processes while a hand-off
waited (a preemptive answer given up before its decode started holds one for the whole lease). Here, once a step
ran nothing and nothing else is left, the loop waits on its input queue for up to `POLL_S`: new work is taken at
once, and the connector is polled each second, so held blocks are freed at most that late (decode's read is
one-sided: it does not wait for this engine).
"""

from __future__ import annotations

import queue
from typing import Any

POLL_S = 1.0  # how late held blocks are freed at most, when nothing else comes

_original: Any = None


def only_held_kv(scheduler: Any) -> bool:
    """Nothing to schedule and no finished request to report: the requests left wait for the connector only."""
    if scheduler.has_unfinished_requests() or getattr(scheduler, "finished_req_ids", None):
        return False
    connector = getattr(scheduler, "connector", None)
    if connector is None or connector.has_pending_push_work():
        return False
    running, waiting = scheduler.get_request_counts()
    return len(scheduler.requests) > running + waiting


def _step(self: Any) -> bool:
    executed = _original(self)
    if not executed and only_held_kv(self.scheduler):
        try:
            request = self.input_queue.get(timeout=POLL_S)
        except queue.Empty:
            return executed
        self._handle_client_request(*request)
    return executed


def install() -> None:
    """Wrap vLLM's engine step (in an engine-core process: serve_app/engine.py). Idempotent."""
    global _original
    from vllm.v1.engine.core import EngineCoreProc

    if _original is None:
        _original = EngineCoreProc._process_engine_step
        EngineCoreProc._process_engine_step = _step


def uninstall() -> None:
    global _original
    from vllm.v1.engine.core import EngineCoreProc

    if _original is not None:
        EngineCoreProc._process_engine_step, _original = _original, None
