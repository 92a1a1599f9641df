"""Each engine computes on the cores its config binds it to (`VLLM_CPU_OMP_THREADS_BIND`): the thread that runs a
vLLM worker's model (its main thread) keeps its place after the NIXL connector is made (serve_app/worker_ext.py).
Before, the connector moved it to the last core, and prefill (bound to core 0) ran on decode's core 1."""

from __future__ import annotations

import os

import psutil
import pytest
from vllm.utils.cpu_resource_utils import parse_id_list

pytestmark = pytest.mark.integration


def workers() -> dict[str, tuple[int, str]]:
    """Each role's engine worker process on this machine: role -> (pid, its bind setting)."""
    found: dict[str, tuple[int, str]] = {}
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] != "VLLM::Worker":
            continue
        try:
            replica = next(p.name() for p in proc.parents() if p.name().startswith("ray::ServeReplica"))
            bind = proc.environ().get("VLLM_CPU_OMP_THREADS_BIND", "")
        except (psutil.Error, StopIteration):
            continue
        found[replica.rsplit(":", 1)[-1]] = (proc.pid, bind)
    return found


def test_each_engine_computes_on_its_own_cores(server: str) -> None:
    running = workers()
    assert {"prefill", "decode"} <= set(running), running
    for role in ("prefill", "decode"):
        pid, bind = running[role]
        if bind in ("", "auto", "nobind"):
            pytest.skip(f"{role} is not bound to cores by its config")
        cores = set(parse_id_list(bind))
        assert os.sched_getaffinity(pid) == cores, (role, os.sched_getaffinity(pid), bind)  # (the main thread)
