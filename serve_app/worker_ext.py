"""Imported in every vLLM worker process through vLLM's `worker_extension_cls` hook.

NIXL starts a UCX progress thread by default that polls without pause. On a CPU host that thread competes
with the model's own threads for the cores (measured here: decode steps of 5-7 ms instead of 1.2 ms on the
local model). vLLM already drives NIXL progress from the worker on every step (`get_finished`), so the
engine can run without it. `RTPD_NIXL_PROGRESS_THREAD=1` keeps it (GPU hosts with spare cores).
"""

from __future__ import annotations

import functools
import os

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

if os.environ.get("RTPD_NIXL_PROGRESS_THREAD", "0") != "1" and base_worker.nixl_agent_config is not None:
    base_worker.nixl_agent_config = functools.partial(base_worker.nixl_agent_config, enable_prog_thread=False)


class WorkerExtension:
    """No methods: importing this module in the worker is the point."""
