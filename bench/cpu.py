"""CPU seconds of a served system's processes over one benchmark level (psutil).

Processes are found among this benchmark's own descendants (Ray's raylet and its workers, vLLM's engine
cores, a plain server's process group) by a substring of their command line, e.g. Ray's process title
`ray::ServeReplica:<app>:router` or `ray::ProxyActor`, so another Ray cluster on the machine is never counted.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psutil


def descendants(root: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(root or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _cmdline(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline()) or p.name()
    return ""


def find_roles(patterns: dict[str, str | tuple[str, ...]], root: int | None = None) -> dict[str, list[psutil.Process]]:
    """role -> processes whose command line contains the role's pattern, or one of its patterns (first matching
    role wins)."""
    roles: dict[str, list[psutil.Process]] = {role: [] for role in patterns}
    for p in descendants(root):
        line = _cmdline(p)
        role = next((r for r, pattern in patterns.items() if _matches(line, pattern)), None)
        if role is not None:
            roles[role].append(p)
    return roles


def _matches(line: str, pattern: str | tuple[str, ...]) -> bool:
    return any(one in line for one in ((pattern,) if isinstance(pattern, str) else pattern))


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class CpuMeter:
    """CPU seconds per role, and busy share per core, between `start()` and `stop()`."""

    def __init__(self, roles: dict[str, list[psutil.Process]]) -> None:
        self.roles = roles

    def start(self) -> None:
        self._me = psutil.Process()
        self._mine = descendants()  # everything this run started (Ray's own processes included)
        self._t0 = time.perf_counter()
        self._cpu0 = {role: cpu_s(procs) for role, procs in self.roles.items()}
        self._cpu0 |= {"_client": cpu_s([self._me]), "_mine": cpu_s(self._mine)}
        self._cores0 = psutil.cpu_times(percpu=True)

    def stop(self, output_tokens: int) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        cores1 = psutil.cpu_times(percpu=True)
        out: dict[str, Any] = {"wall_s": wall, "roles": {}}
        for role, procs in self.roles.items():
            used = cpu_s(procs) - self._cpu0[role]
            out["roles"][role] = {
                "processes": len(procs),
                "cpu_s": used,
                "pct_core": 100 * used / wall if wall > 0 else None,
                "ms_per_1k_tokens": 1e6 * used / output_tokens if output_tokens else None,
            }
        busy = []
        for a, b in zip(self._cores0, cores1, strict=True):
            total = sum(b) - sum(a)
            busy.append(100 * (1 - (b.idle - a.idle) / total) if total > 0 else None)
        out["core_busy_pct"] = busy
        # The benchmark's own client (this process), and what ran outside this run (another user's work).
        client = cpu_s([self._me]) - self._cpu0["_client"]
        mine = client + cpu_s(self._mine) - self._cpu0["_mine"]
        out["client_pct_core"] = 100 * client / wall if wall > 0 else None
        known = [b for b in busy if b is not None]
        out["outside_pct_core"] = max(0.0, sum(known) - 100 * mine / wall) if wall > 0 and known else None
        return out


def thread_cpus(pid: int) -> list[str]:
    """The distinct CPU lists its threads may run on (an OpenMP-bound engine shows its core here)."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    lists.add(line.split(":", 1)[1].strip())
    return sorted(lists)


def describe(roles: dict[str, list[psutil.Process]]) -> dict[str, list[str]]:
    """role -> `pid cmdline [threads on CPUs ...]` of each process, for the results file."""
    return {
        role: [f"{p.pid} {_cmdline(p).strip()[:100]} [threads on CPUs {' | '.join(thread_cpus(p.pid))}]" for p in procs]
        for role, procs in roles.items()
    }
