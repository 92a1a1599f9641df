"""The real StreamingScheduler over a real vLLM KV cache manager: admission order, eviction victims, idle
sessions, resumption by recompute, longest-common-prefix invalidation, and the engine's own limits.

Most tests use 12 usable blocks of 16 tokens and a 64-token step budget (see harness.py).
"""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus

from core.scheduler_config import SchedulerSettings
from tests.unit.prefill.scheduler.harness import IDLE, Harness

POLICIES = ["fcfs", "lcas", "mcps", "vllm"]


def first_scheduled(steps: list[dict[str, int]]) -> list[str]:
    order: list[str] = []
    for step in steps:
        order += [rid for rid in step if rid not in order]
    return order


# --- admission order -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # complete first, then partial ones by session arrival (a=1, b=2, d=3)
        ("fcfs", ["c", "a", "b", "d"]),
        # complete first, then by the arrival of their latest chunk: d's only chunk, then b's, then a's
        ("lcas", ["c", "d", "b", "a"]),
        # most computed first: b (48), a (16), then c and d (0) by arrival
        ("mcps", ["b", "a", "c", "d"]),
        # the engine's queues: KV-holding a and b, then d and c as they were added
        ("vllm", ["a", "b", "d", "c"]),
    ],
)
def test_admission_order(make, policy: str, expected: list[str]) -> None:
    h = make(policy=policy, num_blocks=64, budget=64)
    h.add("a", 16, arrival=1.0)
    h.add("b", 48, arrival=2.0)
    assert h.run() == [{"a": 16, "b": 48}]
    assert h.status("a") == h.status("b") == IDLE
    h.add("d", 64, arrival=3.0)  # a new partial stream
    h.add("c", 64, arrival=0.5, resumable=False)  # a complete input that claims the earliest arrival
    h.add("b", 64)  # b's next chunk arrives before a's
    h.add("a", 64)
    steps = h.run()
    # Every request needs the whole 64-token budget: one request a step, in the policy's order.
    assert all(len(step) == 1 and sum(step.values()) == 64 for step in steps), steps
    assert first_scheduled(steps) == expected
    assert h.counters()["admissions"] == 4


def test_configure_changes_the_policy_of_a_running_scheduler(make) -> None:
    h = make(policy="fcfs", num_blocks=64, budget=64)
    h.add("a", 16, arrival=1.0)
    h.add("b", 48, arrival=2.0)
    h.run()
    h.add("a", 64)
    h.add("b", 64)
    assert h.sched.configure({"policy": "mcps"})["policy"] == "mcps"
    assert first_scheduled(h.run()) == ["b", "a"]  # fcfs would serve a (earlier session) first
    with pytest.raises(ValueError):
        h.sched.configure({"policy": "nope"})
    assert h.sched.settings.policy == "mcps"


# --- eviction victims ------------------------------------------------------------------------------------


def open_sessions(h: Harness, names: list[str], tokens: int) -> None:
    for i, name in enumerate(names):
        h.add(name, tokens, arrival=1.0 + i)
    h.run()
    assert all(h.status(n) == IDLE for n in names)


def test_victim_is_the_lowest_ranked_holder(make) -> None:
    h = make(policy="fcfs")
    open_sessions(h, ["s1", "s2", "s3"], 48)  # 9 of 12 blocks held
    held = {s: h.blocks(s) for s in ("s1", "s2", "s3")}
    for s in ("s1", "s2", "s3"):
        h.add(s, 16)  # each has work now: 1 block more
    h.add("n", 64, resumable=False, arrival=10.0)  # complete: ranked first, needs 4 blocks, 3 are free
    out = h.step()
    assert out.num_scheduled_tokens == {"n": 64}
    assert h.blocks("s1") == held["s1"] and h.blocks("s2") == held["s2"]
    assert h.blocks("s3") == []  # the latest session: fcfs ranks it last
    c = h.counters()
    assert c["evictions_recompute"] == 1 and c["evictions_active"] == 1 and "evictions_idle" not in c
    assert h.sched.compute_stats("s3")["session_scheduler"]["evictions_active"] == 1
    # Everyone finishes; s3 recomputed what it lost.
    h.run()
    assert all(h.status(s) == IDLE for s in ("s1", "s2", "s3"))
    assert all(h.sched.requests[s].num_computed_tokens == 64 for s in ("s1", "s2", "s3"))
    c = h.counters()
    assert c["recomputed_tokens"] + c["tokens_back_from_prefix_cache"] == 48


def test_victim_is_never_ranked_above_a_request_it_makes_room_for(make) -> None:
    """s1 ranks above s2 and s3 (fcfs: earlier session) but does not fit beside n this step; s2 and s3 do.
    Evicting s1 for them inverts the ranking: s1 should keep its blocks and wait."""
    h = make(policy="fcfs", budget=256)
    open_sessions(h, ["s1", "s2", "s3"], 32)  # 2 blocks each, 6 free
    h.add("s1", 80)  # 112 tokens: 7 blocks
    h.add("s2", 16)  # 48 tokens: 3 blocks
    h.add("s3", 16)
    h.add("n", 96, resumable=False, arrival=10.0)  # 6 blocks
    s1_blocks = h.blocks("s1")
    h.step()
    assert h.sched.sessions["s1"].stats["evictions_active"] == 0, "s1 (ranked 2nd) evicted for s2/s3 (3rd, 4th)"
    assert h.blocks("s1") == s1_blocks


# --- idle sessions ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_idle_sessions_are_evicted_before_holders_with_work(make, policy: str) -> None:
    h = make(policy=policy)
    h.add("i", 48, arrival=1.0)  # will be idle
    h.add("w1", 48, arrival=2.0)
    h.add("w2", 48, arrival=3.0)
    h.run()
    assert h.free() == 3
    h.add("w1", 16)  # w1 and w2 have work: the lowest-ranked holders for fcfs and lcas
    h.add("w2", 16)
    h.add("n", 64, resumable=False, arrival=10.0)
    w1, w2 = h.blocks("w1"), h.blocks("w2")
    out = h.step()
    assert "n" in out.num_scheduled_tokens  # admitted in the step that made room: no wedge
    assert h.blocks("i") == [] and h.status("i") == IDLE
    assert h.blocks("w1")[:3] == w1 and h.blocks("w2")[:3] == w2
    c = h.counters()
    assert c["evictions_idle"] == 1 and "evictions_active" not in c
    assert c["evicted_now"] == 1


def evict_idle_session(h: Harness) -> tuple[list[int], list[int], SchedulerOutput]:
    """Idle session i (48 tokens, the earliest) is evicted for a complete request n while w1 and w2, which
    have work, keep their blocks. Returns i's tokens, its blocks before, and the step's output."""
    first = h.tokens(48)
    h.add("i", first, arrival=1.0)
    h.add("w1", 48, arrival=2.0)
    h.add("w2", 48, arrival=3.0)
    h.run()
    i_blocks = h.blocks("i")
    h.add("w1", 16)
    h.add("w2", 16)
    h.add("n", 64, resumable=False, arrival=10.0)
    out = h.step()
    assert out.num_scheduled_tokens == {"n": 64}
    assert h.blocks("i") == [] and h.sched.evicted["i"].idle
    return first, i_blocks, out


def test_evicted_idle_session_resumes_from_prefix_cache_and_recompute(make) -> None:
    h = make(policy="fcfs")
    first, i_blocks, out = evict_idle_session(h)
    # vLLM's free queue hands out the never-used blocks first, then i's from its tail: n took i's last block.
    assert i_blocks[-1] in out.scheduled_new_reqs[0].block_ids[0]
    assert not set(i_blocks[:2]) & set(out.scheduled_new_reqs[0].block_ids[0])

    second = h.tokens(16)
    r = h.add("i", second)
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
    out = h.step()
    # i ranks first (earliest session): 32 tokens come back from the prefix cache, the last 16 of its first
    # chunk and its 16 new ones are computed.
    assert out.num_scheduled_tokens["i"] == 32
    assert r.prompt_token_ids == first + second and r.num_computed_tokens == 64
    assert h.blocks("i")[:2] == i_blocks[:2]
    c = h.counters()
    assert c["tokens_back_from_prefix_cache"] == 32
    assert c["recomputed_tokens"] == 16
    assert c["evicted_now"] == 0
    assert h.sched.compute_stats("i")["session_scheduler"] == {
        "evictions_recompute": 1,
        "evictions_idle": 1,
        "tokens_back_from_prefix_cache": 32,
        "recomputed_tokens": 16,
    }
    h.run()
    assert h.status("i") == IDLE


def test_new_request_is_admitted_when_its_whole_prompt_needs_more_than_one_chunk_of_blocks(make) -> None:
    """vLLM admits a waiting request only if its whole input fits (scheduler_reserve_full_isl, on by
    default): a 128-token prompt needs 8 blocks even though this step computes 64 of its tokens. Idle
    sessions hold 9 of 12 blocks; evicting one (3 blocks) for the first chunk is not enough."""
    h = make(policy="fcfs")
    assert h.sched.scheduler_reserve_full_isl
    open_sessions(h, ["i0", "i1", "i2"], 48)
    h.add("n", 128, resumable=False, arrival=10.0)
    for _ in range(3):
        if "n" in h.step().num_scheduled_tokens:
            break
    assert h.status("n") != RequestStatus.WAITING, (
        f"wedged: n never admitted, {h.free()} blocks free, idle sessions hold "
        f"{sum(len(h.blocks(s)) for s in ('i0', 'i1', 'i2'))}"
    )


def test_open_sessions_are_capped_below_the_engine_slots(make) -> None:
    """vLLM counts idle sessions against max_num_seqs (num_waiting_for_streaming_input), evicted or not: as
    many idle sessions as slots would leave no slot for anything else. The prefill server therefore admits at
    most `session_capacity` open sessions; at that cap a new request is still admitted and served."""
    settings = SchedulerSettings()
    capacity = settings.session_capacity(max_num_seqs=4)
    assert 1 <= capacity < 4
    assert SchedulerSettings(max_open_sessions=2).session_capacity(4) == 2
    assert SchedulerSettings(max_open_sessions=100).session_capacity(4) == capacity  # never above the engine's
    h = make(policy="fcfs", num_blocks=64, max_num_seqs=4)
    open_sessions(h, [f"s{i}" for i in range(capacity)], 16)
    h.add("n", 16, resumable=False, arrival=10.0)
    h.run(max_steps=5)
    assert "n" not in h.sched.requests, f"n never admitted: {h.status('n')}, {h.free()} blocks free"


# --- running requests --------------------------------------------------------------------------------------


def test_running_victim_does_not_jump_ahead_of_the_request_it_was_evicted_for(make) -> None:
    h = make(policy="fcfs", num_blocks=11)  # 10 usable blocks
    h.add("L", 160, arrival=2.0)  # a partial stream, mid-prefill: 8 blocks after two steps
    h.step()
    h.step()
    assert h.status("L") == RequestStatus.RUNNING and len(h.blocks("L")) == 8
    h.add("n", 64, resumable=False, arrival=3.0)  # complete: ranked above L, needs 4 blocks, 2 are free
    out = h.step()
    assert h.counters()["evictions_active"] == 1
    assert out.num_scheduled_tokens == {"n": 64}, "the evicted L was re-admitted ahead of n"


def test_higher_ranked_waiting_requests_are_not_starved_by_a_running_prefill(make) -> None:
    h = make(policy="fcfs", num_blocks=40)
    h.add("a", 300, arrival=1.0)  # a partial stream, running a long prefill
    h.step()
    h.add("c", 16, resumable=False, arrival=3.0)  # complete inputs: fcfs ranks them above a
    h.add("d", 16, resumable=False, arrival=4.0)
    out = h.step()
    assert {"c", "d"} <= set(out.num_scheduled_tokens), f"c and d waited behind a: {out.num_scheduled_tokens}"


def test_held_back_running_requests_still_count_against_max_num_seqs(make) -> None:
    h = make(policy="fcfs", num_blocks=64, max_num_seqs=2, scheduler={"long_prefill_token_threshold": 32})
    h.add("a", 300, arrival=1.0)
    h.add("b", 300, arrival=2.0)
    assert h.step().num_scheduled_tokens == {"a": 32, "b": 32}  # both slots: two long prefills running
    h.add("c", 64, resumable=False, arrival=3.0)  # ranked above a and b, takes the whole budget: they sit out
    h.sched.schedule()
    running = [r.request_id for r in h.sched.running]
    assert len(running) <= h.sched.max_num_running_reqs, f"{running} in {h.sched.max_num_running_reqs} slots"


# --- longest-common-prefix invalidation ----------------------------------------------------------------------


def test_invalidate_keeps_the_common_prefix_blocks(make) -> None:
    h = make(policy="fcfs", budget=256)
    first = h.tokens(56)
    r = h.add("s", first, arrival=1.0)
    h.run()
    blocks = h.blocks("s")
    assert len(blocks) == 4 and r.num_computed_tokens == 56
    pool = h.sched.kv_cache_manager.block_pool
    edge = pool.blocks[blocks[1]]
    assert edge.block_hash is not None  # full block 16..31: in the prefix cache
    free = h.free()

    assert h.sched.invalidate("s", 20).kept == 20
    assert h.blocks("s") == blocks[:2]  # ceil(20 / 16): the edge block is owned alone, so it is kept
    assert h.free() == free + 2
    assert edge.block_hash is None  # it will be rewritten: no longer a prefix-cache entry
    assert r.prompt_token_ids == first[:20] and r.num_prompt_tokens == 20 and r.num_tokens == 20
    assert r.num_computed_tokens == 20 and len(r.block_hashes) == 1
    c = h.counters()
    assert c["invalidated_tokens"] == 36 and c["invalidated_blocks"] == 2

    # The rewritten input continues from token 20.
    second = h.tokens(30)
    h.add("s", second)
    assert h.run() == [{"s": 30}]
    assert r.prompt_token_ids == first[:20] + second and r.num_computed_tokens == 50
    assert h.blocks("s")[:2] == blocks[:2]
    # The prefix cache holds the new content, not the old.
    probe = h.request("probe", first[:20] + second + h.tokens(5), resumable=False)
    assert h.sched.kv_cache_manager.get_computed_blocks(probe)[1] == 48
    stale = h.request("stale", first[:40], resumable=False)
    assert h.sched.kv_cache_manager.get_computed_blocks(stale)[1] == 16


def test_invalidate_recomputes_a_shared_edge_block(make) -> None:
    h = make(policy="fcfs", budget=256)
    toks = h.tokens(56)
    a = h.add("a", toks, arrival=1.0)
    h.run()
    h.add("b", toks[:40], arrival=2.0)  # shares a's first two blocks through the prefix cache
    h.run()
    assert h.blocks("b")[:2] == h.blocks("a")[:2]
    shared = h.blocks("a")[1]
    free = h.free()

    assert h.sched.invalidate("a", 20).kept == 16  # the edge block is b's too: a restarts at its start
    assert h.blocks("a") == h.blocks("b")[:1]
    assert h.free() == free + 2  # a's blocks 3 and 4; block 2 is still b's
    assert h.sched.kv_cache_manager.block_pool.blocks[shared].block_hash is not None
    assert a.num_computed_tokens == 16 and a.prompt_token_ids == toks[:16]
    assert h.counters()["invalidated_tokens"] == 40


def test_invalidate_cuts_a_prefill_running_part_way_between_two_steps(make) -> None:
    """A rewrite does not wait for the chunk being prefilled: between two steps the request is cut to the common
    prefix, exactly the blocks past it freed, and it waits for its next chunk (the rest of the old chunk is
    never computed)."""
    h = make(policy="fcfs", budget=32)
    toks = h.tokens(64)
    r = h.add("s", toks, arrival=1.0)
    h.step()  # 32 of 64 computed: running, mid-prefill
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 32
    blocks, free = h.blocks("s"), h.free()
    cut = h.sched.invalidate("s", 10)
    assert cut.kept == 10 and cut.ended_chunks == 1
    assert r.status == IDLE and r not in h.sched.running
    assert h.blocks("s") == blocks[:1] and h.free() == free + len(blocks) - 1  # the edge block, owned, is kept
    assert r.prompt_token_ids == toks[:10] and r.num_computed_tokens == 10
    assert h.counters()["chunks_cut_in_flight"] == 1 and h.counters()["invalidated_tokens"] == 22
    assert h.run() == []  # nothing of the old chunk is computed
    new = h.tokens(30)
    h.add("s", new)
    assert h.run() == [{"s": 30}]
    assert r.prompt_token_ids == toks[:10] + new and r.num_computed_tokens == 40

    assert h.sched.invalidate("unknown", 10) is None
    h.add("one-shot", 16, resumable=False)
    assert h.sched.invalidate("one-shot", 0) is None


def test_invalidate_drops_a_queued_chunk_and_keeps_the_prefix(make) -> None:
    h = make(policy="fcfs", budget=256)
    toks = h.tokens(40)
    r = h.add("s", toks, arrival=1.0)
    h.run()
    h.add("s", h.tokens(24))  # queued: not scheduled yet
    assert r.status == RequestStatus.WAITING
    blocks, free = h.blocks("s"), h.free()
    cut = h.sched.invalidate("s", 30)
    assert cut == (30, 1) and r.status == IDLE and r.num_tokens == 30
    assert h.blocks("s") == blocks[:2] and h.free() == free + len(blocks) - 2
    assert h.run() == []
    h.add("s", h.tokens(5))
    assert h.run() == [{"s": 5}] and r.num_computed_tokens == 35


def test_invalidate_past_the_input_keeps_everything(make) -> None:
    h = make(policy="fcfs", budget=256)
    r = h.add("s", 40, arrival=1.0)
    h.run()
    blocks = h.blocks("s")
    assert h.sched.invalidate("s", 1000).kept == 40
    assert h.blocks("s") == blocks and r.num_computed_tokens == 40
    assert h.counters().get("invalidated_tokens", 0) == 0


def test_invalidate_an_evicted_session(make) -> None:
    h = make(policy="fcfs")
    first, _, _ = evict_idle_session(h)
    r = h.sched.requests["i"]
    assert h.sched.invalidate("i", 20).kept == 20
    assert h.sched.evicted["i"].tokens == 20
    assert r.prompt_token_ids == first[:20]
    second = h.tokens(12)
    h.add("i", second)
    h.run()
    assert r.prompt_token_ids == first[:20] + second and r.num_computed_tokens == 32
    c = h.counters()
    assert c["tokens_back_from_prefix_cache"] + c["recomputed_tokens"] == 20
