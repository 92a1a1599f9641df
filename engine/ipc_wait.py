"""How long vLLM's engine processes busy-wait for each other's messages (`engine.ipc_spin_us`).

An engine is two processes, the engine core (the scheduler) and its model worker, which pass each step's work and
results through a shared-memory queue (vLLM's `shm_broadcast.MessageQueue`). A reader waiting on it spins
(`sched_yield` in a loop) for 1 s after its last message before it sleeps on a socket. Under load that second
never ends, so the engine core spins through every step its worker computes, and an engine that just served
something spins for a second after it: on CPU cores shared with other engines, the router and the replicas, the
spinning takes the cores the model threads need (vllm-project/vllm#52814 makes the window configurable upstream).

With `ipc_spin_us` set, a reader spins that long after its last message, then checks every `SLEEP_S` until vLLM's
window ends, then waits as vLLM does. Within the window the checks read the queue itself, as the spin does, and
do not rely on the socket's wake-up (which can be dropped: a reader polling it alone, with vLLM's window at 0,
woke up seconds late); past it, vLLM's own wait, as before. A message that comes after the spin is read at most
one sleep late (~0.2 ms here).

Installed in the engine processes vLLM's multiprocessing executor starts (`engine.llm`'s process entry
points; not Ray-actor workers) from the environment variable `IPC_SPIN_US_ENV`, which `Engine.start` and
`SpeechEngine.start` set from the config. Not with vLLM's native spin-loop extension (`VLLM_USE_SPINLOOP_EXT`),
which spins before every wait.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

IPC_SPIN_US_ENV = "RTPD_IPC_SPIN_US"
SLEEP_S = 100e-6  # between checks once the spin is over (time.sleep rounds it up to ~0.2 ms here)

_original: dict[str, Callable[..., Any]] = {}


def bounded_wait(spin_s: float) -> Callable[..., None]:
    """A `SpinCondition.wait` that spins `spin_s` after the reader's last message, then sleeps between checks."""
    from vllm.distributed.utils import sched_yield

    vllm_wait = _original["wait"]

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        last_read = getattr(self, "last_read", None)
        if last_read is None:  # (not the reader this was written for: a newer vLLM)
            vllm_wait(self, timeout_ms)
            return
        since = time.monotonic() - last_read
        if since <= spin_s:
            sched_yield()
        elif since <= self.busy_loop_s:
            time.sleep(SLEEP_S)
        else:  # idle past vLLM's window: its own wait (a socket poll with a timeout, then the queue again)
            vllm_wait(self, timeout_ms)

    wait.rtpd_spin_s = spin_s  # type: ignore[attr-defined]
    return wait


def configure(spin_us: int | None) -> None:
    """Set this process's environment so that the engine processes it starts next install `spin_us` (None:
    vLLM's own wait)."""
    if spin_us is None:
        os.environ.pop(IPC_SPIN_US_ENV, None)
    else:
        os.environ[IPC_SPIN_US_ENV] = str(spin_us)


def install(spin_us: int | None = None) -> bool:
    """Bound the readers' spin in this process to `spin_us` (default: the environment's; unset: vLLM's own
    wait). Idempotent; False when vLLM's queue lacks what this relies on (a newer vLLM: its own wait stays)."""
    if spin_us is None:
        value = os.environ.get(IPC_SPIN_US_ENV, "")
        if not value:
            return False
        spin_us = int(value)
    from vllm.distributed.device_communicators import shm_broadcast

    cls = getattr(shm_broadcast, "SpinCondition", None)
    current = getattr(cls, "wait", None)
    if cls is None or current is None or not hasattr(cls, "record_read"):
        logger.warning("vLLM's shm_broadcast has no SpinCondition to bound: %s is ignored", IPC_SPIN_US_ENV)
        return False
    if getattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", False):
        logger.warning("vLLM's spin-loop extension spins before every wait: %s is ignored", IPC_SPIN_US_ENV)
        return False
    _original.setdefault("wait", getattr(current, "rtpd_original", current))
    wait = bounded_wait(spin_us / 1e6)
    wait.rtpd_original = _original["wait"]  # type: ignore[attr-defined]
    cls.wait = wait
    return True


def uninstall() -> None:
    """vLLM's own wait again (tests)."""
    from vllm.distributed.device_communicators import shm_broadcast

    if "wait" in _original:
        shm_broadcast.SpinCondition.wait = _original["wait"]
