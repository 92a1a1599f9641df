"""KV blocks copied inside a model worker, next to the KV cache tensors: the worker half of the prefill scheduler's
swap (prefill/scheduler/swap.py keeps the scheduler's half, the host slots' bookkeeping) and of its block copies.
The scheduler calls these through the executor's `collective_rpc` (engine/worker_ext.py) while no model step is in
flight, so a swap-out always reads finished KV and a swap-in lands before the step that reads it. On a CPU platform
the "host" pool is a second DRAM pool: the copies are real and measured.
"""

from __future__ import annotations

import time
from typing import Any


def _block_dim(tensor: Any, num_blocks: int) -> int:
    """Which dimension of a layer's KV tensor indexes blocks: (2, blocks, ...) on CPU and FlashAttention,
    (blocks, 2, ...) on some backends."""
    for dim in (1, 0):
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no block dimension of size {num_blocks} in KV tensor of shape {tuple(tensor.shape)}")


def copy_blocks(kv_caches: list[Any], num_blocks: int, src: list[int], dst: list[int]) -> float:
    """Copy device blocks onto other device blocks, every layer (a hand-off's copy of its session's partial
    last block); returns the seconds it took."""
    import torch

    started = time.perf_counter()
    if src:
        for t in kv_caches:
            dim = _block_dim(t, num_blocks)
            s_index = torch.tensor(src, dtype=torch.long, device=t.device)
            d_index = torch.tensor(dst, dtype=torch.long, device=t.device)
            t.index_copy_(dim, d_index, t.index_select(dim, s_index))
        if torch.cuda.is_available() and kv_caches[0].is_cuda:
            torch.cuda.synchronize()
    return time.perf_counter() - started


class HostKVPool:
    """Host copies of KV blocks for every layer, `num_slots` blocks deep."""

    def __init__(self, kv_caches: list[Any], num_blocks: int, num_slots: int) -> None:
        import torch

        self.kv_caches = kv_caches
        self.dims = [_block_dim(t, num_blocks) for t in kv_caches]
        pin = torch.cuda.is_available() and kv_caches[0].is_cuda
        self.host = []
        for t, dim in zip(kv_caches, self.dims, strict=True):
            shape = list(t.shape)
            shape[dim] = num_slots
            self.host.append(torch.empty(shape, dtype=t.dtype, device="cpu", pin_memory=pin))
        pairs = zip(kv_caches, self.dims, strict=True)
        self.block_bytes = sum(t.element_size() * t.numel() // t.shape[d] for t, d in pairs)

    def swap_out(self, block_ids: list[int], slots: list[int]) -> float:
        """Copy device blocks into host slots; returns the seconds it took."""
        return self._copy(self.kv_caches, block_ids, self.host, slots)

    def swap_in(self, slots: list[int], block_ids: list[int]) -> float:
        return self._copy(self.host, slots, self.kv_caches, block_ids)

    def _copy(self, src: list[Any], src_idx: list[int], dst: list[Any], dst_idx: list[int]) -> float:
        import torch

        started = time.perf_counter()
        if src_idx:
            s_index = torch.tensor(src_idx, dtype=torch.long, device=src[0].device)
            d_index = torch.tensor(dst_idx, dtype=torch.long, device=dst[0].device)
            for s, d, dim in zip(src, dst, self.dims, strict=True):
                d.index_copy_(dim, d_index, s.index_select(dim, s_index).to(d.device, non_blocking=False))
            if torch.cuda.is_available() and (src[0].is_cuda or dst[0].is_cuda):
                torch.cuda.synchronize()
        return time.perf_counter() - started
