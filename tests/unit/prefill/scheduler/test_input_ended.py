"""End of input on the real StreamingScheduler: a session whose input ended is complete work (ranked ahead of
partial input, its idle blocks given up last) until its hand-off ends; idle victims are ordered by the policy.
12 usable blocks of 16 tokens, a 64-token step budget (harness.py)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.prefill.scheduler.harness import IDLE, Harness


def first_scheduled(steps: list[dict[str, int]]) -> list[str]:
    order: list[str] = []
    for step in steps:
        order += [rid for rid in step if rid not in order]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "lcas"])
def test_a_session_whose_input_ended_is_prefilled_before_partial_input(make, policy: str) -> None:
    h = make(policy=policy, num_blocks=64, budget=64)
    h.add("a", 16, arrival=1.0)
    h.add("b", 16, arrival=2.0)
    h.run()
    h.add("a", 64)  # a's chunk comes first, and a is the older session: partial-input order serves it first
    h.add("b", 64)
    assert h.sched.input_ended("b")  # b's input is whole: its last chunk is what its hand-off waits for
    steps = h.run()
    assert first_scheduled(steps) == ["b", "a"], steps
    assert h.counters()["inputs_ended"] == 1


def test_the_hand_off_ends_the_sessions_complete_rank(make) -> None:
    h = make(policy="fcfs", num_blocks=64, budget=64)
    h.add("b", 16, arrival=2.0)
    h.run()
    h.sched.input_ended("b")
    assert h.sched._views()["b"].complete
    h.add("b-handoff", [*h.sched.requests["b"].prompt_token_ids, 5], resumable=False, session="b")
    h.run()  # the hand-off finished: what the session streams next is a new turn's partial input
    assert not h.sched._views()["b"].complete


def test_idle_victims_are_ordered_by_the_policy_not_by_queue_position(make) -> None:
    """FCFS serves the oldest session first, so the newest idle session gives its blocks first, whatever
    order the sessions reached the queues in."""
    h = make(policy="fcfs")
    for name, arrival in (("newest", 3.0), ("oldest", 1.0), ("middle", 2.0)):
        h.add(name, 48, arrival=arrival)
    h.run()
    h.add("oldest", 16)  # its latest chunk puts it last in the engine's queues
    h.run()
    assert all(h.status(n) == IDLE for n in ("newest", "oldest", "middle"))
    h.add("n", 64, resumable=False, arrival=10.0)  # 4 blocks, 2 free: one idle session is evicted
    assert "n" in h.step().num_scheduled_tokens
    assert h.blocks("newest") == [] and h.blocks("oldest") and h.blocks("middle")


def test_an_idle_session_whose_input_ended_is_evicted_after_every_other_idle_one(make) -> None:
    h: Harness = make(policy="fcfs")
    for name, arrival in (("s1", 1.0), ("s2", 2.0), ("s3", 3.0)):
        h.add(name, 48, arrival=arrival)
    h.run()
    h.sched.input_ended("s3")  # FCFS would evict s3 (the newest) first: its hand-off needs its blocks
    h.add("n", 64, resumable=False, arrival=10.0)
    assert "n" in h.step().num_scheduled_tokens
    assert h.blocks("s3") and h.blocks("s1")
    assert h.blocks("s2") == []


def test_an_evicted_session_keeps_its_computed_count_under_mcps(make) -> None:
    """MCPS serves the most computed first: a session evicted while idle still ranks by what it had (its KV comes
    back from the prefix cache or the host), not as a session with nothing computed, which would starve it."""
    h = make(policy="mcps")
    h.add("i", 48, arrival=1.0)
    h.add("w1", 48, arrival=2.0)
    h.add("w2", 48, arrival=3.0)
    h.run()
    h.add("w1", 16)
    h.add("w2", 16)
    h.add("n", 64, resumable=False, arrival=10.0)
    h.step()
    assert "i" in h.sched.evicted
    h.add("i", 16)  # its next chunk: vLLM's count restarts from 0 (the KV comes back when it is scheduled)
    assert h.sched.requests["i"].num_computed_tokens == 0
    assert h.sched._views()["i"].computed == 48


def test_partial_input_sits_out_a_step_with_complete_work(make) -> None:
    """On one core a step's time follows its tokens: a hand-off's step is not made longer by partial input
    filling the rest of the budget. Partial input runs in the steps complete work leaves."""
    h = make(policy="fcfs", num_blocks=64, budget=256)
    h.add("p", 16, arrival=1.0)
    h.run()
    h.add("p", 160)  # partial input with work
    h.add("n", 32, resumable=False, arrival=5.0)  # a hand-off
    assert h.step().num_scheduled_tokens == {"n": 32}
    assert h.step().num_scheduled_tokens == {"p": 160}
    assert h.counters()["partial_yields"] == 1
    h.sched.configure({"partial_yields": False})
    h.add("p", 64)
    h.add("n2", 32, resumable=False, arrival=6.0)
    assert h.step().num_scheduled_tokens == {"n2": 32, "p": 64}


def test_a_session_whose_hand_off_waits_keeps_its_blocks_under_lcas(make) -> None:
    """LCAS gives the blocks of the idle session with the latest chunk first. A hand-off is its session's latest
    input, but its session's blocks are the hand-off's prefix: evicting them while the hand-off waits behind other
    complete work made the hand-off compute the whole input again (seen in the pressure bench: one query's
    hand-off computed 3,244 of its 3,372 tokens, all of them streamed before)."""
    h: Harness = make(policy="lcas")
    names = ("s1", "s2", "s3")
    for name in names:
        h.add(name, 48)
    h.run()
    h.add("n", 64, resumable=False)  # complete, and ahead of the hand-off: it takes the step's whole budget
    s1 = h.sched.requests["s1"].prompt_token_ids
    h.add("s1-h1", [*s1, *h.tokens(16)], resumable=False, session="s1")
    out = h.step()
    assert out.num_scheduled_tokens == {"n": 64}  # 4 blocks, 3 free: one idle session gives its blocks
    assert h.blocks("s1") and h.blocks("s2") and h.blocks("s3") == []  # s3 had the latest chunk, s1 aside
    steps = h.run()
    assert sum(step.get("s1-h1", 0) for step in steps) == 16  # only what the session never computed


def test_a_hand_off_takes_the_kv_its_session_had_swapped_out_after_it_came(make) -> None:
    """The session was swapped out while its hand-off waited (it was the only holder left to give blocks): the
    hand-off takes the host copy when it is planned, not only when it arrives. (LCAS: n, whose input came first,
    is served before the hand-off.)"""
    h: Harness = make(policy="lcas", eviction="swap", swap_slots=8)
    h.add("s", 48)
    h.run()
    snapshot = h.block_contents(h.blocks("s"))
    h.add("n", 160, resumable=False)  # 10 blocks of the 12: s gives its 3 (swapped out), the hand-off waits
    s = h.sched.requests["s"].prompt_token_ids
    h.add("s-t0-h1", [*s, *h.tokens(16)], resumable=False, session="s")
    out = h.step()
    assert "s-t0-h1" not in out.num_scheduled_tokens and h.sched.evicted["s"].kind == "swap"
    h.scribble(h.blocks("n"))  # those of s's old blocks n took are overwritten
    for _ in range(20):
        out = h.step()
        if "s-t0-h1" in out.num_scheduled_tokens:
            break
    assert out.num_scheduled_tokens["s-t0-h1"] == 16  # only what the session never computed
    new = next(r for r in out.scheduled_new_reqs if r.req_id == "s-t0-h1")
    got = h.block_contents(list(new.block_ids[0][:3]))
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot, strict=True))
    c = h.counters()
    assert c["swap_taken_by_handoff"] == 1 and c["swapped_in_blocks"] >= 1
    assert c["swapped_in_blocks"] + c.get("tokens_back_from_prefix_cache", 0) // 16 == 3


def test_partial_input_without_room_sits_out_instead_of_preempting_a_prefill(make) -> None:
    """MCPS ranks a session with more computed above a hand-off in progress. The session's chunk needs blocks only
    the running hand-off holds, and partial input never preempts a running prefill: it sits the step out and the
    hand-off runs. (Left planned, vLLM's own loop preempted a running request for it, losing its progress: seen
    in the pressure bench as a hand-off computing 2,048 of its tokens twice.)"""
    h: Harness = make(policy="mcps", num_blocks=13, budget=64)
    h.add("x", 96)
    h.run()  # x idle with 6 blocks, 96 computed
    h.add("hand-off", 96, resumable=False)
    assert h.step().num_scheduled_tokens == {"hand-off": 64}  # its 6 blocks: the cache is full
    h.add("x", 64)  # x (96 computed) ranks above the hand-off (64): its chunk needs 4 blocks, none is free
    steps = h.run()
    assert steps[0] == {"hand-off": 32}, steps
    assert sum(step.get("x", 0) for step in steps) == 64  # x computed only its new chunk, after the hand-off
    c = h.counters()
    assert "preemptions_engine" not in c and c["partial_without_room"] >= 1


@pytest.mark.parametrize("policy", ["fcfs", "lcas", "mcps"])
def test_a_preemptive_hand_off_runs_below_all_other_work_and_gives_its_blocks_first(make, policy: str) -> None:
    """A preemptive answer (prefill/preemptive.py) is work the user may never need: partial input goes before it,
    it never makes partial input yield, its blocks are the first taken, and its session's input has not ended."""
    h: Harness = make(policy=policy, num_blocks=13, budget=64)
    h.add("s", 32)
    h.run()
    s = h.sched.requests["s"].prompt_token_ids
    h.add("s-t0-p1", [*s, *h.tokens(32)], resumable=False, session="s", preemptive=True)
    h.add("other", 48)  # another session's partial input, newer
    steps = h.run()
    assert steps[0]["other"] == 48 and steps[0].get("s-t0-p1", 0) <= 16, steps  # the hand-off takes what is left
    assert not h.sched._views()["s"].complete  # the session's input is not over
    assert h.counters()["computed_preemptive"] == 32
