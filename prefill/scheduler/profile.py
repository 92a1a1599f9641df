"""Profile recompute and swap latency on this machine and save the model `cost` eviction uses.

    python -m prefill.scheduler.profile [--config configs/config.yaml] [--out profiles/<model>.json]

Recompute: one-token prefills of fresh random prompts (no prefix-cache help) of growing length, through the
engine as requests run. Swap: copies of growing numbers of blocks to the host pool and back, inside the
workers (the same code path as an eviction). Replicas load the file named in `prefill.scheduler.cost_model`,
or profile themselves at start-up (`profile_on_start`, or `eviction: cost` with no file); a replica like one
that profiled on this node within a day loads that profile instead (prefill/scheduler/profile_cache.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from pathlib import Path
from typing import Any

from core.scheduler_config import SchedulerSettings
from prefill.scheduler import profile_cache
from prefill.scheduler.cost_model import Fit, LatencyModel

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


async def profile(engine: Any, repeats: int = 3) -> LatencyModel:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = engine.client.model_config.get_vocab_size()
    rng = random.Random(0)
    limit = min(engine.max_model_len - 1, 8192)
    sizes = [n for n in (engine.block_size * 2**k for k in range(8)) if n <= limit]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    recompute: dict[int, list[float]] = {}
    for i, n in enumerate([sizes[0], *sizes]):  # the first run warms the engine up and is dropped
        for r in range(repeats):
            prompt = TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(n)])
            started = time.perf_counter()
            async for _ in engine.client.generate(prompt, params, f"rtpd-profile-{i}-{r}"):
                pass
            if i:
                recompute.setdefault(n, []).append(time.perf_counter() - started)
    stats = await engine.compute_stats()
    slots = stats["scheduler"]["host_slots"]
    block_limit = min(slots, stats["kv_blocks_total"] - 1)
    block_sizes = [n for n in (2**k for k in range(12)) if n <= block_limit]
    swap = await engine.utility("rtpd_profile_swap", block_sizes, repeats + 2) if block_sizes else {}
    drop_first = {name: {int(n): ts[2:] or ts for n, ts in samples.items()} for name, samples in swap.items()}
    model = LatencyModel(
        recompute=Fit.of(recompute),
        swap_out=Fit.of(drop_first.get("swap_out") or {0: [0.0]}),
        swap_in=Fit.of(drop_first.get("swap_in") or {0: [0.0]}),
        metadata={
            "model": engine.app.model,
            "block_size": engine.block_size,
            "block_bytes": stats["scheduler"]["block_bytes"],
            "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    logger.info("profiled latency model: %s", model.to_json())
    return model


async def start_scheduler(engine: Any, settings: SchedulerSettings) -> None:
    """Hand a started prefill engine's streaming scheduler its workers (swap) and, for `cost` eviction, its
    latency model (prefill/server.py, once the engine is up)."""
    await engine.utility("rtpd_attach")
    if settings.cost_model or settings.profile_on_start or settings.eviction == "cost":
        model = await load_or_profile(engine, settings)
        await engine.utility("rtpd_set_latency_model", model.to_json())


async def load_or_profile(engine: Any, settings: SchedulerSettings) -> LatencyModel:
    if settings.cost_model and not settings.profile_on_start:
        path = Path(settings.cost_model)
        return LatencyModel.load(path if path.is_absolute() else ROOT / path)
    name = profile_cache.key(engine, (await engine.compute_stats())["scheduler"])
    if not settings.profile_on_start and (saved := profile_cache.load(name)) is not None:
        logger.info("latency model of %s loaded from this node's profile %s", saved.metadata.get("profiled_at"), name)
        return saved
    model = await profile(engine)
    profile_cache.save(name, model)
    return model


def main() -> None:
    import yaml

    from core.config import AppConfig
    from engine.llm import Engine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "config.yaml"))
    parser.add_argument("--out", default=None, help="default: profiles/<model>.json")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    raw = yaml.safe_load(Path(args.config).read_text())
    app = AppConfig.model_validate(raw["applications"][0]["args"] if "applications" in raw else raw)
    settings = {"eviction": "recompute", "cost_model": None, "profile_on_start": False}
    app.prefill.scheduler = app.prefill.scheduler.model_copy(update=settings)

    async def run() -> LatencyModel:
        engine = Engine(app, "prefill")
        await engine.start()
        await start_scheduler(engine, app.prefill.scheduler)  # (recompute, no model: attaches the workers)
        try:
            return await profile(engine, args.repeats)
        finally:
            engine.shutdown()

    model = asyncio.run(run())
    out = Path(args.out or ROOT / "profiles" / f"{app.model.replace(':', '-').replace('/', '--')}.json")
    model.save(out)
    fits = (("recompute (tokens)", model.recompute), ("swap out (blocks)", model.swap_out), ("swap in", model.swap_in))
    for name, fit in fits:
        print(f"{name}: " + ", ".join(f"{x}: {1e3 * sum(ys) / len(ys):.2f} ms" for x, ys in fit.samples.items()))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
