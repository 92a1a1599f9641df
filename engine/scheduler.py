"""vLLM scheduler with per-request compute accounting, used by both prefill and decode engines.

vLLM's own prompt-token stats count a request's first scheduled prefill only; a streaming-input session
is prefilled chunk by chunk, and a decode engine loads most of its prompt over NIXL. To show what each
engine really computed, this scheduler counts, per request, the prompt tokens it scheduled for the model
(each scheduled token is one computed KV slot). The counts are read from the frontend through an
EngineCore utility call (`rtpd_compute_stats`), the same channel vLLM uses for its own utility methods.

It also counts KV loads that failed (a NIXL transfer or handshake that did not complete): with
`kv_load_failure_policy: recompute` (core/config.py) vLLM recomputes those tokens here instead of failing
the request, and these counts say how often and how much.

Configured with vLLM's extension point: `scheduler_cls="engine.scheduler.AccountingScheduler"`.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

MAX_TRACKED_REQUESTS = 20_000
_HANDOFF = re.compile(r"-t\d+-h\d+")  # a session's hand-off (prefill/handoff.py names it <session>-t<turn>-h<n>)
_PREEMPTIVE = re.compile(r"-t\d+-p\d+")  # a preemptive answer's hand-off (prefill/preemptive.py: -t<turn>-p<n>)


def work_kind(request_id: str) -> str:
    """What a request's computed tokens are for: a session's input streamed as it arrives (prefill/streaming.py
    names those requests <session>-stream<n>), a session's hand-off at end of input, a preemptive answer's
    hand-off before it, or a whole prompt."""
    if "-stream" in request_id:
        return "streamed"
    if _HANDOFF.search(request_id):
        return "handoff"
    return "preemptive" if _PREEMPTIVE.search(request_id) else "whole"


class AccountingScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_tokens_computed: OrderedDict[str, int] = OrderedDict()
        self.total_prompt_tokens_computed = 0
        self.computed_by_kind: Counter[str] = Counter()  # the same tokens, by what they were for (`work_kind`)
        self.kv_load_failed_requests = 0
        self.kv_load_failed_tokens = 0  # tokens whose KV did not arrive (recomputed, or the request failed)
        self._counted_failed: set[str] = set()  # (the connector reports a failed request's blocks too)

    def _handle_failed_recving(self, failed_req_ids: set[str]) -> set[str]:
        """Whole requests whose KV load failed (a transfer or handshake error reported by the connector)."""
        self._counted_failed = set()
        for req_id in failed_req_ids:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._counted_failed.add(req_id)
                self.kv_load_failed_requests += 1
                self.kv_load_failed_tokens += request.num_computed_tokens  # (super() resets it to recompute)
        return super()._handle_failed_recving(failed_req_ids)

    def _handle_invalid_blocks(self, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int]) -> set[str]:
        """Requests with some blocks that failed to load: super() cuts them back to their valid prefix."""
        holders: list[Request] = [*self.running, *self.kv_holding_waiting]
        before = {r.request_id: r.num_computed_tokens for r in holders}
        failed_before = set(self.failed_recving_kv_req_ids)
        skipped = super()._handle_invalid_blocks(invalid_block_ids, num_scheduled_tokens)
        affected = (skipped | (self.failed_recving_kv_req_ids - failed_before)) - self._counted_failed
        self._counted_failed = set()
        self.kv_load_failed_requests += len(affected)
        self.kv_load_failed_tokens += sum(
            max(0, before[r.request_id] - r.num_computed_tokens) for r in holders if r.request_id in affected
        )
        return skipped

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            before = request.num_computed_tokens  # not yet advanced: super() does that
            prompt = max(0, min(before + n, request.num_prompt_tokens) - before)
            if prompt:
                self.total_prompt_tokens_computed += prompt
                self.computed_by_kind[work_kind(req_id)] += prompt
                self.prompt_tokens_computed[req_id] = self.prompt_tokens_computed.get(req_id, 0) + prompt
                self.prompt_tokens_computed.move_to_end(req_id)
                if len(self.prompt_tokens_computed) > MAX_TRACKED_REQUESTS:
                    self.prompt_tokens_computed.popitem(last=False)
        super()._update_after_schedule(scheduler_output)

    def compute_stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        pool = self.kv_cache_manager.block_pool
        running, waiting = self.get_request_counts()
        stats: dict[str, Any] = {
            "prompt_tokens_computed_total": self.total_prompt_tokens_computed,
            "prompt_tokens_computed_by_kind": dict(self.computed_by_kind),
            "num_requests": len(self.requests),  # every request the scheduler still tracks
            "num_running": running,
            "num_waiting": waiting,
            "kv_blocks_total": pool.num_gpu_blocks - 1,  # minus the null block
            "kv_blocks_free": pool.get_num_free_blocks(),
            "block_size": self.block_size,
            "kv_load_failed_requests": self.kv_load_failed_requests,
            "kv_load_failed_tokens": self.kv_load_failed_tokens,
        }
        if request_id_prefix is not None:
            # vLLM appends a random suffix to the caller's id, and its serving layer a prefix.
            mine = [(rid, n) for rid, n in self.prompt_tokens_computed.items() if request_id_prefix in rid]
            stats["prompt_tokens_computed"] = sum(n for _, n in mine)
            by_kind: Counter[str] = Counter()
            for rid, n in mine:
                by_kind[work_kind(rid)] += n
            stats["prompt_tokens_computed_by_kind"] = dict(by_kind)
        return stats


def _rtpd_set_priority(self: EngineCore, request_key: str, priority: int) -> int:
    """Give the requests whose id contains `request_key` (vLLM's serving layer wraps the caller's id) a new
    priority (lower is served first; the engine runs `scheduling_policy: priority`): a preemptive answer a
    router adopted ranks as an ordinary one from then on. Returns how many were changed."""
    scheduler = self.scheduler
    mine = re.compile(rf"(^|-){re.escape(request_key)}(-|$)")  # (`-p1` is not `-p10`)
    changed = 0
    for rid, request in scheduler.requests.items():
        if not mine.search(rid) or request.priority == priority:
            continue
        # Waiting queues are heaps under the priority policy: taken out and put back at its new place.
        queues = [q for q in (scheduler.waiting, scheduler.kv_holding_waiting) if request in q]
        for queue in queues:
            queue.remove_request(request)
        request.priority = priority
        for queue in queues:
            queue.add_request(request)
        changed += 1
    return changed


def _rtpd_compute_stats(self: EngineCore, request_id_prefix: str | None = None) -> dict[str, Any]:
    scheduler = self.scheduler
    if not isinstance(scheduler, AccountingScheduler):
        return {}
    return scheduler.compute_stats(request_id_prefix)


# EngineCore dispatches utility calls by attribute name; this module is imported in the engine-core
# process when vLLM resolves `scheduler_cls`, so the method exists exactly where it is called.
EngineCore.rtpd_compute_stats = _rtpd_compute_stats  # type: ignore[attr-defined]
EngineCore.rtpd_set_priority = _rtpd_set_priority  # type: ignore[attr-defined]
