"""bench/idle_threads.py: an idle app's processes found by their titles, and their threads read and sorted."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time

import idle_threads


def test_the_apps_processes_are_found_by_their_titles() -> None:
    titles = ["ray::ServeReplica:idle-test:router", "VLLM::EngineCore"]
    procs = [subprocess.Popen(["bash", "-c", f'exec -a "{t}" sleep 30']) for t in titles]
    try:
        deadline = time.time() + 10
        want = {"replica router": procs[0].pid, f"EngineCore {procs[1].pid}": procs[1].pid}
        while want.items() - (found := idle_threads.processes("idle-test")).items():
            assert time.time() < deadline, found
            time.sleep(0.1)
        assert not any(label.startswith("replica") and pid != procs[0].pid for label, pid in found.items())
    finally:
        for p in procs:
            p.kill()


def test_a_threads_cpu_and_wakes_are_read_and_its_kind_named() -> None:
    stop, started = threading.Event(), threading.Event()

    def wake_every_10_ms() -> None:
        ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop", 0, 0, 0)  # PR_SET_NAME: the name /proc shows
        started.set()
        while not stop.wait(0.01):
            pass

    waker = threading.Thread(target=wake_every_10_ms)
    waker.start()
    started.wait()
    try:
        before = idle_threads.threads(os.getpid())
        time.sleep(0.5)
        after = idle_threads.threads(os.getpid())
    finally:
        stop.set()
        waker.join()
    tid = waker.native_id
    assert after[tid].name == "gloo_tcp_loop"
    assert after[tid].wakes - before[tid].wakes >= 20  # ~50 in half a second
    pid = os.getpid()
    assert idle_threads.kind(pid, pid, "ray::ServeReplica", set()) == "ray main"
    assert idle_threads.kind(pid, pid + 1, "ray::IDLE", {pid + 1}) == "event loop"
    assert idle_threads.kind(pid, tid, after[tid].name, set()) == "gloo loop"
    assert idle_threads.kind(pid, pid + 3, "worker.io", set()) == "ray threads"
    assert idle_threads.kind(pid, pid + 4, "ZMQbg/IO/0", set()) == "other"
