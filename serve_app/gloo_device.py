"""One gloo device for every process group of an engine's worker, instead of one per group.

vLLM's worker makes about a dozen torch.distributed process groups (world, tensor/pipeline/data/expert parallel,
each with a CPU group), gloo-backed on CPU, even at world size 1. PyTorch gives each gloo group a device of its
own, and each device runs a TCP loop thread that wakes every 10 ms (gloo's `epoll_wait` timeout) whether or not
anything is sent: 13 threads per worker here, ~1% of a core per idle worker, ~3% for the app's three engines. Gloo
devices are made to be shared by contexts (PyTorch passes them in `ProcessGroupGloo.Options`): with one, each
worker has one such thread.

Installed in the engine worker processes (`serve_app.engine`'s worker entry point) before vLLM makes its groups.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

logger = logging.getLogger(__name__)
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
                shared.append(gloo.create_default_device())
            options = gloo._Options()
            options._devices = [shared[0]]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
    _installed = True
    return True
