"""Swap (prefill/scheduler/swap.py): the host slot free-list, the host KV pool's copies on real tensors, and
the scheduler swapping sessions out and back in through a fake executor over real KV tensors."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.request import RequestStatus

from engine.kv_copy import HostKVPool
from prefill.scheduler.cost_model import Fit, LatencyModel
from prefill.scheduler.swap import HostSlots
from tests.unit.prefill.scheduler.harness import BLOCK, HEAD_SIZE, IDLE, NUM_KV_HEADS

# --- HostSlots -------------------------------------------------------------------------------------------


def test_host_slots_alloc_and_free() -> None:
    slots = HostSlots(4)
    assert slots.num_slots == 4 and slots.num_free == 4
    a = slots.alloc(3)
    assert a == [0, 1, 2] and slots.num_free == 1
    assert slots.alloc(2) is None  # all or nothing
    assert slots.num_free == 1
    b = slots.alloc(1)
    assert b == [3] and slots.num_free == 0
    assert slots.alloc(1) is None
    assert slots.alloc(0) == []
    slots.free(a)
    assert slots.num_free == 3
    assert sorted(slots.alloc(3)) == [0, 1, 2]


def test_host_slots_empty_pool() -> None:
    slots = HostSlots(0)
    assert slots.num_free == 0
    assert slots.alloc(1) is None
    assert slots.alloc(0) == []


# --- HostKVPool -------------------------------------------------------------------------------------------


def kv_layers(num_blocks: int, blocks_first: bool = False, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2) if blocks_first else (2, num_blocks)
    return [torch.randn((*shape, NUM_KV_HEADS, BLOCK, HEAD_SIZE), generator=gen) for _ in range(2)]


@pytest.mark.parametrize("blocks_first", [False, True])
def test_pool_swap_out_and_in_roundtrip(blocks_first: bool) -> None:
    num_blocks = 10
    kv = kv_layers(num_blocks, blocks_first)
    dim = 0 if blocks_first else 1
    pool = HostKVPool(kv, num_blocks=num_blocks, num_slots=4)
    assert pool.dims == [dim, dim]
    assert pool.block_bytes == 2 * 2 * NUM_KV_HEADS * BLOCK * HEAD_SIZE * 4  # 2 layers x (K, V) x fp32
    assert all(h.shape[dim] == 4 for h in pool.host)
    original = [t.clone() for t in kv]

    took = pool.swap_out([3, 7, 1], [2, 0, 3])
    assert isinstance(took, float) and took >= 0
    for t, h in zip(original, pool.host, strict=True):
        assert torch.equal(h.index_select(dim, torch.tensor([2, 0, 3])), t.index_select(dim, torch.tensor([3, 7, 1])))

    for t in kv:  # the blocks are reused
        t.fill_(-1.0)
    pool.swap_in([2, 0, 3], [5, 6, 8])
    for t, o in zip(kv, original, strict=True):
        assert torch.equal(t.index_select(dim, torch.tensor([5, 6, 8])), o.index_select(dim, torch.tensor([3, 7, 1])))
        untouched = torch.tensor([b for b in range(num_blocks) if b not in (5, 6, 8)])
        assert bool((t.index_select(dim, untouched) == -1.0).all())


def test_pool_copies_nothing_for_no_blocks() -> None:
    kv = kv_layers(4)
    pool = HostKVPool(kv, num_blocks=4, num_slots=2)
    before = [t.clone() for t in kv]
    assert pool.swap_in([], []) >= 0
    assert all(torch.equal(a, b) for a, b in zip(kv, before, strict=True))


def test_pool_rejects_a_tensor_without_a_block_dimension() -> None:
    with pytest.raises(ValueError, match="no block dimension"):
        HostKVPool(kv_layers(4), num_blocks=5, num_slots=2)


# --- the scheduler swapping ---------------------------------------------------------------------------------


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_attach_sizes_the_host_pool(make) -> None:
    h = make(eviction="swap", swap_slots=8)
    assert h.attach_info == {"host_slots": 8, "block_bytes": 2 * 2 * NUM_KV_HEADS * BLOCK * HEAD_SIZE * 4}
    assert h.executor.calls == [("rtpd_swap_init", (8,))]
    assert h.executor.pool.block_bytes == h.sched.block_bytes
    c = h.counters()
    assert c["host_slots"] == 8 and c["host_slots_free"] == 8


def test_idle_session_swapped_out_and_back_in_gets_its_kv_back(make) -> None:
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=8)
    first = h.tokens(40)
    s = h.add("s", first, arrival=1.0)
    h.run()
    old = h.blocks("s")
    assert len(old) == 3 and s.num_computed_tokens == 40
    snapshot = h.block_contents(old)

    # A complete request needs all 12 blocks: s is swapped out and every one of its blocks is reused.
    h.add("n", 192, resumable=False, arrival=10.0)
    out = h.step()
    assert out.num_scheduled_tokens == {"n": 192}
    n_blocks = out.scheduled_new_reqs[0].block_ids[0]
    assert set(old) <= set(n_blocks)
    h.scribble(n_blocks)  # what n's prefill wrote
    assert not same(h.block_contents(old), snapshot)
    ev = h.sched.evicted["s"]
    assert ev.kind == "swap" and ev.tokens == 40 and ev.idle and len(ev.slots) == 3
    c = h.counters()
    assert c["evictions_swap"] == 1 and c["swapped_out_blocks"] == 3 and c["host_slots_free"] == 5
    assert c["swapped_out_bytes"] == 3 * h.sched.block_bytes

    second = h.tokens(20)
    h.add("s", second)
    assert s.num_computed_tokens == 0 and s.status == RequestStatus.WAITING
    out = h.step()
    assert out.num_scheduled_tokens == {"s": 20}  # only the new chunk is computed
    assert s.num_computed_tokens == 60 and s.status == IDLE
    assert same(h.block_contents(h.blocks("s")[:3]), snapshot)
    assert [m for m, _ in h.executor.calls] == ["rtpd_swap_init", "rtpd_swap_out", "rtpd_swap_in"]
    c = h.counters()
    assert c["swapped_in_blocks"] == 3 and c["tokens_back_from_prefix_cache"] == 0
    assert c["host_slots_free"] == 8 and c["evicted_now"] == 0
    assert "recomputed_tokens" not in c and "swap_fallbacks" not in c


def test_swap_in_takes_prefix_cache_hits_first(make) -> None:
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=8)
    s = h.add("s", 48, arrival=1.0)
    h.run()
    old = h.blocks("s")
    snapshot = h.block_contents(old)
    h.add("n", 176, resumable=False, arrival=10.0)  # 11 blocks: s's first block survives in the prefix cache
    out = h.step()
    n_blocks = out.scheduled_new_reqs[0].block_ids[0]
    assert old[0] not in n_blocks and set(old[1:]) <= set(n_blocks)
    h.scribble(n_blocks)

    h.add("s", 16)
    out = h.step()
    assert out.num_scheduled_tokens == {"s": 16}
    assert h.blocks("s")[0] == old[0]
    assert same(h.block_contents(h.blocks("s")[:3]), snapshot)
    c = h.counters()
    assert c["swapped_in_blocks"] == 2 and c["tokens_back_from_prefix_cache"] == 16
    assert c["host_slots_free"] == 8
    assert s.num_computed_tokens == 64


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full(make) -> None:
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=2)
    h.add("s", 48, arrival=1.0)  # 3 blocks: more than the pool holds
    h.run()
    h.add("n", 192, resumable=False, arrival=10.0)
    assert "n" in h.step().num_scheduled_tokens
    c = h.counters()
    assert c["swap_fallbacks"] == 1 and c["evictions_recompute"] == 1 and "evictions_swap" not in c
    assert c["host_slots_free"] == 2
    assert [m for m, _ in h.executor.calls] == ["rtpd_swap_init"]
    h.add("s", 16)
    assert h.run() == [{"s": 64}]  # all recomputed: n reused every block
    assert h.counters()["recomputed_tokens"] == 48


def test_without_host_memory_swap_means_recompute(make) -> None:
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=0)
    assert h.executor is None and h.sched.host.num_slots == 0
    h.add("s", 48, arrival=1.0)
    h.run()
    h.add("n", 192, resumable=False, arrival=10.0)
    assert "n" in h.step().num_scheduled_tokens
    c = h.counters()
    assert c["evictions_recompute"] == 1 and "swap_fallbacks" not in c


def test_host_slots_come_back_when_a_swapped_out_session_ends(make) -> None:
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=8)
    h.add("s", 48, arrival=1.0)
    h.run()
    h.add("n", 192, resumable=False, arrival=10.0)
    h.step()
    assert h.counters()["host_slots_free"] == 5
    h.sched.add_request(h.request("s", [], resumable=False))  # the session's end
    assert "s" not in h.sched.requests
    h.step()
    c = h.counters()
    assert c["host_slots_free"] == 8 and c["evicted_now"] == 0


def test_invalidating_a_swapped_out_session_frees_its_slots_after_the_prefix(make) -> None:
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=8)
    first = h.tokens(48)
    s = h.add("s", first, arrival=1.0)
    h.run()
    snapshot = h.block_contents(h.blocks("s")[:2])
    h.add("n", 192, resumable=False, arrival=10.0)
    out = h.step()
    h.scribble(out.scheduled_new_reqs[0].block_ids[0])
    assert h.sched.invalidate("s", 20).kept == 20
    ev = h.sched.evicted["s"]
    assert ev.tokens == 20 and len(ev.slots) == 2
    assert h.counters()["host_slots_free"] == 6
    second = h.tokens(10)
    h.add("s", second)
    out = h.step()
    assert out.num_scheduled_tokens == {"s": 10}
    assert s.prompt_token_ids == first[:20] + second and s.num_computed_tokens == 30
    assert same(h.block_contents(h.blocks("s")[:1]), [t[:, :1] for t in snapshot])
    # The edge block's first 4 token slots are the session's; the rest is what its new chunk wrote.
    restored = h.block_contents(h.blocks("s")[1:2])
    assert all(torch.equal(r[:, :, :, :4], o[:, 1:2, :, :4]) for r, o in zip(restored, snapshot, strict=True))
    assert h.counters()["host_slots_free"] == 8


def test_a_rewrite_of_a_swapped_out_session_with_a_chunk_queued_cuts_both(make) -> None:
    """Swapped out, then a chunk arrives (it waits for room): a rewrite ends that chunk and cuts the host copy
    to the common prefix; the next chunk swaps the prefix back in and computes only itself."""
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=8)
    first = h.tokens(48)
    s = h.add("s", first, arrival=1.0)
    h.run()
    snapshot = h.block_contents(h.blocks("s")[:1])
    h.add("n", 192, resumable=False, arrival=10.0)
    out = h.step()
    h.scribble(out.scheduled_new_reqs[0].block_ids[0])
    assert h.sched.evicted["s"].kind == "swap"
    h.add("s", h.tokens(12))  # queued behind the plain request, its KV on the host
    assert s.status != IDLE
    cut = h.sched.invalidate("s", 20)
    assert cut == (20, 1) and s.status == IDLE
    ev = h.sched.evicted["s"]
    assert ev.tokens == 20 and len(ev.slots) == 2 and h.counters()["host_slots_free"] == 6
    assert all("s" not in step for step in h.run())  # the plain request ends; nothing of the cut chunk runs
    second = h.tokens(10)
    h.add("s", second)
    assert h.run() == [{"s": 10}]
    assert s.prompt_token_ids == first[:20] + second and s.num_computed_tokens == 30
    assert same(h.block_contents(h.blocks("s")[:1]), snapshot)
    assert h.counters()["host_slots_free"] == 8


def cost_model(swap_cheaper: bool) -> LatencyModel:
    per_block = 1e-5 if swap_cheaper else 1.0
    return LatencyModel(Fit([0.0, 1e-3, 0.0]), Fit([0.0, per_block, 0.0]), Fit([0.0, per_block, 0.0]))


@pytest.mark.parametrize(("swap_cheaper", "kind"), [(True, "swap"), (False, "recompute"), (None, "recompute")])
def test_cost_eviction_follows_the_latency_model(make, swap_cheaper: bool | None, kind: str) -> None:
    h = make(policy="fcfs", eviction="cost", budget=256, swap_slots=8)
    h.sched.latency = None if swap_cheaper is None else cost_model(swap_cheaper)
    h.add("s", 48, arrival=1.0)
    h.run()
    h.add("n", 192, resumable=False, arrival=10.0)
    assert "n" in h.step().num_scheduled_tokens
    c = h.counters()
    assert c[f"evictions_{kind}"] == 1
    assert h.sched.evicted["s"].kind == kind


def test_running_victim_is_swapped_out_and_back_in(make) -> None:
    h = make(policy="fcfs", eviction="swap", num_blocks=11, swap_slots=16)
    L = h.add("L", 160, arrival=2.0)
    h.step()
    h.step()
    assert L.status == RequestStatus.RUNNING and L.num_computed_tokens == 128
    old = h.blocks("L")
    snapshot = h.block_contents(old)
    h.add("n", 64, resumable=False, arrival=3.0)
    out = h.step()
    assert out.preempted_req_ids == {"L"}
    assert out.num_scheduled_tokens == {"n": 64}, "the evicted L was re-admitted ahead of n"
    h.scribble(out.scheduled_new_reqs[0].block_ids[0])
    out = h.step()
    assert out.num_scheduled_tokens == {"L": 32}
    assert same(h.block_contents(h.blocks("L")[:8]), snapshot)
    c = h.counters()
    assert c["swapped_out_blocks"] == 8 and c["swapped_in_blocks"] + c["tokens_back_from_prefix_cache"] // BLOCK == 8
    assert "swap_fallbacks" not in c


def test_a_hand_off_takes_its_idle_sessions_swapped_out_kv(make) -> None:
    """At end of input the hand-off is a complete request over the session's whole input: the KV its session
    had swapped out while idle is swapped in for it, not recomputed (nor left unused in the host pool)."""
    h = make(policy="fcfs", eviction="swap", budget=256, swap_slots=8)
    first = h.tokens(40)
    h.add("s", first, arrival=1.0)
    h.run()
    snapshot = h.block_contents(h.blocks("s"))
    h.add("n", 192, resumable=False, arrival=10.0)  # every block: s is swapped out
    out = h.step()
    h.scribble(out.scheduled_new_reqs[0].block_ids[0])
    h.run()  # n done (its blocks stay cached, scribbled)
    assert h.sched.evicted["s"].kind == "swap"

    h.add("s-t0-h1", [*first, *h.tokens(8)], resumable=False, session="s")
    out = h.step()
    assert out.num_scheduled_tokens == {"s-t0-h1": 8}  # only what the session never had
    assert same(h.block_contents(out.scheduled_new_reqs[0].block_ids[0][:3]), snapshot)
    c = h.counters()
    assert c["swapped_in_blocks"] == 3 and c["swap_taken_by_handoff"] == 1
    assert "recomputed_tokens" not in c and "swap_fallbacks" not in c
    assert h.sched.compute_stats("s")["session_scheduler"]["swapped_in_blocks"] == 3
    h.run()
    assert h.counters()["host_slots_free"] == 8
