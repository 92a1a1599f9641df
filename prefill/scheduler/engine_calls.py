"""The frontend's calls into the prefill engine core: EngineCore utility methods (dispatched by name, the
channel vLLM uses for its own utilities), added here and reached with `Engine.utility("rtpd_...")`.

Imported by prefill/scheduler/core.py, which vLLM imports in the engine-core process when it resolves
`scheduler_cls`, so the methods exist exactly where they are called.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import EngineCore

from prefill.scheduler.cost_model import LatencyModel


def _scheduler(core: EngineCore) -> Any:
    if not hasattr(core.scheduler, "invalidate"):
        raise RuntimeError("the engine does not run the streaming scheduler")
    return core.scheduler


def _rtpd_attach(self: EngineCore) -> dict[str, Any]:
    return _scheduler(self).attach(self.model_executor)


def _rtpd_configure(self: EngineCore, changes: dict[str, Any]) -> dict[str, Any]:
    return _scheduler(self).configure(changes)


def _rtpd_set_latency_model(self: EngineCore, model: dict[str, Any]) -> None:
    _scheduler(self).latency = LatencyModel.from_json(model)


def _rtpd_invalidate(self: EngineCore, session_key: str, keep: int) -> tuple[int, int] | None:
    """(tokens kept, chunks in flight ended without output), or None: see StreamingScheduler.invalidate."""
    cut = _scheduler(self).invalidate(session_key, keep)
    return None if cut is None else (cut.kept, cut.ended_chunks)


def _rtpd_input_ended(self: EngineCore, session_key: str) -> bool:
    return _scheduler(self).input_ended(session_key)


def _rtpd_profile_swap(self: EngineCore, sizes: list[int], repeats: int) -> dict[str, dict[int, list[float]]]:
    """Time swap-out and swap-in of `n` blocks for each n: the blocks are copied out and the same bytes
    copied back, so whatever they hold is unchanged."""
    scheduler = _scheduler(self)
    out: dict[int, list[float]] = {}
    back: dict[int, list[float]] = {}
    for n in sizes:
        slots = scheduler.host.alloc(n)
        if slots is None:
            break
        blocks = list(range(1, n + 1))  # block 0 is vLLM's null block
        for _ in range(repeats):
            out.setdefault(n, []).append(self.model_executor.collective_rpc("rtpd_swap_out", args=(blocks, slots))[0])
            back.setdefault(n, []).append(self.model_executor.collective_rpc("rtpd_swap_in", args=(slots, blocks))[0])
        scheduler.host.free(slots)
    return {"swap_out": out, "swap_in": back}


for _name, _fn in list(globals().items()):
    if _name.startswith("_rtpd_"):
        setattr(EngineCore, _name[1:], _fn)
