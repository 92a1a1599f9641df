"""Settings of the prefill replicas' streaming scheduler (`prefill.scheduler` in the app config).

They reach the engine-core process through vLLM's `additional_config` (key `rtpd_scheduler`), the config
field vLLM keeps for plug-ins, and can be changed on a running replica (`PrefillServer.configure_scheduler`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Policy = Literal["fcfs", "lcas", "mcps", "vllm"]
Eviction = Literal["recompute", "swap", "cost"]
ADDITIONAL_CONFIG_KEY = "rtpd_scheduler"


class SchedulerSettings(BaseModel):
    """The streaming scheduler inside each prefill engine (prefill/scheduler/): who is prefilled first, who gives
    KV blocks back when open sessions outgrow the cache, and how (docs/streaming.md)."""

    model_config = ConfigDict(extra="forbid")

    # Admission order (Stream2LLM): fcfs = complete inputs first, then partial ones, each by arrival;
    # lcas = by the arrival of the latest chunk; mcps = most computed tokens first; vllm = the engine's
    # own order and victims (the baseline).
    policy: Policy = "fcfs"
    # How an evicted holder gives its blocks back: recompute (free; full blocks stay in the prefix cache
    # while nothing overwrites them), swap (copy to a bounded host pool and back), or cost (the cheaper
    # of the two per eviction, from latency models profiled on this machine).
    eviction: Eviction = "cost"  # bench/pressure.py: the best or near it everywhere, and it adapts to the machine
    # Host memory for swapped-out KV blocks (GiB). On a CPU platform this is a second DRAM pool.
    swap_gb: float = Field(default=0.5, ge=0)
    # A saved latency model (`python -m prefill.scheduler.profile`); with `cost` and none given, the
    # replica profiles itself at start-up.
    cost_model: str | None = None
    profile_on_start: bool = False  # profile afresh at start-up even with a saved profile (and refresh it)
    # How long a prefill (a whole prompt, a session's pending chunks, a hand-off) may take, queueing for KV
    # memory included, before it is aborted and the client gets 429 with Retry-After: no wait is unbounded.
    admission_timeout_s: float = Field(default=60.0, gt=0)
    # Requests queued in the engine beyond this are refused at once (429).
    max_queued_requests: int = Field(default=512, ge=1)
    retry_after_s: int = Field(default=1, ge=0)  # Retry-After (seconds) of this replica's 429s
    # Open sessions per replica. vLLM counts a session waiting for its next chunk against `max_num_seqs`
    # even when its KV is evicted, so sessions must leave slots for hand-offs and plain requests: at most
    # three quarters of the engine's slots (and this, if lower). Past it new sessions get 429.
    max_open_sessions: int | None = Field(default=None, ge=1)
    # Residency control: prefilling while input streams is a privilege of the sessions whose KV fits in this
    # fraction of the prefill KV cache (the rest is kept for hand-offs and whole prompts). A session that does
    # not fit buffers its input, as `on_end_only` does, and starts streaming at a later chunk once room frees;
    # so sessions wait instead of evicting each other. 1.0: every session streams (eviction sorts it out).
    streaming_kv_fraction: float = Field(default=0.75, gt=0, le=1)
    # Partial input is speculative: while complete work (a hand-off, a whole prompt, a session whose input
    # ended) has tokens to compute, partial input sits the step out, so a step is never made longer by it
    # (on one core a step's time follows its tokens). Off: partial input fills what complete work leaves.
    partial_yields: bool = True
    # The most input tokens a session streams to the engine at once: a step of partial input stays short, so
    # complete work arriving meanwhile waits little, and a rewrite wastes at most one chunk in flight.
    partial_chunk_tokens: int = Field(default=512, ge=16)
    # Preemptive answers (prefill/preemptive.py) in progress at once on this replica; past it (or while the
    # engine has work queued, except a spoken pause's) a session's preemptive answer is skipped, never queued. 0: none.
    max_preemptive_in_flight: int = Field(default=4, ge=0)

    def session_capacity(self, max_num_seqs: int) -> int:
        # An idle session holds a slot while its hand-off needs another: one slot serves no session.
        cap = max_num_seqs - max(1, max_num_seqs // 4) if max_num_seqs >= 2 else 0
        return min(cap, self.max_open_sessions) if self.max_open_sessions else cap
