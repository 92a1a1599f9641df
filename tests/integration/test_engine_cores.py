"""Each engine computes on the cores its config binds it to (`VLLM_CPU_OMP_THREADS_BIND`): the thread that runs a
vLLM worker's model (its main thread) keeps its place after the NIXL connector is made (engine/worker_ext.py).
Before, the connector moved it to the last core, and prefill (bound to core 0) ran on decode's core 1.

And an engine that has just answered leaves the cores alone: its processes stop spinning for each other's
messages `engine.ipc_spin_us` after the last one (engine/ipc_wait.py), not vLLM's 1 s."""

from __future__ import annotations

import contextlib
import os
import time

import httpx
import psutil
import pytest
from vllm.utils.cpu_resource_utils import parse_id_list

from tests.integration.conftest import APP

pytestmark = pytest.mark.integration


def engine_processes(role: str) -> list[psutil.Process]:
    """The main app's `role` engine: its engine-core process and the model workers it started."""
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "VLLM::EngineCore" and proc.parent().name() == f"ray::ServeReplica:{APP}:{role}":
                return [proc, *(c for c in proc.children() if c.name() == "VLLM::Worker")]
        except psutil.Error:
            continue
    return []


def workers() -> dict[str, tuple[int, str]]:
    """Each role's engine worker process of the main app: role -> (pid, its bind setting)."""
    found: dict[str, tuple[int, str]] = {}
    for role in ("prefill", "decode"):
        for proc in engine_processes(role)[1:]:
            with contextlib.suppress(psutil.Error):
                found[role] = (proc.pid, proc.environ().get("VLLM_CPU_OMP_THREADS_BIND", ""))
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


def test_an_engine_that_just_answered_does_not_spin(server: str, model_name: str) -> None:
    """In the second after an answer vLLM's processes would spin on their queue (a core each, measured: ~100%);
    bounded, they check it a few thousand times a second and sleep between (a few % of a core)."""
    procs = {role: engine_processes(role) for role in ("prefill", "decode")}
    assert all(len(p) == 2 for p in procs.values()), procs
    prompt = "Spin or sleep. " * 40  # long enough to be prefilled by prefill and handed to decode
    body = {"model": model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    for _ in range(3):
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        before = {p.pid: sum(p.cpu_times()[:2]) for ps in procs.values() for p in ps}
        time.sleep(0.5)  # within vLLM's 1 s spin after the last message
        used = {p.name() + f"/{role}": sum(p.cpu_times()[:2]) - before[p.pid] for role, ps in procs.items() for p in ps}
        if max(used.values()) < 0.5 * 0.3:
            return
    raise AssertionError(f"CPU seconds in the 0.5 s after an answer: {used}")


def _wakes(pid: int) -> int:
    """Context switches of all of a process's threads so far (/proc's per-process figure is its main thread's)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            status = open(f"/proc/{pid}/task/{tid}/status").read()  # noqa: SIM115  (a /proc read)
            total += sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
    return total


def test_an_idle_engine_core_is_left_asleep(server: str) -> None:
    """Nothing asked of the app: its replicas do not read their engines' figures again (`Engine.activity`). Each
    read is a utility call that wakes the engine core's threads (its input, scheduler and output threads, ZMQ's):
    prefill's sweep read them every second: 11-13 wakes a second measured on two cores (decode's, every 5 s: 2-3.3);
    idle, the engine core wakes about once a second."""
    found = {role: engine_processes(role) for role in ("prefill", "decode")}
    assert all(found.values()), f"no engine core found for some role: {found}"
    cores = {role: procs[0] for role, procs in found.items()}
    window_s = 6.0
    rates: list[dict[str, float]] = []
    for _ in range(3):  # (a window a test's leftover session closes in is tried again)
        before = {role: _wakes(p.pid) for role, p in cores.items()}
        time.sleep(window_s)
        rates.append({role: (_wakes(p.pid) - before[role]) / window_s for role, p in cores.items()})
        if max(rates[-1].values()) < 3.0:
            return
    raise AssertionError(f"idle engine cores' wakes a second: {rates}")
