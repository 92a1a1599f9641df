"""Drive the real StreamingScheduler over a real (small) vLLM KV cache manager, with no engine processes.

A `Harness` builds a `VllmConfig` on the project's local tiny model, a `KVCacheConfig` of a handful of
16-token blocks (block 0 is vLLM's null block, so `num_blocks=13` gives 12 usable ones), and the scheduler
exactly as the engine core constructs it. A step is `schedule()` then `update_from_output()` with one
sampled token for every request that finished its prefill: with `max_tokens=1`, a streaming-input request
then waits for its next chunk (WAITING_FOR_STREAMING_REQ) holding its blocks, and a complete one finishes.

With `swap_slots`, the scheduler is attached to a fake executor whose `collective_rpc` runs a real
`HostKVPool` over real per-layer KV tensors shaped like the CPU backend's
`(2, num_blocks, num_kv_heads, block_size, head_size)`.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from engine.kv_copy import HostKVPool, copy_blocks
from local_models.llm import make_local_model
from prefill.scheduler.core import StreamingScheduler

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_KV_HEADS, HEAD_SIZE = 2, 64  # models/tiny-llama
SAMPLED = 7  # the token every finished prefill samples
IDLE = RequestStatus.WAITING_FOR_STREAMING_REQ


class FakeClock:
    """Stands in for the `time` module inside prefill.scheduler.core: `time()` is a controllable clock
    (session arrival and chunk arrival), `monotonic()` stays real."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return time.monotonic()

    def advance(self, dt: float = 1.0) -> float:
        self.now += dt
        return self.now


class FakeExecutor:
    """The executor as the scheduler sees it: `collective_rpc` into one worker's swap methods."""

    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks
        self.pool: HostKVPool | None = None
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append((method, args))
        if method == "rtpd_copy_blocks":
            return [copy_blocks(self.kv_caches, self.num_blocks, *args)]
        if method == "rtpd_swap_init":
            self.pool = HostKVPool(self.kv_caches, self.num_blocks, *args)
            return [self.pool.block_bytes]
        assert self.pool is not None, f"{method} before rtpd_swap_init"
        if method == "rtpd_swap_out":
            return [self.pool.swap_out(*args)]
        if method == "rtpd_swap_in":
            return [self.pool.swap_in(*args)]
        raise AssertionError(f"unexpected collective_rpc {method}")


def _model_config(max_model_len: int) -> ModelConfig:
    return ModelConfig(model=str(make_local_model()), dtype="float32", max_model_len=max_model_len, seed=0)


class Harness:
    def __init__(
        self,
        clock: FakeClock,
        *,
        policy: str = "fcfs",
        eviction: str = "recompute",
        num_blocks: int = 13,
        budget: int = 64,
        max_num_seqs: int = 16,
        max_model_len: int = 1024,
        swap_slots: int = 0,
        scheduler: dict[str, Any] | None = None,
        async_scheduling: bool = False,
        **settings: Any,
    ) -> None:
        self.clock = clock
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
        page = spec.page_size_bytes
        block_bytes = page * len(LAYERS)
        rtpd = {"policy": policy, "eviction": eviction, "swap_gb": swap_slots * block_bytes / 2**30, **settings}
        cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        vllm_config = VllmConfig(
            model_config=_model_config(max_model_len),
            cache_config=cache_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                **(scheduler or {}),
            ),
            additional_config={"rtpd_scheduler": rtpd},
        )
        cache_config.num_gpu_blocks = num_blocks
        if async_scheduling:  # what vLLM decides on CUDA (the CPU platform forces it off while building the config)
            vllm_config.scheduler_config.async_scheduling = True
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(size=page * num_blocks, layers=[layer], layer_stride=page * num_blocks, block_stride=page)
                for layer in LAYERS
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.sched = StreamingScheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            hash_block_size=BLOCK,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.rng = random.Random(0)
        self.kv: list[torch.Tensor] = []
        self.executor: FakeExecutor | None = None
        if swap_slots:
            gen = torch.Generator().manual_seed(0)
            shape = (2, num_blocks, NUM_KV_HEADS, BLOCK, HEAD_SIZE)
            self.kv = [torch.randn(shape, generator=gen) for _ in LAYERS]
            self.executor = FakeExecutor(self.kv, num_blocks)
            self.attach_info = self.sched.attach(self.executor)
        self.scheduled: list[dict[str, int]] = []  # num_scheduled_tokens of every step

    # --- requests ------------------------------------------------------------------------------------
    def tokens(self, n: int) -> list[int]:
        """Fresh random token ids: distinct sequences share no 16-token block."""
        return [self.rng.randrange(10, 2000) for _ in range(n)]

    def request(
        self,
        rid: str,
        tokens: list[int] | int,
        *,
        resumable: bool = True,
        session: str | None = None,
        arrival: float | None = None,
        preemptive: bool = False,
        priority: int = 0,
    ) -> Request:
        ids = self.tokens(tokens) if isinstance(tokens, int) else list(tokens)
        arrival = self.clock.now if arrival is None else arrival
        args: dict[str, Any] = {"rtpd_session": session or rid, "rtpd_arrival": arrival}
        if preemptive:
            args["rtpd_preemptive"] = True
        params = SamplingParams(max_tokens=1, extra_args=args)
        return Request(
            rid,
            ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
            resumable=resumable,
            arrival_time=arrival,
            priority=priority,
        )

    def add(self, rid: str, tokens: list[int] | int, **kwargs: Any) -> Request:
        """Add a request (or, for an existing streaming id, its next chunk); the clock moves on by 1 s."""
        self.clock.advance()
        self.sched.add_request(self.request(rid, tokens, **kwargs))
        return self.sched.requests[rid]

    # --- steps ---------------------------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        done = {
            rid for rid in ids if self.sched.requests[rid].num_computed_tokens >= self.sched.requests[rid].num_tokens
        }
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[SAMPLED] if rid in done else [] for rid in ids],
        )
        self.sched.update_from_output(out, mro)
        self.scheduled.append(dict(out.num_scheduled_tokens))
        return out

    def run(self, max_steps: int = 50) -> list[dict[str, int]]:
        """Step until nothing is scheduled; returns what each step scheduled."""
        steps = []
        for _ in range(max_steps):
            out = self.step()
            if not out.num_scheduled_tokens:
                return steps
            steps.append(dict(out.num_scheduled_tokens))
        raise AssertionError(f"still scheduling after {max_steps} steps: {steps[-3:]}")

    # --- inspection ----------------------------------------------------------------------------------
    def blocks(self, rid: str) -> list[int]:
        return self.sched._block_ids(self.sched.requests[rid])

    def free(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def counters(self) -> dict[str, Any]:
        return self.sched.compute_stats()["scheduler"]

    def status(self, rid: str) -> RequestStatus:
        return self.sched.requests[rid].status

    def block_contents(self, block_ids: list[int]) -> list[torch.Tensor]:
        return [t[:, block_ids].clone() for t in self.kv]

    def scribble(self, block_ids: list[int]) -> None:
        """Overwrite device blocks, as the model would when they are reused."""
        for t in self.kv:
            t[:, block_ids] = -1.0


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / BLOCK)
