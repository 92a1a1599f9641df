"""A node's saved latency profiles, so that a prefill replica starting beside another of the same kind loads
the profile instead of profiling again (~12 s of start-up on two CPU cores, more while other engines start).

A profile is kept under a key made of everything its latencies depend on: the model, the KV layout (block size,
bytes per block, host swap slots), the engine's dtype and length limit, the vLLM and torch versions, and the
hardware (accelerator name, or CPU model, core count and the cores the engine is bound to). It is used for a
day; a replica configured with `profile_on_start` always profiles afresh (and refreshes the saved one).
`RTPD_PROFILE_CACHE` names the folder (default `~/.cache/rtpd/profiles`; empty: no cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from prefill.scheduler.cost_model import LatencyModel

logger = logging.getLogger(__name__)
MAX_AGE_S = 24 * 3600.0


def folder() -> Path | None:
    configured = os.environ.get("RTPD_PROFILE_CACHE")
    if configured is not None:
        return Path(configured) if configured else None
    return Path.home() / ".cache" / "rtpd" / "profiles"


def _hardware() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        return {"accelerator": torch.cuda.get_device_name(), "count": torch.cuda.device_count()}
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}


def key(engine: Any, scheduler_stats: dict[str, Any]) -> str:
    """What the profile of this started engine depends on, hashed."""
    import torch
    import vllm

    model_config = engine.client.model_config
    facts = {
        "model": str(model_config.model),
        "dtype": str(model_config.dtype),
        "max_model_len": engine.max_model_len,
        "block_size": engine.block_size,
        "block_bytes": scheduler_stats.get("block_bytes"),
        "host_slots": scheduler_stats.get("host_slots"),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        **_hardware(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load(name: str) -> LatencyModel | None:
    """The saved profile under `name`, if there is one under a day old that reads back."""
    if (where := folder()) is None:
        return None
    path = where / f"{name}.json"
    try:
        if time.time() - path.stat().st_mtime > MAX_AGE_S:
            return None
        return LatencyModel.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # (none yet, or one a crash cut short: profile again)


def save(name: str, model: LatencyModel) -> None:
    """Keep a profile (written whole, then renamed: a replica reading at the same time never sees half)."""
    if (where := folder()) is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(model.to_json()))
        tmp.replace(where / f"{name}.json")
    except OSError:
        logger.warning("could not save the latency profile under %s", where, exc_info=True)
