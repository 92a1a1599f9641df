"""Imported in every vLLM worker process through vLLM's `worker_extension_cls` hook.

Two things live here. The prefill scheduler's block copies (prefill/scheduler/swap.py), which must run where
the KV cache tensors are: the scheduler calls `rtpd_swap_*` and `rtpd_copy_blocks` through `collective_rpc`.
And NIXL tuning:

- NIXL starts a UCX progress thread by default that polls without pause. On a CPU host that thread competes
  with the model's own threads for the cores (measured here: decode steps of 5-7 ms instead of 1.2 ms on the
  local model). vLLM already drives NIXL progress from the worker on every step (`get_finished`), so the
  engine can run without it. `RTPD_NIXL_PROGRESS_THREAD=1` keeps it (GPU hosts with spare cores).
- On CPU, vLLM's NIXL connector moves the thread that creates it to the last core of each NUMA node, to keep KV
  loads off the model's cores. That thread is the worker's main thread, the one that runs the model: every
  engine with a connector computed on the last core, whatever its `VLLM_CPU_OMP_THREADS_BIND` (here prefill,
  bound to core 0, ran on decode's core 1 and left its own idle). The thread keeps the cores it had.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

if os.environ.get("RTPD_NIXL_PROGRESS_THREAD", "0") != "1" and base_worker.nixl_agent_config is not None:
    base_worker.nixl_agent_config = functools.partial(base_worker.nixl_agent_config, enable_prog_thread=False)


def keep_affinity(init: Callable[..., None]) -> Callable[..., None]:
    """`init`, after which the calling thread runs on the cores it had before (see the module's docstring)."""

    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        cores = os.sched_getaffinity(0)
        try:
            init(*args, **kwargs)
        finally:
            if os.sched_getaffinity(0) != cores:
                os.sched_setaffinity(0, cores)

    return wrapped


if not getattr(base_worker.NixlBaseConnectorWorker.__init__, "__wrapped__", None):
    base_worker.NixlBaseConnectorWorker.__init__ = keep_affinity(base_worker.NixlBaseConnectorWorker.__init__)


class WorkerExtension:
    """Methods mixed into vLLM's worker class; `self` is the worker."""

    _rtpd_pool: Any = None

    def rtpd_swap_init(self, num_slots: int) -> int:
        from engine.kv_copy import HostKVPool

        runner = self.model_runner  # type: ignore[attr-defined]
        num_blocks = self.vllm_config.cache_config.num_gpu_blocks  # type: ignore[attr-defined]
        self._rtpd_pool = HostKVPool(list(runner.kv_caches), num_blocks, num_slots)
        return self._rtpd_pool.block_bytes

    def rtpd_swap_out(self, block_ids: list[int], slots: list[int]) -> float:
        return self._rtpd_pool.swap_out(block_ids, slots)

    def rtpd_swap_in(self, slots: list[int], block_ids: list[int]) -> float:
        return self._rtpd_pool.swap_in(slots, block_ids)

    def rtpd_copy_blocks(self, src: list[int], dst: list[int]) -> float:
        from engine.kv_copy import copy_blocks

        runner = self.model_runner  # type: ignore[attr-defined]
        num_blocks = self.vllm_config.cache_config.num_gpu_blocks  # type: ignore[attr-defined]
        return copy_blocks(list(runner.kv_caches), num_blocks, src, dst)
