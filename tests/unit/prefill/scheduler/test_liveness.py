"""Liveness under KV pressure: a seeded simulation of the prefill server's traffic against the real scheduler.

Sessions stream chunks into resumable requests at random moments, some rewrite their input (LCP
invalidation), and at end of input each hands off with a complete request over its whole prompt while its
streaming request stays idle, as prefill/server.py does; plain requests arrive in between. Together they
need several times the cache. Under every policy and eviction mode every hand-off and plain request must
finish within a bounded number of steps, and at the end no block is held.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from tests.unit.prefill.scheduler.harness import Harness

COMBOS = [(p, e) for p in ("fcfs", "lcas", "mcps") for e in ("recompute", "swap", "cost")] + [("vllm", "recompute")]


class _Latency:
    """A latency model that makes `cost` pick both kinds: swap for small victims, recompute for large."""

    def prefer_swap(self, tokens: int, blocks: int) -> bool:
        return blocks <= 3


def simulate(h: Harness, seed: int, sessions: int = 12, max_steps: int = 3000) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts: dict[str, list[int]] = {}
    chunks_left = {f"s{i}": rng.randint(3, 6) for i in range(sessions)}
    started: set[str] = set()
    handed_off: dict[str, str] = {}
    finished: set[str] = set()
    plain: list[str] = []
    rewrites = cuts_in_flight = 0
    peak_blocks = 0  # the blocks the open sessions' inputs needed at once
    for step in range(max_steps):
        for sid in list(chunks_left):
            request = h.sched.requests.get(sid)
            if sid in started and request is None:
                continue
            if rng.random() < 0.3:
                if request is not None and rng.random() < 0.1 and len(prompts[sid]) > 20:
                    # update mode: a rewrite, whatever the request's state (idle, queued, part-way through its
                    # prefill, evicted): cut between two steps
                    keep = rng.randint(1, len(prompts[sid]) - 1)
                    cut = h.sched.invalidate(sid, keep)
                    assert cut is not None and cut.kept <= keep
                    assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
                    assert request.num_tokens == cut.kept
                    prompts[sid] = prompts[sid][: cut.kept]
                    rewrites += 1
                    cuts_in_flight += cut.ended_chunks
                idle = request is not None and request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
                if idle and chunks_left[sid] == 0:  # end of input: the hand-off over the whole prompt
                    hid = f"h{sid}"
                    h.add(hid, list(prompts[sid]), resumable=False, session=sid)
                    handed_off[sid] = hid
                    del chunks_left[sid]
                    continue
                if chunks_left[sid] > 0:  # chunks also arrive mid-prefill: vLLM queues them on the request
                    new = h.tokens(rng.randint(16, 40))
                    prompts.setdefault(sid, []).extend(new)
                    h.add(sid, new, session=sid)
                    started.add(sid)
                    chunks_left[sid] -= 1
        if step % 25 == 5:
            pid = f"p{step}"
            h.add(pid, rng.randint(10, 60), resumable=False)
            plain.append(pid)
        h.step()
        live = [sid for sid in prompts if sid not in finished]
        peak_blocks = max(peak_blocks, sum(-(-len(prompts[sid]) // 16) for sid in live))
        for sid, hid in list(handed_off.items()):
            if hid not in h.sched.requests:  # the answer went to decode: the session ends
                h.sched.finish_requests(sid, RequestStatus.FINISHED_ABORTED)
                finished.add(sid)
                del handed_off[sid]
        if len(finished) == sessions and all(p not in h.sched.requests for p in plain):
            return {
                "steps": step,
                "rewrites": rewrites,
                "cuts": cuts_in_flight,
                "peak_blocks": peak_blocks,
                **h.counters(),
            }
    stuck = {rid: (r.status.name, r.num_computed_tokens, r.num_tokens) for rid, r in h.sched.requests.items()}
    raise AssertionError(f"not done after {max_steps} steps ({len(finished)}/{sessions} sessions): {stuck}")


@pytest.mark.parametrize(("policy", "eviction"), COMBOS)
@pytest.mark.parametrize("seed", [1, 2, 3, 6])
@pytest.mark.parametrize("budget", [64, 2048])  # a budget of 2,048 once left swapped sessions' hand-offs stalled
def test_every_session_and_request_finishes_under_pressure(
    make: Any, policy: str, eviction: str, seed: int, budget: int
) -> None:
    h = make(
        policy=policy, eviction=eviction, num_blocks=41, budget=budget, swap_slots=24 if eviction != "recompute" else 0
    )
    if eviction == "cost":
        h.sched.latency = _Latency()
    result = simulate(h, seed)
    assert result["peak_blocks"] > 40, "the sessions did not fit the cache together"
    evicted = result.get("evictions_recompute", 0) + result.get("evictions_swap", 0)
    if eviction == "swap" and evicted:
        assert result.get("swapped_in_blocks", 0) > 0, result
    assert result.get("stalled_steps", 0) == 0, "a step with planned work ran nothing"
    assert h.free() == 40, "every block is back"
    assert h.sched.host.num_free == h.sched.host.num_slots, "every host slot is back"
