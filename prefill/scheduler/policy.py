"""Who is prefilled first, and who gives blocks back first: the Stream2LLM ranking policies.

A policy ranks requests by a sort key (lower = served first). Eviction walks the other way: idle sessions
(waiting for their next chunk, nothing to compute) go first, then holders with work, lowest-ranked first;
a request that was planned for this step is never a victim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from core.scheduler_config import Policy


@dataclass(frozen=True)
class RankView:
    """What a policy sees of one engine request."""

    complete: bool  # its input is whole (an ordinary request or a session's hand-off), not a partial stream
    arrival: float  # when its session (or the request itself) arrived
    last_chunk: float  # when its latest input arrived
    computed: int  # tokens whose KV its session holds
    has_work: bool  # tokens left to prefill now
    order: int  # its position in the engine's own queues (the `vllm` policy)
    preemptive: bool = False  # a preemptive answer's hand-off (prefill/preemptive.py): below all other work


RankKey = tuple[float, ...]


def _fcfs(v: RankView) -> RankKey:
    return (0 if v.complete else 1, v.arrival if v.has_work else math.inf, v.order)


def _lcas(v: RankView) -> RankKey:
    return (0 if v.complete else 1, v.last_chunk if v.has_work else math.inf, v.order)


def _mcps(v: RankView) -> RankKey:
    return (0 if v.has_work else 1, -v.computed, v.arrival, v.order)


def _vllm(v: RankView) -> RankKey:
    return (v.order,)


RANKERS: dict[str, Callable[[RankView], RankKey]] = {"fcfs": _fcfs, "lcas": _lcas, "mcps": _mcps, "vllm": _vllm}


def rank_key(policy: Policy) -> Callable[[RankView], RankKey]:
    """The policy's key, below all of it a preemptive answer's hand-off (work the user may never need)."""
    ranker = RANKERS[policy]
    return lambda v: (1 if v.preemptive else 0, *ranker(v))


def victim_key(policy: Policy, idle: bool, view: RankView) -> tuple[object, ...]:
    """Sort key for eviction (lower = evicted first)."""
    if view.preemptive:
        return (-1, -view.arrival)  # a preemptive answer's hand-off gives its blocks before anyone
    if policy == "vllm":
        return (-view.arrival,)  # the engine's own choice: the latest arrival goes first (LIFO)
    # An idle session is ranked as if its next chunk had come (not all alike): the one the policy would serve
    # last gives its blocks first (FCFS: the newest session; MCPS: the least computed).
    inverted = tuple(-x for x in RANKERS[policy](replace(view, has_work=True)))
    return (0 if idle else 1, *inverted)
