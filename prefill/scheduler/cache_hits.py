"""Prefix-cache hits for a streaming request's appended input.

vLLM looks a request up in the prefix cache once, when it arrives with nothing computed; a streaming-input
request that has KV never looks again, so every chunk appended to it is computed, even when the prefix cache
holds those very blocks: the session's own hand-off computed its input whole (a turn sent in one piece),
another session streamed the same documents, or a rewrite went back to an earlier version. Before an appended
chunk is scheduled, `extend_from_cache` gives the request the cached blocks that follow its full computed
blocks, as a new request would get them: its uncached tail block (a partial one, owned alone) is given back,
the cached blocks are shared (ref-counted, as any hit), and its computed count moves to their end. vLLM's
runner receives the request's whole block table when the resumed session is scheduled, as after `truncate`.

The other way round, a session's hand-off (a new request over its whole input) finds the session's full blocks
in the prefix cache, but not the last, partial one: vLLM hits whole blocks only, and would compute up to a block
of input again (on a CPU's 128-token blocks, ~4% of a 1,800-token prompt, on the critical path after the last
chunk). `share_partial_block` gives the hand-off a copy of the session's partial block, so streamed input is
computed once.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request


def extend_from_cache(kv_cache_manager: Any, r: Request) -> int:
    """Share the cached blocks that continue `r`'s full computed blocks; returns the computed tokens gained."""
    manager = kv_cache_manager.coordinator.single_type_managers[0]
    pool = kv_cache_manager.block_pool
    block_size = manager.block_size
    blocks = manager.req_to_blocks.get(r.request_id)
    if not blocks or not kv_cache_manager.prefix_cache_lookup_enabled(r):
        return 0
    full = r.num_computed_tokens // block_size
    tail = blocks[full:]
    if any(b.ref_cnt != 1 or b.block_hash is not None for b in tail):
        return 0  # a tail block someone else reads, or a cached one: leave it as it is
    limit = (r.num_tokens - 1) // block_size  # (the last token is computed, to sample from)
    hits = []
    for i in range(full, min(limit, len(r.block_hashes))):
        cached = pool.get_cached_block(r.block_hashes[i], [manager.kv_cache_group_id])
        if cached is None:
            break
        hits.append(cached[0])
    gained = (full + len(hits)) * block_size - r.num_computed_tokens
    if gained <= 0:
        return 0
    pool.touch(hits)  # before the tail is freed: a hit must never be handed out as a free block
    del blocks[full:]
    pool.free_blocks(reversed(tail))
    blocks.extend(hits)
    manager.num_cached_block[r.request_id] = len(blocks)
    r.num_computed_tokens = len(blocks) * block_size
    return gained


def share_partial_block(kv_cache_manager: Any, executor: Any, handoff: Request, session: Request) -> int:
    """Before `handoff`'s first step: its cached full blocks, and a copy of the block where `session`'s computed
    prefix of the same tokens ends part-way. Returns the computed tokens gained past the full blocks (0: none)."""
    if handoff.num_computed_tokens or not kv_cache_manager.prefix_cache_lookup_enabled(handoff):
        return 0
    manager = kv_cache_manager.coordinator.single_type_managers[0]
    block_size = manager.block_size
    computed = session.num_computed_tokens
    mine, theirs = session.all_token_ids, handoff.all_token_ids
    limit = min(computed, handoff.num_tokens - 1)  # (the last token is computed, to sample from)
    same = 0
    while same < limit and mine[same] == theirs[same]:
        same += 1
    cached, hit, _ = kv_cache_manager.get_computed_blocks(handoff)
    index = hit // block_size
    source = manager.req_to_blocks.get(session.request_id, [])
    if same <= hit or same >= (index + 1) * block_size or index >= len(source):
        return 0  # nothing past the full blocks, or the full blocks themselves are not all cached
    new = kv_cache_manager.allocate_slots(handoff, same - hit, num_new_computed_tokens=hit, new_computed_blocks=cached)
    if new is None:
        return 0  # no room now; the hand-off computes it
    target = manager.req_to_blocks[handoff.request_id][index]
    executor.collective_rpc("rtpd_copy_blocks", args=([source[index].block_id], [target.block_id]))
    handoff.num_computed_tokens = same
    return same - hit
