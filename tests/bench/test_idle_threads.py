"""bench/idle_threads.py: an idle app's processes found by their titles, and their threads read and sorted."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time

import idle_threads
import psutil


def _replica(role: str, engine: bool = True) -> subprocess.Popen[bytes]:
    """A process titled as a replica of app `idle-test`, with (if `engine`) an engine-core child, as vLLM's is."""
    title = f"ray::ServeReplica:idle-test:{role}"
    if not engine:
        return subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 30'])
    return subprocess.Popen(["bash", "-c", f'exec -a "{title}" bash -c "(exec -a VLLM::EngineCore sleep 30) & wait"'])


def _wait_found(want: dict[str, int]) -> dict[str, int]:
    deadline = time.time() + 10
    while want.items() - (found := idle_threads.processes("idle-test")).items():
        assert time.time() < deadline, (want.items() - found.items(), found)
        time.sleep(0.1)
    return found


def _engine_of(replica: subprocess.Popen[bytes]) -> int:
    deadline = time.time() + 10
    while not (children := psutil.Process(replica.pid).children()):
        assert time.time() < deadline
        time.sleep(0.05)
    return children[0].pid


def test_the_apps_processes_are_found_by_their_titles_and_parentage() -> None:
    stray = subprocess.Popen(["bash", "-c", 'exec -a "VLLM::EngineCore" sleep 30'])  # another server's engine
    procs = [_replica("router", engine=False), _replica("prefill"), _replica("prefill")]
    try:
        engines = [_engine_of(p) for p in procs[1:]]
        found = _wait_found(
            {
                "replica router": procs[0].pid,
                f"replica prefill {procs[1].pid}": procs[1].pid,  # (two of a role: told apart by their pids)
                f"replica prefill {procs[2].pid}": procs[2].pid,
                f"engine core prefill {engines[0]}": engines[0],
                f"engine core prefill {engines[1]}": engines[1],
            }
        )
        assert stray.pid not in found.values()
        assert len([label for label in found if label.startswith(("replica", "engine"))]) == 5
    finally:
        for p in (stray, *procs):
            for child in psutil.Process(p.pid).children():
                child.kill()
            p.kill()


def test_a_run_reports_each_process_and_goes_on_when_one_ends(monkeypatch) -> None:
    procs = [_replica("router", engine=False), _replica("decode")]
    written: list[tuple[str, list[str], dict]] = []
    try:
        engine = _engine_of(procs[1])
        _wait_found({"replica router": procs[0].pid, "engine core decode": engine})

        def sleep(_s: float) -> None:  # the window: the engine ends in it
            psutil.Process(engine).kill()
            psutil.Process(engine).wait(5)

        monkeypatch.setattr(idle_threads.time, "sleep", sleep)
        monkeypatch.setattr(idle_threads, "write", lambda *args: written.append(args))
        monkeypatch.setattr("sys.argv", ["idle_threads.py", "--app", "idle-test", "--seconds", "1"])
        idle_threads.main()
    finally:
        for p in procs:
            p.kill()
    rows = written[0][2]["rows"]
    assert {r["process"] for r in rows} >= {"replica router", "replica decode"}
    assert not any(r["process"].startswith("engine core") for r in rows)  # (gone: no row, no crash)
    assert {r["threads"] for r in rows if r["process"] == "replica router"} == {"main"}  # (bash is no Ray worker)


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
