"""engine/gloo_device.py: every gloo group of a process on one device: one TCP loop thread, collectives work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from core.ports import free_ports

SCRIPT = textwrap.dedent(
    """
    import glob, json, os, sys, time
    import torch, torch.distributed as dist
    from engine import gloo_device
    if sys.argv[2] == "shared":
        assert gloo_device.install() and gloo_device.install()  # (idempotent)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    groups = [dist.new_group([0], backend="gloo") for _ in range(6)]
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.all_reduce(t, group=groups[2])
    dist.barrier(group=groups[5])
    time.sleep(0.5)
    names = [open(p).read().strip() for p in glob.glob(f"/proc/{os.getpid()}/task/*/comm")]
    print(json.dumps({"loops": names.count("gloo_tcp_loop"), "sum": t.tolist()}))
    """
)


def run(mode: str, env: dict[str, str] | None = None) -> dict[str, object]:
    (port,) = free_ports(1)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(port), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_gloo_group_shares_one_device_and_its_collectives_work() -> None:
    own, shared = run("own"), run("shared")
    assert own["loops"] == 7  # PyTorch's default: a TCP loop thread (waking every 10 ms) per group
    assert shared["loops"] == 1
    assert shared["sum"] == own["sum"] == [1.0, 1.0, 1.0]


def test_the_shared_device_binds_the_interface_gloo_socket_ifname_names() -> None:
    """An operator's `GLOO_SOCKET_IFNAME` (the interface the groups must use across nodes) still holds."""
    shared = run("shared", {"GLOO_SOCKET_IFNAME": "lo"})
    assert shared["loops"] == 1 and shared["sum"] == [1.0, 1.0, 1.0]
