"""Starts the real application once per test session: Ray Serve, a prefill and a decode vLLM engine with
NIXL between them, on the local model. Every integration test talks to it over HTTP/WebSocket, and reads
engine statistics through the deployments' handles."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from ray import serve

ROOT = Path(__file__).resolve().parents[2]
APP = "realtime-pd"
TEST_DRAINING_PERIOD_S = 3
TEST_MAX_WAIT_S = 5.0
PORT = int(os.environ.get("RTPD_TEST_PORT", "8765"))
METRICS_PORT = int(os.environ.get("RTPD_TEST_METRICS_PORT", "8767"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "long: past `make test`'s 25-minute budget; `make test-long` runs it (with the long hardening modes)"
    )


def for_tests(args: dict[str, Any]) -> dict[str, Any]:
    """The engines of a test app run eager (no torch.compile): on two cores, compiling the model takes 30-80 s of
    each of the ~20 engine starts of a run, and the tests exercise this project's code, not vLLM's compiler (the
    reference engine runs eager too, so greedy outputs still compare token for token). RTPD_TEST_COMPILE=1 keeps
    the shipped setting."""
    if not os.environ.get("RTPD_TEST_COMPILE"):
        args.setdefault("engine", {})["enforce_eager"] = True
    # New work past capacity waits this long at most before its 429 / 1013 (the shipped 30 s: tests would wait it)
    args.setdefault("router", {}).setdefault("admission", {})["max_wait_s"] = TEST_MAX_WAIT_S
    return args


def app_args(speech: bool = False) -> dict[str, Any]:
    """The default config's args (what `make run` serves), so the tests exercise the shipped config (engines
    eager: `for_tests`). Without its speech and TTS roles unless asked: a third engine starts only for the voice tests
    (and the main app is the one that refuses audio output)."""
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    args = config["applications"][0]["args"]
    if not speech:
        args.pop("speech", None)
        args["tts"] = {"backend": None}
    # Every session's answer handed off over NIXL, however short its input (the tests' inputs are): what most
    # session tests are about. The tools-and-voice app keeps the shipped limit (`tools_args`).
    args["router"]["disaggregation"]["min_session_prompt_tokens"] = 0
    # Every text answer two tokens a frame (decode/pacing.py; the shipped config does so from 16 streams): the SSE
    # contract, realtime deltas and mid-answer resumes (faults/) are checked on frames of several tokens.
    args.setdefault("decode", {})["pacing"] = {"min_streams": 1, "tokens": 2}
    return for_tests(args)


def wait_healthy(base: str, timeout: float) -> None:
    """Until the app at `base` answers /health (serve.run returns before the proxy routes to it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def apply_serve_env() -> None:
    """The Serve settings `make run` uses (inherited by every Ray process started after), with a test's draining
    period: behind HAProxy a stopping router replica stays reachable this long before it drains, so that load
    balancers deregister it (Ray's default 30 s); every app a test deletes, redeploys or shuts down would wait it
    out."""
    from serve_app import serve_env

    serve_env.apply()
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", str(TEST_DRAINING_PERIOD_S))


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    from serve_app.builder import build_app

    apply_serve_env()
    ray.init(
        num_cpus=8,  # logical: the engines' own processes are not Ray-scheduled
        include_dashboard=False,
        log_to_driver=bool(os.environ.get("RTPD_TEST_LOGS")),
        runtime_env={"env_vars": {"RAY_SERVE_LOG_TO_STDERR": "0"}},
        _metrics_export_port=METRICS_PORT,  # Prometheus text, as a cluster's scraper reads it
        _system_config={"metrics_report_interval_ms": 1000},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(app_args()), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{PORT}"
    wait_healthy(base, 120)
    yield base
    # Not `serve.shutdown()`: it waits out every replica's graceful shutdown (~20 s here), and nothing is left to
    # drain at the end of a run. Ray's shutdown kills the replicas, and each engine's processes die with theirs.
    ray.shutdown()


def deploy_app(name: str, prefix: str, args: dict[str, Any], deployments: list[dict[str, Any]]) -> None:
    """Deploy a second application beside the main one, as `serve deploy` of a config file does (so that a later
    change of a deployment's replica count is the lightweight update the autoscaler makes, not a restart).
    Returns at once: each test waits for the replicas it needs."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    app = {
        "name": name,
        "route_prefix": prefix,
        "import_path": "serve_app.builder:build_app",
        "args": args,
        "deployments": deployments,
    }
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))


TOOLS_APP, TOOLS_PREFIX = "tools", "/tools"
APP_START_S = 300


def tools_args() -> dict[str, Any]:
    """A second app: `local:tiny-llama-tools` (fitted to call tools, local_models/tools_fit.py) and the default
    config's speech role (`local:tiny-whisper`, fitted to the clips in speech/samples/), so that a spoken question
    can end in a tool call. Decode computes every plain request's prompt itself (the main app disaggregates them),
    and a short session's answer's (the main app hands every one off)."""
    args = app_args(speech=True)
    args["model"] = "local:tiny-llama-tools"
    args["router"]["disaggregation"]["min_prompt_tokens"] = 1_000_000
    # A short session's answer computed by decode, as shipped (its spoken turns and tool calls take that path).
    args["router"]["disaggregation"].pop("min_session_prompt_tokens")
    return args


def wait_app(base: str, name: str, timeout: float = APP_START_S) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{name} never became healthy: {serve.status()}"
        time.sleep(1)


@pytest.fixture(scope="session")
def tools_app(server: str) -> Iterator[str]:
    """The tools-and-voice app (`tools_args`), for the tool-call and voice tests; started by the first of them."""
    from local_models.llm import make_local_model
    from local_models.whisper import make_speech_model

    make_local_model("tiny-llama-tools")  # (once, here, rather than by both engines at once)
    make_speech_model()
    deploy_app(TOOLS_APP, TOOLS_PREFIX, tools_args(), [])
    base = f"{server}{TOOLS_PREFIX}"
    wait_app(base, TOOLS_APP)
    yield base
    serve.delete(TOOLS_APP, _blocking=False)


@pytest.fixture
def replaced_after(tools_app: str) -> Iterator[None]:
    """For a test that kills one of the tools app's replicas: after it, passed or not, until Serve's replacement is
    up (`/health` asks every role), so that the tests after it find the app whole."""
    yield
    wait_app(tools_app, TOOLS_APP)


@pytest.fixture(scope="session")
def model_name(server: str) -> str:
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


def engine_stats(role: str, request_id_prefix: str | None = None, app: str = APP) -> dict[str, Any]:
    handle = serve.get_deployment_handle(role, app_name=app)
    return handle.stats.remote(request_id_prefix).result(timeout_s=60)


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, every: float = 0.05) -> Any:
    """Until `predicate()` is truthy or `timeout` has passed; its last value (falsy: it never held)."""
    deadline = time.time() + timeout
    while not (got := predicate()) and time.time() < deadline:
        time.sleep(every)
    return got


def wait_idle(role: str, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until an engine runs no request and holds no KV block; return its last stats."""
    deadline = time.time() + timeout
    while True:
        stats = engine_stats(role)
        idle = stats["num_requests"] == 0 and stats["unfinished_requests"] == 0
        if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        if time.time() > deadline:
            raise AssertionError(f"{role} engine not idle after {timeout}s: {stats}")
        time.sleep(0.25)


FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _close_what_a_failed_test_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a failed test on the main app, close the sessions it left resident: each would hold its KV for its
    idle timeout (300 s) and fail every later test that waits for an idle engine, one failure becoming ten."""
    yield
    if not request.node.stash.get(FAILED, False) or "server" not in request.fixturenames:
        return
    base = request.getfixturevalue("server")
    for _ in range(8):  # (the stats name eight at a time)
        left = engine_stats("prefill")["scheduler"]["idle_session_ids"]
        for sid in left:
            httpx.delete(f"{base}/v1/streaming_input/sessions/{sid}", timeout=60)
        if len(left) < 8:
            return


@ray.remote(num_cpus=0)
class ReferenceEngine:
    """A single, monolithic vLLM engine on the same model: the ground truth for P/D outputs."""

    def __init__(self, args: dict[str, Any]) -> None:
        from vllm import LLM

        from core.config import AppConfig
        from local_models.llm import resolve_model

        config = AppConfig.model_validate(args)
        engine = config.engine
        self.llm = LLM(
            model=resolve_model(config.model),
            served_model_name=config.model_name,
            dtype=engine.dtype or "auto",
            max_model_len=engine.max_model_len,
            kv_cache_memory_bytes=int((engine.kv_cache_gb or 0.25) * 2**30),
            gpu_memory_utilization=engine.gpu_memory_utilization or 0.2,
            enable_prefix_caching=False,
            enforce_eager=bool(engine.enforce_eager),
        )

    def chat(self, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
        from vllm import SamplingParams

        out = self.llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def complete(self, prompt: str, max_tokens: int) -> list[int]:
        from vllm import SamplingParams

        out = self.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="session")
def reference(server: str) -> Any:
    actor = ReferenceEngine.remote(app_args())
    yield actor
    ray.kill(actor)
