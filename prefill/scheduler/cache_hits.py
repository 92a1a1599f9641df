"""Prefix-cache hits for a streaming request's appended input.

vLLM looks a request up in the prefix cache once, when it arrives with nothing computed; a streaming-input
request that has KV never looks again, so every chunk appended to it is computed, even when the prefix cache
holds those very blocks: the session's own hand-off computed its input whole (a turn sent in one piece),
another session streamed the same documents, or a rewrite went back to an earlier version. Before an appended
chunk is scheduled, `extend_from_cache` gives the request the cached blocks that follow its full computed
blocks, as a new request would get them: its uncached tail block (a partial one, owned alone) is given back,
the cached blocks are shared (ref-counted, as any hit), and its computed count moves to their end. vLLM's
runner receives the request's whole block table when the resumed session is scheduled, as after `truncate`.
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
