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

**Wake-ups only for sleepers.** vLLM's writer also sends a byte on a ZMQ socket after every message, to wake a
reader sleeping on it: a syscall and a wake of ZMQ's I/O thread in both processes on every step, in both
directions (py-spy: ~9% of a worker's samples at one stream). A reader only sleeps on the socket once it has read
nothing for vLLM's window (1 s); so when every reader has read the writer's last message and that message was
written less than `QUIET_S` ago, each is still inside its window, checking the queue itself, and the byte is not
sent. That holds while a reader stalls less than the window's other 0.75 s between its last look at the queue and
its wait; a longer stall (a starved process) costs at most vLLM's own re-check of the queue, every 5 s.
One engine alone at one stream (`python` in-process, 512-token answers, two alternations): 1,207 / 846 tokens/s
against 1,118 / 769 with a byte every message; the app at 1 / 32 / 128 streams 1.15 / 1.03 / 1.26x the tokens/s
(bench/token_path.py, `app_ipc_notify`: docs/benchmarks.md). `RTPD_IPC_NOTIFY=every` keeps vLLM's.

Installed in the engine processes vLLM's multiprocessing executor starts (`engine.llm`'s process entry
points; not Ray-actor workers) from the environment variable `IPC_SPIN_US_ENV`, which `Engine.start` and
`SpeechEngine.start` set from the config. Not with vLLM's native spin-loop extension (`VLLM_USE_SPINLOOP_EXT`),
which spins before every wait.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

IPC_SPIN_US_ENV = "RTPD_IPC_SPIN_US"
NOTIFY_ENV = "RTPD_IPC_NOTIFY"  # "every": vLLM's wake-up on every message (the A/B's other side)
SLEEP_S = 100e-6  # between checks once the spin is over (time.sleep rounds it up to ~0.2 ms here)
QUIET_S = 0.25  # a message this soon after the last one, which every reader read, needs no wake-up (vLLM's window: 1 s)

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
    if os.environ.get(NOTIFY_ENV, "") != "every":
        _quiet_notify(shm_broadcast)
    return True


def _quiet_notify(shm_broadcast: Any) -> None:
    """A writer wakes its readers through the socket only when one may be sleeping on it (`QUIET_S`)."""
    queue_cls, cond_cls = shm_broadcast.MessageQueue, shm_broadcast.SpinCondition
    window = inspect.signature(cond_cls.__init__).parameters.get("busy_loop_s")
    window_s = window.default if window is not None else None
    # The readers' window less QUIET_S is the margin a reader's stall between its last check and its wait must stay
    # under; vLLM's 5 s re-check bounds the cost of a stall past it (without the re-check, a wait could be forever).
    if not isinstance(window_s, (int, float)) or window_s < 4 * QUIET_S:
        logger.warning("vLLM's readers wait %s s before sleeping: every message wakes them", window_s)
        return
    if not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        logger.warning("vLLM's sleeping readers never re-check the queue: every message wakes them")
        return
    _original.setdefault("enqueue", queue_cls.enqueue)
    _original.setdefault("notify", cond_cls.notify)
    fence = shm_broadcast.memory_fence

    def all_read(queue: Any, index: int) -> bool:
        with queue.buffer.get_metadata(index) as metadata:
            fence()
            return bool(metadata[0]) and sum(metadata[1:]) == queue.buffer.n_reader

    def enqueue(self: Any, *args: Any, **kwargs: Any) -> None:
        condition, last = getattr(self, "_spin_condition", None), getattr(self, "rtpd_last_write", None)
        if condition is not None:
            # Every reader read the last message (its flags only go 0 -> 1 until this write): since then each read
            # at or after `last[1]`, which is stamped before that message was visible (so a reader's window is
            # measured from no earlier than this). `notify`, after this message is visible, checks the time.
            condition.rtpd_since = last[1] if last is not None and all_read(self, last[0]) else None
        index, stamped = self.current_idx, time.monotonic()  # (the chunk this message goes to; before it is visible)
        try:
            _original["enqueue"](self, *args, **kwargs)
        finally:
            if condition is not None:
                condition.rtpd_since = None
        self.rtpd_last_write = (index, stamped)

    def notify(self: Any) -> None:
        since = getattr(self, "rtpd_since", None)
        if since is None or time.monotonic() - since >= QUIET_S:
            _original["notify"](self)

    queue_cls.enqueue, cond_cls.notify = enqueue, notify


def uninstall() -> None:
    """vLLM's own wait again (tests)."""
    from vllm.distributed.device_communicators import shm_broadcast

    if "wait" in _original:
        shm_broadcast.SpinCondition.wait = _original["wait"]
    if "enqueue" in _original:
        shm_broadcast.MessageQueue.enqueue = _original.pop("enqueue")
        shm_broadcast.SpinCondition.notify = _original.pop("notify")
