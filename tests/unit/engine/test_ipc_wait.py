"""engine/ipc_wait.py on vLLM's own shared-memory queue: a reader spins only `ipc_spin_us` after its last
message, then sleeps between checks, and still reads every message."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from engine import ipc_wait

# zmq objects made here live as long as the process: a context collected while a socket of it is open aborts it.
_ALIVE: list[object] = []


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ipc_wait.NOTIFY_ENV, raising=False)
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


class Notified:
    """Counts the wake-up bytes vLLM's writer really sends (engine/ipc_wait.py `_quiet_notify`)."""

    def __init__(self) -> None:
        self.count = 0


@pytest.fixture
def notified(bounded: None) -> Iterator[Notified]:
    counter, send = Notified(), ipc_wait._original["notify"]

    def counted(condition: shm_broadcast.SpinCondition) -> None:
        counter.count += 1
        send(condition)

    ipc_wait._original["notify"] = counted
    yield counter
    ipc_wait._original["notify"] = send


Read = list[tuple[Any, float]]  # (message, when read)


def _writer() -> tuple[shm_broadcast.MessageQueue, Any]:
    queue = shm_broadcast.MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1 << 16, max_chunks=4)
    _ALIVE.append(queue)
    return queue, queue.export_handle()


def _reader(handle: Any, rank: int, got: Read, window_s: float | None = None) -> threading.Event:
    """A reader thread that appends what it reads until it reads None; set once it is attached."""
    attached = threading.Event()

    def read() -> None:
        other = shm_broadcast.MessageQueue.create_from_handle(handle, rank)
        _ALIVE.append(other)
        if window_s is not None:  # (vLLM's window is 1 s: shorter, so that the test's reader sleeps on the socket)
            other._spin_condition.busy_loop_s = window_s
        attached.set()
        while (message := other.dequeue(timeout=10)) is not None:
            got.append((message, time.perf_counter()))

    threading.Thread(target=read, daemon=True).start()
    return attached


def _two_readers(window_s: float | None = None) -> tuple[shm_broadcast.MessageQueue, Read, Read]:
    queue, handle = _writer()
    first, second = [], []
    attached = [_reader(handle, 0, first, window_s), _reader(handle, 1, second, window_s)]
    queue.wait_until_ready()
    assert all(event.wait(10) for event in attached)
    return queue, first, second


def _read(got: Read, n: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while len(got) < n and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert len(got) >= n, f"{len(got)} of {n} messages read"


def test_no_wake_up_byte_while_the_readers_keep_up(notified: Notified, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages one after another, each read by both readers before the next: only the first is notified (before
    it, no reader had read anything), and every one is read, in order."""
    monkeypatch.setattr(ipc_wait, "QUIET_S", 0.9)  # (a gap on a busy machine must not make a byte: still < 1 s)
    queue, first, second = _two_readers()
    for i in range(40):
        queue.enqueue(i)
        _read(first, i + 1)
        _read(second, i + 1)
    assert notified.count == 1
    queue.enqueue(None)
    assert [m for m, _ in first] == [m for m, _ in second] == list(range(40))


def test_a_message_one_reader_has_not_read_yet_still_notifies(notified: Notified) -> None:
    """Two readers: the second has not read message 0 (it may be asleep), so message 1 sends the byte."""
    queue, handle = _writer()
    first: Read = []
    attached = _reader(handle, 0, first)
    holder: list[shm_broadcast.MessageQueue] = []
    slow = threading.Thread(target=lambda: holder.append(shm_broadcast.MessageQueue.create_from_handle(handle, 1)))
    slow.start()
    queue.wait_until_ready()
    slow.join(10)
    assert attached.wait(10) and holder
    _ALIVE.extend(holder)
    queue.enqueue(0)
    _read(first, 1)
    queue.enqueue(1)  # (the first reader read 0, the second did not)
    assert notified.count == 2
    assert [holder[0].dequeue(timeout=5), holder[0].dequeue(timeout=5)] == [0, 1]
    queue.enqueue(None)
    _read(first, 2)


def test_readers_asleep_past_their_window_are_woken_at_once(notified: Notified) -> None:
    """Readers that read nothing for their window sleep on the socket: a message after a quiet spell (longer than
    `QUIET_S`) sends the byte, and they have it within milliseconds, not at vLLM's 5 s re-check."""
    queue, first, second = _two_readers(window_s=0.02)
    queue.enqueue(0)
    _read(first, 1)
    _read(second, 1)
    time.sleep(ipc_wait.QUIET_S + 0.1)  # the readers are asleep on the socket, and the writer's last message is old
    sent = time.perf_counter()
    queue.enqueue(1)
    _read(first, 2)
    _read(second, 2)
    assert notified.count == 2
    assert max(first[1][1], second[1][1]) - sent < 0.5
    time.sleep(ipc_wait.QUIET_S + 0.1)
    queue.enqueue(None)


def test_every_switches_the_quiet_wake_up_off(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_enqueue, vllm_notify = shm_broadcast.MessageQueue.enqueue, shm_broadcast.SpinCondition.notify
    monkeypatch.setenv(ipc_wait.NOTIFY_ENV, "every")
    try:
        assert ipc_wait.install(300)
        assert shm_broadcast.MessageQueue.enqueue is vllm_enqueue
    finally:
        ipc_wait.uninstall()
    monkeypatch.delenv(ipc_wait.NOTIFY_ENV)
    try:
        assert ipc_wait.install(300) and ipc_wait.install(200)
        assert shm_broadcast.MessageQueue.enqueue is not vllm_enqueue
        assert ipc_wait._original["notify"] is vllm_notify  # (installed twice: still vLLM's underneath)
    finally:
        ipc_wait.uninstall()
    assert (shm_broadcast.MessageQueue.enqueue, shm_broadcast.SpinCondition.notify) == (vllm_enqueue, vllm_notify)
