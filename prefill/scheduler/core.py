"""The prefill engine's streaming scheduler: vLLM's scheduler with Stream2LLM's two phases in front of it.

vLLM keeps a streaming-input session's blocks while it waits for its next chunk and never preempts it
(only running requests are preempted); a waiting request whose allocation fails blocks everything queued
behind it. With more open sessions than the cache holds, nothing is ever served again. Before each vLLM
step this scheduler:

1. ranks every unfinished request by the policy (policy.py) and orders vLLM's queues by that rank;
2. plans: walks the ranking and takes what fits the token budget and the block capacity;
3. evicts, lowest-ranked first and never a planned request, until the planned requests' new blocks are
   free: idle sessions first (they hold blocks and have nothing to compute), then unplanned holders.
   An eviction recomputes (frees the blocks; full blocks stay in the prefix cache until overwritten) or
   swaps (copies the blocks to a bounded host pool first; swap.py), or picks the cheaper (cost_model.py);
4. swaps planned requests back in: prefix-cache hits first (free), host copies for the rest.

vLLM then schedules as usual. Evicted sessions resume transparently: their tokens are untouched, so the
KV they get back, by copy or by recompute, is the KV they had.

Also here: longest-common-prefix invalidation for rewritten input (`invalidate`), and the counters that
metrics and the session API report. Configured with `scheduler_cls="prefill.scheduler.core.StreamingScheduler"`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

from core.scheduler_config import ADDITIONAL_CONFIG_KEY, SchedulerSettings
from engine.scheduler import AccountingScheduler
from prefill.scheduler import engine_calls  # noqa: F401  (registers the rtpd_* utility calls)
from prefill.scheduler.cache_hits import extend_from_cache, share_partial_block
from prefill.scheduler.cost_model import LatencyModel
from prefill.scheduler.invalidate import truncate
from prefill.scheduler.policy import RankView, rank_key, victim_key
from prefill.scheduler.swap import HostSlots

logger = logging.getLogger(__name__)

IDLE = RequestStatus.WAITING_FOR_STREAMING_REQ
ACTIVE = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED)
# SamplingParams.extra_args set by the prefill server: the session, its arrival, and a preemptive answer's mark.
SESSION_ARG, ARRIVAL_ARG, PREEMPTIVE_ARG = "rtpd_session", "rtpd_arrival", "rtpd_preemptive"
MAX_TRACKED_SESSIONS = 20_000


class Cut(NamedTuple):
    """What `invalidate` did: the tokens the session's request kept, and the chunks in flight it ended."""

    kept: int
    ended_chunks: int  # chunks in flight (the one being prefilled, and any queued behind it), ended without output


@dataclass
class Evicted:
    kind: str  # "recompute" | "swap"
    tokens: int  # tokens whose KV the request had
    slots: list[int] = field(default_factory=list)  # host slots of its blocks 0..n (swap)
    idle: bool = False  # evicted while waiting for its next chunk (its token counts are left as they were)


@dataclass
class SessionTrack:
    arrival: float
    last_chunk: float
    stats: Counter[str] = field(default_factory=Counter)
    input_ended: bool = False  # its input is whole: its pending prefill is complete work until its hand-off ends


class StreamingScheduler(AccountingScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        settings = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
        self.settings = SchedulerSettings.model_validate(settings or {})
        self.executor: Any = None  # attached after start-up (rtpd_attach): swap needs the workers
        self.host = HostSlots(0)
        self.latency: LatencyModel | None = None
        self.evicted: dict[str, Evicted] = {}
        self._planned_now = 0
        self._evicting = False  # (this scheduler's own eviction preempts through vLLM's method)
        self._yielding: set[str] = set()  # partial requests sitting this step out for complete work
        self._stalled_last = False  # the last step had planned work and ran nothing
        self.sessions: OrderedDict[str, SessionTrack] = OrderedDict()
        self.req_session: dict[str, str] = {}
        self.preemptive: set[str] = set()  # preemptive answers' hand-offs: ranked below all other work
        self.counters: Counter[str] = Counter()
        config = self.kv_cache_config
        self.block_bytes = sum(t.size for t in config.kv_cache_tensors) // max(config.num_blocks, 1)
        # Swap and truncation edit one block table: models with one KV cache group (no hybrid/sliding
        # window mixes), and synchronous steps (nothing in flight while blocks are copied).
        self._single_group = len(config.kv_cache_groups) == 1
        self._swap_ok = (
            self._single_group
            and not self.vllm_config.scheduler_config.async_scheduling
            and self.vllm_config.parallel_config.pipeline_parallel_size == 1
        )

    # --- configuration ------------------------------------------------------------------------------
    def attach(self, executor: Any) -> dict[str, Any]:
        """Give the scheduler the workers (for swap) and size the host pool."""
        self.executor = executor
        if not self._swap_ok and self.settings.eviction != "recompute":
            logger.warning(
                "streaming scheduler: eviction %r cannot swap here (async scheduling %s, pipeline stages %d, "
                "one KV cache group %s): every eviction recomputes",
                self.settings.eviction,
                self.vllm_config.scheduler_config.async_scheduling,
                self.vllm_config.parallel_config.pipeline_parallel_size,
                self._single_group,
            )
        slots = int(self.settings.swap_gb * 2**30 // max(self.block_bytes, 1)) if self._swap_ok else 0
        if slots and not self.host.num_slots:
            executor.collective_rpc("rtpd_swap_init", args=(slots,))
            self.host = HostSlots(slots)
        logger.info("streaming scheduler: %s, %d host slots", self.settings, self.host.num_slots)
        return {"host_slots": self.host.num_slots, "block_bytes": self.block_bytes}

    def configure(self, changes: dict[str, Any]) -> dict[str, Any]:
        self.settings = SchedulerSettings.model_validate({**self.settings.model_dump(), **changes})
        return self.settings.model_dump()

    # --- the two phases ----------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._forget_gone()
        self._planned_now = 0
        self._yielding = set()
        held_back: list[Request] = []
        if any(r.status in ACTIVE for r in self.requests.values()):
            held_back = self._plan_and_evict()
        # Held-back requests keep their engine slots. (Idle sessions keep theirs too, in vLLM's accounting
        # and in its model runner's state; the prefill server caps open sessions below max_num_seqs.)
        slots = self.max_num_active_reqs
        self.max_num_active_reqs -= len(held_back)
        # A swapped-out request waits for its swap-in: vLLM would otherwise recompute what the host holds.
        parked = [
            r
            for r in self.waiting
            if (self._swapped_tokens(r) and not r.num_computed_tokens) or r.request_id in self._yielding
        ]
        parked_kv = [r for r in self.kv_holding_waiting if self._swapped_tokens(r) and not r.num_computed_tokens]
        if parked:
            self.waiting.remove_requests(parked)
        if parked_kv:
            self.kv_holding_waiting.remove_requests(parked_kv)
        try:
            out = super().schedule(throttle_prefills)
            self._stalled_last = bool(self._planned_now and not out.num_scheduled_tokens)
            if self._stalled_last:  # planned work, nothing ran: a stall
                self.counters["stalled_steps"] += 1
            return out
        finally:
            self.max_num_active_reqs = slots
            # Running requests left out of the plan sat this step out (vLLM schedules `running` before
            # anything waiting, whatever the rank): they rejoin at the back, as the lowest-ranked.
            self.running.extend(r for r in held_back if r.status == RequestStatus.RUNNING)
            self.waiting.prepend_requests(reversed(parked))
            self.kv_holding_waiting.prepend_requests(reversed(parked_kv))

    def _plan_and_evict(self) -> list[Request]:
        """Phases 1 and 2; returns the running requests held back from this step."""
        policy = self.settings.policy
        views = self._views()
        key = rank_key(policy)
        live = [r for r in self.requests.values() if not r.is_finished() and r.request_id in views]
        active = sorted((r for r in live if r.status in ACTIVE), key=lambda r: key(views[r.request_id]))
        # A hand-off not started yet takes its session's host copy, swapped out since the hand-off came.
        for r in active if self.evicted else ():  # (nothing is swapped out: nothing to take, no scan per step)
            fresh = not r.resumable and not r.num_computed_tokens and r.request_id not in self.evicted
            if fresh and r.request_id not in self.preemptive:  # (a preemptive one may be discarded: not its KV)
                self._take_swapped_prefix(r)

        # Partial input left without room (it may not preempt a running prefill) sits the step out and the step is
        # planned again without it: vLLM would otherwise preempt a running request for it (or, for a waiting one,
        # stop admitting at it), losing the prefill's progress.
        excluded: set[str] = set()
        while True:
            planned = self._plan(active, live, views, excluded)
            starved = self._evict_for(planned, active, live, views)
            if starved is None or policy == "vllm" or views[starved.request_id].complete:
                break
            excluded.add(starved.request_id)
            self.counters["partial_without_room"] += 1
        self._planned_now = len(planned)
        for r, _ in planned:
            if r.request_id in self.evicted and self.evicted[r.request_id].kind == "swap":
                self._swap_in(r)
            elif policy != "vllm" and not r.resumable and r.status == RequestStatus.WAITING:
                self._share_partial_block(r)
        if self._yielding:
            self.counters["partial_yields"] += 1
        if policy == "vllm":
            return []
        self._yielding |= excluded
        planned_ids = {r.request_id for r, _ in planned}
        rest = [q for q in active if q.request_id not in planned_ids]
        self._order_queues({r.request_id: i for i, r in enumerate([*(r for r, _ in planned), *rest])})
        held_back = [r for r in self.running if r.request_id not in planned_ids]
        if held_back:
            self.running = [r for r in self.running if r.request_id in planned_ids]
        return held_back

    def _plan(
        self, active: list[Request], live: list[Request], views: dict[str, RankView], excluded: set[str]
    ) -> list[tuple[Request, int]]:
        """Phase 1: what fits the token budget and the blocks this scheduler can reassign, in rank order, with
        the new blocks each needs. Sets `_yielding` (partial input sitting this step out for complete work)."""
        policy = self.settings.policy
        holders = [r for r in live if r.status in ACTIVE or r.status == IDLE]
        held = {b for r in holders for b in self._block_ids(r)}
        capacity = self.kv_cache_manager.block_pool.get_num_free_blocks() + len(held)
        budget, used = self.max_num_scheduled_tokens, 0
        planned: list[tuple[Request, int]] = []
        for r in active:
            if r.request_id in excluded:
                continue
            computed = r.num_computed_tokens or self._swapped_tokens(r)
            todo = min(r.num_tokens_with_spec - computed, budget)
            if todo <= 0:
                continue
            end = computed + todo
            if self.scheduler_reserve_full_isl and r.status != RequestStatus.RUNNING:
                end = max(end, min(r.num_tokens, self.max_model_len))  # vLLM admits whole inputs only
            blocks = math.ceil(end / self.block_size)
            if used + blocks > capacity:
                if policy == "vllm":
                    break  # the engine's own queue: nothing passes a request that does not fit
                capacity -= len(self._block_ids(r))  # ranked above what follows: never their victim
                continue
            if (
                r.status == RequestStatus.RUNNING
                and todo < r.num_tokens_with_spec - computed
                and any(q.status != RequestStatus.RUNNING for q, _ in planned)
            ):
                continue  # vLLM serves running requests first, up to the whole budget: it would take more
            used += blocks
            budget -= todo
            planned.append((r, blocks - len(self._block_ids(r)) - self._hits_in_use(r)))
            self.counters["planned"] += 1
        yielding = (
            policy != "vllm"
            and self.settings.partial_yields
            and not self._stalled_last  # (liveness: a step that ran nothing is never followed by a yield)
            and any(views[r.request_id].complete for r, _ in planned)
        )
        self._yielding = set()
        if yielding:
            # Complete work this step: partial input waits (its tokens would only make the step longer).
            self._yielding = {r.request_id for r in active if not views[r.request_id].complete}
            planned = [(r, n) for r, n in planned if r.request_id not in self._yielding]
        return planned

    def _evict_for(
        self,
        planned: list[tuple[Request, int]],
        active: list[Request],
        live: list[Request],
        views: dict[str, RankView],
    ) -> Request | None:
        """Evict until each planned request's new blocks are free, walking the plan in rank order: a victim
        is unplanned and ranked below the request it makes room for. Idle sessions rank below everyone with
        work, except that an idle session whose own hand-off is planned ranks with that hand-off (its blocks
        are the hand-off's prefix). Returns the first planned request left without room (None: all have it)."""
        pool = self.kv_cache_manager.block_pool
        need = sum(n for _, n in planned)
        if need <= pool.get_num_free_blocks():
            return None
        policy = self.settings.policy
        position = {r.request_id: i for i, r in enumerate(active)}
        planned_ids = {r.request_id for r, _ in planned}
        hand_offs = {self.req_session.get(r.request_id): position[r.request_id] for r, _ in planned}
        bottom = len(active)
        candidates = []
        for r in live:
            if r.request_id in planned_ids or not self._block_ids(r):
                continue
            idle = r.status == IDLE
            if not idle and (r.status not in ACTIVE or (policy == "vllm" and r.status == RequestStatus.RUNNING)):
                continue  # the baseline preempts running requests as vLLM does (LIFO, in its own loop)
            rank = hand_offs.get(self.req_session.get(r.request_id), bottom) if idle else position[r.request_id]
            # An idle session whose input ended holds its hand-off's prefix: it goes after every other idle one.
            speculative = idle and not views[r.request_id].complete
            candidates.append((victim_key(policy, speculative, views[r.request_id]), rank, r))
        candidates.sort(key=lambda c: c[0])
        needed = 0
        for r, n in planned:
            needed += n
            rank = position[r.request_id]
            # Partial input is speculative: it never preempts a prefill that is running (waiting holders may
            # give their blocks back, or partial sessions would hold each other's room for good).
            partial = policy != "vllm" and not views[r.request_id].complete
            while pool.get_num_free_blocks() < needed:
                victim = next(
                    (c for c in candidates if c[1] > rank and not (partial and c[2].status == RequestStatus.RUNNING)),
                    None,
                )
                if victim is None:
                    return r  # nothing ranked below this request holds blocks: it and what follows wait
                candidates.remove(victim)
                self._evict(victim[2])
        return None

    # --- eviction and its undoing -------------------------------------------------------------------
    def _evict(self, r: Request) -> None:
        blocks = self._block_ids(r)
        tokens = r.num_computed_tokens
        n_copy = min(math.ceil(tokens / self.block_size), len(blocks))
        kind = self._eviction_kind(tokens, n_copy)
        slots = self.host.alloc(n_copy) if kind == "swap" else None
        if kind == "swap" and slots is None:
            kind = "recompute"
            self._count(r, "swap_fallbacks")
        if slots:
            took = self.executor.collective_rpc("rtpd_swap_out", args=(blocks[:n_copy], slots))[0]
            self._count(r, "swapped_out_blocks", n_copy)
            self._count(r, "swapped_out_bytes", n_copy * self.block_bytes)
            self.counters["swap_out_seconds_x1e6"] += int(took * 1e6)
        idle = r.status == IDLE
        self.evicted[r.request_id] = Evicted(kind, tokens, slots or [], idle)
        self._count(r, f"evictions_{kind}")
        self._count(r, "evictions_idle" if idle else "evictions_active")
        if r.status == RequestStatus.RUNNING:
            self.running.remove(r)
            self._evicting = True
            try:
                self._preempt_request(r, time.monotonic())
            finally:
                self._evicting = False
            self.waiting.remove_request(r)  # _preempt_request put it first: it goes behind the planned
            self.waiting.add_request(r)
        else:
            self._free_request_blocks(r)
            if not idle:  # a waiting session chunk: it resumes from the prefix cache
                r.num_computed_tokens = 0
        logger.debug("evicted %s (%s, %d tokens, %d blocks)", r.request_id, kind, tokens, len(blocks))

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        if not self._evicting:  # vLLM's own preemption (a running request's allocation failed), counted too
            self._count(request, "preemptions_engine")
            self._count(request, "preempted_tokens", request.num_computed_tokens)
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _eviction_kind(self, tokens: int, blocks: int) -> str:
        mode = self.settings.eviction
        if mode != "cost":
            return mode if (mode == "recompute" or self.host.num_slots) else "recompute"
        if self.latency is None or not self.host.num_slots:
            return "recompute"
        return "swap" if self.latency.prefer_swap(tokens, blocks) else "recompute"

    def _swap_in(self, r: Request) -> None:
        """Give a swapped-out request its KV back: prefix-cache hits for free, host copies for the rest."""
        ev = self.evicted[r.request_id]
        if r.num_computed_tokens or r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return
        target = min(ev.tokens, r.num_tokens - 1)  # at least one token is computed to sample from
        cached, hit, _ = self.kv_cache_manager.get_computed_blocks(r)
        if hit < target:
            new = self.kv_cache_manager.allocate_slots(
                r, target - hit, num_new_computed_tokens=hit, new_computed_blocks=cached
            )
            if new is None:
                return  # no room yet; the next step tries again
            blocks = self._block_ids(r)
            first, last = hit // self.block_size, math.ceil(target / self.block_size)
            took = self.executor.collective_rpc("rtpd_swap_in", args=(ev.slots[first:last], blocks[first:last]))[0]
            r.num_computed_tokens = target
            self._count(r, "swapped_in_blocks", last - first)
            self.counters["swap_in_seconds_x1e6"] += int(took * 1e6)
        self._count(r, "tokens_back_from_prefix_cache", min(hit, target))
        self.host.free(ev.slots)
        del self.evicted[r.request_id]

    def _share_partial_block(self, handoff: Request) -> None:
        """A session's hand-off starts from everything its session computed, the last partial block included."""
        if self.executor is None or not self._single_group or self.hash_block_size != self.block_size:
            return
        key = self.req_session.get(handoff.request_id)
        session = next(
            (
                q
                for rid, q in self.requests.items()
                if rid != handoff.request_id
                and self.req_session.get(rid) == key
                and q.resumable
                and q.status == IDLE
                and rid not in self.evicted
            ),
            None,
        )
        if session is not None:
            gained = share_partial_block(self.kv_cache_manager, self.executor, handoff, session)
            if gained:
                self._count(handoff, "partial_block_shared_tokens", gained)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        if (ev := self.evicted.pop(request.request_id, None)) is not None:
            self.host.free(ev.slots)  # a request that ends while swapped out gives its host slots back
        preemptive = request.request_id in self.preemptive
        if (
            not request.resumable
            and not preemptive
            and (track := self.sessions.get(self.req_session.get(request.request_id, "")))
        ):
            track.input_ended = False  # its hand-off is made: what the session streams next is a new turn's input
        return super()._free_request(request, delay_free_blocks)

    def input_ended(self, session_key: str) -> bool:
        """A session's input is whole (its hand-off follows): its streaming request ranks as complete work."""
        track = self.sessions.get(session_key)
        if track is None:
            return False
        track.input_ended = True
        self.counters["inputs_ended"] += 1
        return True

    def _update_request_as_session(self, session: Request, update: StreamingUpdate) -> None:
        super()._update_request_as_session(session, update)
        self._track(session, chunk=True)
        ev = self.evicted.get(session.request_id)
        if ev is not None and ev.idle:
            # Evicted while idle: the new chunk is appended to the tokens it had, and the KV comes back
            # through the waiting path (prefix cache, then recompute) or through swap-in.
            ev.idle = False
            session.num_computed_tokens = 0
        elif ev is None and self._single_group and self.hash_block_size == self.block_size:
            # What the prefix cache holds of the appended input is shared, not computed again.
            gained = extend_from_cache(self.kv_cache_manager, session)
            if gained:
                self._count(session, "append_cache_hit_tokens", gained)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.num_scheduled_tokens:
            ev = self.evicted.pop(req_id, None)
            if ev is None:
                continue
            r = self.requests[req_id]
            before = r.num_computed_tokens  # what the prefix cache gave back; vLLM advances it below
            self._count(r, "tokens_back_from_prefix_cache", min(before, ev.tokens))
            self._count(r, "recomputed_tokens", max(0, ev.tokens - before))
            if ev.slots:  # scheduled by vLLM before a swap-in could be made: recomputed instead
                self.host.free(ev.slots)
                self._count(r, "swap_fallbacks")
        super()._update_after_schedule(scheduler_output)

    # --- longest-common-prefix invalidation ----------------------------------------------------------
    def invalidate(self, session_key: str, keep: int) -> Cut | None:
        """A session's input was rewritten from token `keep` on: drop its KV after the common prefix, between
        two engine steps, whatever the state of the session's streaming request.

        A chunk in flight (waiting, running part-way through its prefill, preempted) is ended here, without
        output (`ended_chunks`, with any queued behind it): the request waits for its next chunk at the tokens
        it has KV for, at most `keep`; what of the chunk is still the session's input goes with the next chunk.
        Blocks wholly after `keep` are freed (and host slots, if swapped out); the block holding the
        divergence point is kept when the request owns it alone (its cached hash is dropped, since it will be
        rewritten), otherwise it is recomputed from its start. None if the session has no streaming request.
        """
        r = next(
            (
                q
                for rid, q in self.requests.items()
                if self.req_session.get(rid) == session_key and q.resumable and (q.status == IDLE or q.status in ACTIVE)
            ),
            None,
        )
        if r is None or not self._single_group or None in (r.streaming_queue or ()):
            return None  # (its input stream is ending: the request goes with it)
        ended = 0
        if r.status != IDLE:
            ended = 1 + len(r.streaming_queue or ())
            if r.streaming_queue:
                r.streaming_queue.clear()  # queued chunks are superseded too
            keep = self._end_chunk(r, keep)
        ev = self.evicted.get(r.request_id)
        before = r.num_computed_tokens
        keep, dropped = truncate(self.kv_cache_manager, self.hash_block_size, r, keep)
        if ev is not None:  # evicted while idle: its token count stays; its host copies are cut too
            n_keep = math.ceil(keep / self.block_size)
            self.host.free(ev.slots[n_keep:])
            ev.slots = ev.slots[:n_keep]
            ev.tokens = min(ev.tokens, keep)
            r.num_computed_tokens = keep
        self._count(r, "invalidated_tokens", max(0, before - keep))
        self._count(r, "invalidated_blocks", dropped)
        if ended:
            self._count(r, "chunks_cut_in_flight", ended)
        return Cut(keep, ended)

    def _end_chunk(self, r: Request, keep: int) -> int:
        """End `r`'s chunk in flight without output: it waits for its next chunk, as after a finished one.
        Returns how much of `keep` it can keep: what it has KV for (computed, or evicted and coming back)."""
        if r.status == RequestStatus.RUNNING:
            self.running.remove(r)  # (vLLM's runner drops it from its batch; resumed, it gets its blocks anew)
        else:
            for queue in (self.waiting, self.kv_holding_waiting):
                if r in queue:
                    queue.remove_request(r)
            self.deferred_waiting.discard(r)
        ev = self.evicted.get(r.request_id)
        if r.num_computed_tokens or not (ev is not None or r.num_prompt_tokens):
            keep = min(keep, r.num_computed_tokens)
        else:  # no KV on the device now: it comes back (prefix cache, host copies, recompute) with the next chunk
            keep = min(keep, ev.tokens if ev is not None else r.num_prompt_tokens)
            if ev is None:
                self.evicted[r.request_id] = ev = Evicted("recompute", keep)
            ev.idle = True
            r.num_computed_tokens = keep  # (an idle request's frontier: the next chunk appends after it)
        r.status = IDLE
        self.num_waiting_for_streaming_input += 1
        self._enqueue_waiting_request(r)
        return keep

    # --- bookkeeping --------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        existing = rid in self.requests
        super().add_request(request)
        if not existing:
            self._track(self.requests[request.request_id], chunk=False)
            self.counters["admissions"] += 1
            preemptive = request.request_id in self.preemptive
            if not request.resumable and not preemptive and (track := self.sessions.get(self.req_session[rid])):
                # A hand-off: its session's input is whole, and its session's blocks are the hand-off's prefix
                # (not an idle session's to give first: the hand-off may wait behind other complete work).
                track.input_ended = True

    def _take_swapped_prefix(self, handoff: Request) -> None:
        """A session's hand-off (a complete request over its whole input, not started yet) takes the host copy of
        its session's KV, swapped out while the session was idle: it is swapped in for the hand-off instead of
        recomputed (the session's own request then gets it back from the prefix cache). Only the common prefix
        is taken."""
        key = self.req_session.get(handoff.request_id)
        session = next(
            (
                q
                for rid, q in self.requests.items()
                if rid != handoff.request_id and self.req_session.get(rid) == key and q.resumable and q.status == IDLE
            ),
            None,
        )
        ev = self.evicted.get(session.request_id) if session is not None else None
        if session is None or ev is None or ev.kind != "swap" or not ev.slots:
            return
        mine, theirs = session.prompt_token_ids[: ev.tokens], handoff.prompt_token_ids
        keep = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs))
        )
        n_keep = math.ceil(keep / self.block_size)
        if not keep:
            return
        self.host.free(ev.slots[n_keep:])
        self.evicted[handoff.request_id] = Evicted("swap", keep, ev.slots[:n_keep])
        self.evicted[session.request_id] = Evicted("recompute", ev.tokens, [], idle=True)
        self._count(handoff, "swap_taken_by_handoff")

    def _track(self, r: Request, chunk: bool) -> None:
        args = (r.sampling_params.extra_args if r.sampling_params else None) or {}
        key = str(args.get(SESSION_ARG) or r.request_id)
        self.req_session[r.request_id] = key
        if args.get(PREEMPTIVE_ARG):
            self.preemptive.add(r.request_id)
        now = time.time()
        track = self.sessions.get(key)
        if track is None:
            try:
                arrival = float(args.get(ARRIVAL_ARG) or r.arrival_time)
            except (TypeError, ValueError):  # never let a malformed argument reach the engine loop
                arrival = r.arrival_time
            track = self.sessions[key] = SessionTrack(arrival, now)
            if len(self.sessions) > MAX_TRACKED_SESSIONS:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(key)
        if chunk or (not r.resumable and r.request_id not in self.preemptive):  # (no new input: its LCAS rank stays)
            track.last_chunk = now

    def _forget_gone(self) -> None:
        for req_id in [rid for rid in self.evicted if rid not in self.requests]:
            self.host.free(self.evicted.pop(req_id).slots)
        if len(self.req_session) > len(self.requests) + 1024:
            self.req_session = {rid: k for rid, k in self.req_session.items() if rid in self.requests}
        if self.preemptive:
            self.preemptive &= self.requests.keys()

    def _count(self, r: Request, name: str, n: int = 1) -> None:
        self.counters[name] += n
        if (key := self.req_session.get(r.request_id)) in self.sessions:
            self.sessions[key].stats[name] += n

    def _views(self) -> dict[str, RankView]:
        order = {r.request_id: i for i, r in enumerate([*self.running, *self.kv_holding_waiting, *self.waiting])}
        computed: Counter[str] = Counter()
        for rid, r in self.requests.items():
            key = self.req_session.get(rid, rid)
            # An evicted session still counts what it had (MCPS would otherwise drop it to the bottom: starved).
            had = self.evicted[rid].tokens if rid in self.evicted else 0
            computed[key] = max(computed[key], r.num_computed_tokens, had)
        views = {}
        for rid, r in self.requests.items():
            key = self.req_session.get(rid, rid)
            track = self.sessions.get(key)
            preemptive = rid in self.preemptive
            views[rid] = RankView(
                complete=not preemptive and (not r.resumable or bool(track and track.input_ended)),
                arrival=track.arrival if track else r.arrival_time,
                last_chunk=track.last_chunk if track else r.arrival_time,
                computed=computed[key],
                has_work=r.status in ACTIVE and r.num_tokens_with_spec > r.num_computed_tokens,
                order=order.get(rid, len(order)),
                preemptive=preemptive,
            )
        return views

    def _order_queues(self, rank: dict[str, int]) -> None:
        """vLLM's queues in the policy's order. Runnable waiting requests go to one queue so that vLLM
        admits them strictly by rank (it otherwise drains KV-holding requests first)."""
        last = len(rank)
        self.running.sort(key=lambda r: rank.get(r.request_id, last))
        movable = [r for r in self.kv_holding_waiting if r.status in ACTIVE or r.status == IDLE]
        if movable:
            self.kv_holding_waiting.remove_requests(movable)
        queued = [*movable, *self.waiting]
        self.waiting.clear()
        queued.sort(key=lambda r: rank.get(r.request_id, last))
        for r in queued:
            self.waiting.add_request(r)

    def _block_ids(self, r: Request) -> list[int]:
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        return [b.block_id for b in manager.req_to_blocks.get(r.request_id, ())]

    def _hits_in_use(self, r: Request) -> int:
        """Blocks a fresh waiting request will share with their current holders (no new allocation)."""
        if r.num_computed_tokens or r.status == RequestStatus.RUNNING:
            return 0
        cached, _, _ = self.kv_cache_manager.get_computed_blocks(r)
        return sum(b.ref_cnt > 0 for b in cached.blocks[0])

    def _swapped_tokens(self, r: Request) -> int:
        ev = self.evicted.get(r.request_id)
        return min(ev.tokens, r.num_tokens - 1) if ev is not None and ev.kind == "swap" else 0

    # --- what the frontend reads --------------------------------------------------------------------
    def compute_stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        stats = super().compute_stats(request_id_prefix)
        live = [r for r in self.requests.values() if not r.is_finished()]
        stats["scheduler"] = {
            **self.settings.model_dump(include={"policy", "eviction"}),
            **dict(self.counters),
            "queue_running": len(self.running),
            "queue_waiting": sum(r.status in ACTIVE and r.status != RequestStatus.RUNNING for r in live),
            "idle_sessions": sum(r.status == IDLE for r in live),
            # Which (a few): a leaked idle request is named where a test or an operator sees the count.
            "idle_session_ids": sorted(
                {self.req_session.get(r.request_id, r.request_id) for r in live if r.status == IDLE}
            )[:8],
            "evicted_now": len(self.evicted),
            "host_slots": self.host.num_slots,
            "host_slots_free": self.host.num_free,
            "block_bytes": self.block_bytes,
            **{f"computed_{kind}": n for kind, n in self.computed_by_kind.items()},
        }
        if request_id_prefix is not None and request_id_prefix in self.sessions:
            stats["session_scheduler"] = dict(self.sessions[request_id_prefix].stats)
        return stats
