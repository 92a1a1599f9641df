"""Swap: KV blocks copied out of the engine's cache into a bounded host pool, and back.

Two halves. `HostSlots`, here, lives with the scheduler (engine-core process) and only does the bookkeeping of
which host slots are free. `HostKVPool` (engine/kv_copy.py) lives in each model worker, next to the KV cache
tensors, and does the copies, called through the executor's `collective_rpc` (engine/worker_ext.py).
"""

from __future__ import annotations


class HostSlots:
    """Free-list of host slots (one slot holds one KV block of every layer)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)
