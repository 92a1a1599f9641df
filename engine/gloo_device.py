"""One gloo device for every process group of an engine's worker, instead of one per group.

vLLM's worker makes about a dozen torch.distributed process groups (world, tensor/pipeline/data/expert parallel,
each with a CPU group), gloo-backed on CPU, even at world size 1. PyTorch gives each gloo group a device of its
own, and each device runs a TCP loop thread that wakes every 10 ms (gloo's `epoll_wait` timeout) whether or not
anything is sent: 13 threads per worker here, ~1% of a core per idle worker, ~3% for the app's three engines. Gloo
devices are made to be shared by contexts (PyTorch passes them in `ProcessGroupGloo.Options`): with one, each
worker has one such thread.

Installed in the engine worker processes (`engine.llm`'s worker entry point) before vLLM makes its groups.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

_installed = False


def install() -> bool:
    """Make every gloo process group this process creates from now on share one device (idempotent). False when
    this PyTorch's gloo group takes no options (its own devices stay)."""
    global _installed
    if _installed:
        return True
    from torch.distributed import distributed_c10d as c10d

    gloo = getattr(c10d, "ProcessGroupGloo", None)
    if gloo is None or not hasattr(gloo, "_Options") or not hasattr(gloo, "create_default_device"):
        return False
    shared: list[Any] = []

    class SharedDeviceGloo(gloo):  # type: ignore[misc,valid-type]
        """A gloo group on the process's one device (the constructor `distributed_c10d` calls, same arguments)."""

        def __init__(
            self, store: Any, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30)
        ) -> None:
            if not shared:
                shared.extend(_devices(gloo))
            options = gloo._Options()
            options._devices = list(shared)
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
    _installed = True
    return True


def _devices(gloo: Any) -> list[Any]:
    """The devices PyTorch would make for each group: one per interface named in `GLOO_SOCKET_IFNAME`, else the
    default (the host name's address), lazily connected if `TORCH_GLOO_LAZY_INIT` says so."""
    lazy = os.environ.get("TORCH_GLOO_LAZY_INIT", "").lower() in ("1", "true")
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if names:
        return [gloo.create_device(interface=name, lazy_init=lazy) for name in names]
    return [gloo.create_device(lazy_init=lazy)] if lazy else [gloo.create_default_device()]
