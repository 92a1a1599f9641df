"""Longest-common-prefix invalidation: cut a waiting request's KV back to the prefix its new input keeps.

vLLM has no call that truncates a request (its own rewind, for failed KV loads, recomputes whole blocks); a
vector search that replaces documents needs exactly that. The request's blocks wholly after `keep` go back
to the pool; the block holding the divergence point stays when the request owns it alone (its cached hash
is dropped: it will be rewritten from `keep` on), and is recomputed from its start when the prefix cache
shares it with others. Token lists, block hashes and counts are cut to match, so the next chunk appends at
`keep` and vLLM's runner receives the request's new block table as for any resumed session.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.v1.request import Request


def truncate(kv_cache_manager: Any, hash_block_size: int, r: Request, keep: int) -> tuple[int, int]:
    """Cut `r` to its first `keep` tokens (or a block fewer); returns (tokens kept, blocks freed)."""
    manager = kv_cache_manager.coordinator.single_type_managers[0]
    block_size = manager.block_size
    keep = max(0, min(keep, r.num_prompt_tokens))
    blocks = manager.req_to_blocks.get(r.request_id, [])
    n_keep = math.ceil(keep / block_size)
    if blocks and keep % block_size and n_keep <= len(blocks):
        edge = blocks[n_keep - 1]
        if edge.ref_cnt > 1:  # shared through the prefix cache: recompute this block
            n_keep -= 1
            keep = n_keep * block_size
        elif edge.block_hash is not None:
            kv_cache_manager.evict_blocks({edge.block_id})
    dropped = blocks[n_keep:]
    if dropped:
        del blocks[n_keep:]
        kv_cache_manager.block_pool.free_blocks(reversed(dropped))
    if r.request_id in manager.num_cached_block:
        manager.num_cached_block[r.request_id] = min(manager.num_cached_block[r.request_id], keep // block_size)
    assert r.prompt_token_ids is not None
    del r.prompt_token_ids[keep:]
    del r._all_token_ids[keep:]
    del r.block_hashes[keep // hash_block_size :]
    r.num_prompt_tokens = keep
    r.num_computed_tokens = min(r.num_computed_tokens, keep)
    return keep, len(dropped)
