"""Decode engines order requests by (priority, arrival) (engine/llm.py): a preemptive answer runs at priority 1
until a router adopts it, and `rtpd_set_priority` (engine/scheduler.py) then ranks it as an ordinary answer,
also while it waits in the engine's priority queue. On the real scheduler and KV cache manager (harness.py)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.scheduler import _rtpd_set_priority
from tests.unit.prefill.scheduler.harness import Harness


def test_an_adopted_answer_is_served_as_an_ordinary_one(make) -> None:
    h: Harness = make(policy="vllm", num_blocks=64, budget=64, scheduler={"policy": "priority"})
    h.add("preemptive-1", 64, resumable=False, priority=1)  # came first, at the lowest priority
    h.add("ordinary", 64, resumable=False)
    h.add("preemptive-2", 64, resumable=False, priority=1)
    core = SimpleNamespace(scheduler=h.sched)
    assert _rtpd_set_priority(core, "preemptive-2", 0) == 1  # adopted: it is an answer now
    order = [rid for step in h.run() for rid in step]
    assert order == ["ordinary", "preemptive-2", "preemptive-1"], order
    assert _rtpd_set_priority(core, "gone", 0) == 0
