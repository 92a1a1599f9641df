"""engine/ipc_wait.py on vLLM's own shared-memory queue: a reader spins only `ipc_spin_us` after its last
message, then sleeps between checks, and still reads every message."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from engine import ipc_wait

# zmq objects made here live as long as the process: a context collected while a socket of it is open aborts it.
_ALIVE: list[object] = []


@pytest.fixture
def bounded() -> Iterator[None]:
    assert ipc_wait.install(300)
    yield
    ipc_wait.uninstall()


@pytest.fixture
def reader() -> shm_broadcast.SpinCondition:
    context = zmq.Context()
    condition = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address="inproc://rtpd-test")
    _ALIVE.extend((context, condition))
    return condition


class Calls:
    """Counts the spin's yields and the sleeps between checks (instead of timing them: the machine is shared)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.yields = self.sleeps = 0
        sleep = time.sleep
        monkeypatch.setattr(os, "sched_yield", self._yield)
        monkeypatch.setattr(time, "sleep", lambda s: (self._sleep(), sleep(s)))

    def _yield(self) -> None:
        self.yields += 1

    def _sleep(self) -> None:
        self.sleeps += 1


def waits(reader: shm_broadcast.SpinCondition, since_last_read_s: float, n: int = 50) -> None:
    """`n` waits, `since_last_read_s` after the reader's last message."""
    reader.last_read = time.monotonic() - since_last_read_s
    for _ in range(n):
        reader.wait(timeout_ms=1000)


def test_vllm_spins_for_a_second_after_the_last_message(
    reader: shm_broadcast.SpinCondition, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = Calls(monkeypatch)
    assert reader.busy_loop_s == 1  # what this module exists for: 0.5 s after a message, vLLM still spins
    waits(reader, 0.5)
    assert (calls.yields, calls.sleeps) == (50, 0)


def test_bounded_spin_then_sleeps_between_checks(
    reader: shm_broadcast.SpinCondition, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = Calls(monkeypatch)
    try:
        assert ipc_wait.install(200_000)  # (a spin long enough that the loop stays within it)
        waits(reader, 0.0)
        assert (calls.yields, calls.sleeps) == (50, 0)  # within the spin: no sleep
        assert ipc_wait.install(300)
        waits(reader, 0.5)  # past it, within vLLM's window: a sleep a check, no spin
        assert (calls.yields, calls.sleeps) == (50, 50)
    finally:
        ipc_wait.uninstall()


def test_past_vllms_window_vllms_own_wait(bounded: None, reader: shm_broadcast.SpinCondition) -> None:
    # vLLM's wait polls the socket: nothing notified, it returns after its timeout.
    reader.last_read = time.monotonic() - 2
    started = time.perf_counter()
    reader.wait(timeout_ms=50)
    assert time.perf_counter() - started >= 0.045


def test_install_is_idempotent_and_keeps_vllms_wait() -> None:
    vllm_wait = shm_broadcast.SpinCondition.wait
    try:
        assert ipc_wait.install(100) and ipc_wait.install(200)
        assert shm_broadcast.SpinCondition.wait.rtpd_spin_s == 200e-6
        assert shm_broadcast.SpinCondition.wait.rtpd_original is vllm_wait
    finally:
        ipc_wait.uninstall()
    assert shm_broadcast.SpinCondition.wait is vllm_wait


def test_unset_environment_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ipc_wait.IPC_SPIN_US_ENV, raising=False)
    vllm_wait = shm_broadcast.SpinCondition.wait
    assert not ipc_wait.install()
    assert shm_broadcast.SpinCondition.wait is vllm_wait
    ipc_wait.configure(250)
    try:
        assert ipc_wait.install()
        assert shm_broadcast.SpinCondition.wait.rtpd_spin_s == 250e-6
    finally:
        ipc_wait.uninstall()
        ipc_wait.configure(None)


def test_spin_loop_extension_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", True)
    vllm_wait = shm_broadcast.SpinCondition.wait
    assert not ipc_wait.install(300)
    assert shm_broadcast.SpinCondition.wait is vllm_wait


def test_every_message_is_read_across_spin_and_sleep(bounded: None) -> None:
    """A writer and a reader of vLLM's MessageQueue, messages sent at gaps inside and past the spin: each read
    in order, none later than a few sleeps."""
    queue = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    _ALIVE.append(queue)
    handle = queue.export_handle()
    got: list[tuple[int, float]] = []

    def read() -> None:
        other = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
        _ALIVE.append(other)
        for _ in range(6):
            got.append((other.dequeue(timeout=10), time.perf_counter()))

    thread = threading.Thread(target=read)
    thread.start()
    queue.wait_until_ready()
    sent = []
    for i, gap in enumerate([0, 0.0001, 0.002, 0.02, 0.05, 0.0]):
        time.sleep(gap)
        sent.append(time.perf_counter())
        queue.enqueue(i)
    thread.join(10)
    assert [i for i, _ in got] == list(range(6))
    assert max(at - sent[i] for i, at in got) < 0.05
