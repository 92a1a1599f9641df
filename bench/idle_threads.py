"""Where an idle app's CPU goes, thread by thread: each of its processes' threads' share of a core and wakes a second.

Run it beside an app that `make run` (or any `serve run` of this project's config) serves and nobody uses. It finds
the app's processes on this machine by their titles (`ray::ServeReplica:<app>:<role>`, vLLM's `VLLM::EngineCore`
and `VLLM::Worker`, HAProxy), reads `/proc/<pid>/task/*` twice, `--seconds` apart, and groups each process's
threads by what runs them:

- `ray main`: the replica's main thread, Ray's task loop (its signal check wakes it every 10 ms, hard-coded);
- `event loop`: the replica's asyncio loop, where this app's code and Serve's request handling run;
- `ray threads`: Ray's core worker's io, gRPC and poll threads;
- `gloo loop`: an engine worker's gloo TCP loop (`epoll_wait` every 10 ms, hard-coded in gloo);
- `other`: every other thread (vLLM's, torch's, ZMQ's).

    .venv/bin/python bench/idle_threads.py [--seconds 60] [--app realtime-pd] [--tag idle_threads]

Writes `bench/results/<tag>.md` and `.json` (bench/record.py).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from record import command, write

HZ = os.sysconf("SC_CLK_TCK")
RAY_THREADS = ("worker.io", "poll", "event_engine", "grpc", "default-executo", "timer")


@dataclass
class Sample:
    name: str
    ticks: int  # user + system clock ticks
    wakes: int  # voluntary + involuntary context switches


def threads(pid: int) -> dict[int, Sample]:
    """tid -> its sample; empty once the process is gone."""
    out: dict[int, Sample] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # (a thread that ended)
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        kv = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        wakes = int(kv["voluntary_ctxt_switches"]) + int(kv["nonvoluntary_ctxt_switches"])
        out[int(tid)] = Sample(kv["Name"].strip(), int(fields[11]) + int(fields[12]), wakes)
    return out


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process on this machine."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        table[int(entry)] = (int(stat[stat.rfind(")") + 2 :].split()[1]), line)
    return table


def _ancestors(pid: int, table: dict[int, tuple[int, str]]) -> list[str]:
    """The command lines of `pid`'s parent, its parent's, ... (at most 8)."""
    lines: list[str] = []
    while (pid := table.get(pid, (0, ""))[0]) in table and len(lines) < 8:
        lines.append(table[pid][1])
    return lines


def processes(app: str) -> dict[str, int]:
    """label -> pid of the app's processes: its replicas by role, the engine cores and workers they started (by
    parentage: another cluster's or a plain vLLM server's engines are not counted), and HAProxy (Serve's HAProxy
    manager's). Two replicas of one role are told apart by their pids."""
    table = _table()
    prefix = f"ray::ServeReplica:{app}:"
    replicas = {
        pid: line[len(prefix) :].split()[0].split(".")[0] for pid, (_, line) in table.items() if line.startswith(prefix)
    }
    cores = {
        pid: replicas[parent]
        for pid, (parent, line) in table.items()
        if line.startswith("VLLM::EngineCore") and parent in replicas
    }
    workers = {
        pid: cores[parent]
        for pid, (parent, line) in table.items()
        if line.startswith("VLLM::Worker") and parent in cores
    }
    found: dict[str, int] = {}
    for kind_, members in (("replica", replicas), ("engine core", cores), ("engine worker", workers)):
        for pid, role in sorted(members.items()):
            many = sum(r == role for r in members.values()) > 1
            found[f"{kind_} {role}" + (f" {pid}" if many else "")] = pid
    for pid, (_, line) in table.items():
        ours = line and os.path.basename(line.split()[0]) == "haproxy"
        if ours and any(a.startswith("ray::HAProxyManager") for a in _ancestors(pid, table)):
            found[f"haproxy {pid}"] = pid
    return found


def kind(pid: int, tid: int, name: str, loop_tids: set[int]) -> str:
    if tid == pid:
        return "ray main" if name.startswith("ray::") else "main"
    if tid in loop_tids:
        return "event loop"
    if name.startswith("gloo"):
        return "gloo loop"
    if any(part in name for part in RAY_THREADS):
        return "ray threads"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--app", default="realtime-pd", help="the Serve application's name")
    parser.add_argument("--tag", default="idle_threads", help="results file prefix")
    args = parser.parse_args()
    procs = processes(args.app)
    if not procs:
        raise SystemExit(f"no process of app {args.app!r} runs here: start it first (`make run`)")
    before = {label: threads(pid) for label, pid in procs.items()}
    t0 = time.monotonic()
    time.sleep(args.seconds)
    elapsed = time.monotonic() - t0
    after = {label: threads(pid) for label, pid in procs.items()}
    rows: list[dict[str, Any]] = []
    for label, pid in procs.items():
        # A Ray replica's asyncio loop runs in a thread Ray names after the actor's idle state (`ray::IDLE`).
        loops = {
            tid
            for snapshot in (before[label], after[label])
            for tid, s in snapshot.items()
            if s.name == "ray::IDLE" or s.name.startswith("AsyncIO")
        }
        by_kind: dict[str, list[float]] = {}
        for tid, end in after[label].items():
            start = before[label].get(tid)
            if start is None:
                continue
            cpu = (end.ticks - start.ticks) / HZ / elapsed * 100
            wakes = (end.wakes - start.wakes) / elapsed
            entry = by_kind.setdefault(kind(pid, tid, end.name, loops), [0.0, 0.0])
            entry[0] += cpu
            entry[1] += wakes
        for k, (cpu, wakes) in sorted(by_kind.items()):
            rows.append({"process": label, "threads": k, "pct_core": round(cpu, 3), "wakes_per_s": round(wakes, 1)})
    total = sum(r["pct_core"] for r in rows)
    by_threads: dict[str, float] = {}
    for r in rows:
        by_threads[r["threads"]] = by_threads.get(r["threads"], 0.0) + r["pct_core"]
    table = [
        f"# An idle app's CPU by thread ({time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())})",
        "",
        f"Command: `{command()}`, {args.seconds:.0f} s, {os.cpu_count()} CPUs. % of one core; wakes: context "
        "switches a second.",
        "",
        "| process | threads | % of a core | wakes/s |",
        "|---|---|---|---|",
        *(f"| {r['process']} | {r['threads']} | {r['pct_core']:.2f} | {r['wakes_per_s']:.0f} |" for r in rows),
        "",
        f"Total {total:.2f}% of a core: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_threads.items(), key=lambda kv: -kv[1])),
    ]
    write(args.tag, table, {"command": command(), "seconds": args.seconds, "rows": rows, "by_threads": by_threads})


if __name__ == "__main__":
    main()
