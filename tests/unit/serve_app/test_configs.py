"""Every Serve config file under configs/ loads as Ray Serve would load it, with args valid for AppConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve._private.config import (
    ReplicaConfig,
)  # what `.options()` builds; checks placement-group bundles
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from core.config import AppConfig, EngineConfig

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
GPU_CONFIGS = [p for p in CONFIGS if p.parent.name == "gpu"]
ROLES = ("prefill", "decode")


def apps(path: Path) -> list[AppConfig]:
    serve = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert serve.applications, f"{path}: no applications"
    for app in serve.applications:
        assert app.import_path == "serve_app.builder:build_app"
    return [AppConfig.model_validate(app.args) for app in serve.applications]


def test_configs_found() -> None:
    assert REPO / "configs" / "config.yaml" in CONFIGS
    assert {p.name for p in GPU_CONFIGS} >= {"llama-3.1-8b.yaml", "llama-3.1-70b-tp4.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_loads(path: Path) -> None:
    for config in apps(path):
        for role in ("router", *ROLES, "speech", "tts"):
            options: dict[str, Any] = getattr(config, role).deployment
            DeploymentSchema.model_validate({"name": role, **options})  # num_replicas vs autoscaling, ...
            ReplicaConfig.create(
                role,
                ray_actor_options=options.get("ray_actor_options"),
                placement_group_bundles=options.get("placement_group_bundles"),
                placement_group_strategy=options.get("placement_group_strategy"),
            )


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_engine_for_merges_roles(path: Path) -> None:
    for config in apps(path):
        base = config.engine.model_dump(exclude_none=True)
        for role in ROLES:
            own = getattr(config, role).engine.model_dump(exclude_none=True)
            merged = config.engine_for(role)
            assert isinstance(merged, EngineConfig)
            for field in EngineConfig.model_fields:
                if field in ("engine_kwargs", "env"):  # merged key by key, the role's winning
                    assert getattr(merged, field) == {**base.get(field, {}), **own.get(field, {})}
                else:
                    assert getattr(merged, field) == own.get(field, base.get(field)), (role, field)
        assert config.engine_for("prefill").enable_prefix_caching is not False


def test_engine_for_override_semantics() -> None:
    config = AppConfig.model_validate(
        {
            "engine": {"max_model_len": 4096, "max_num_seqs": 8, "engine_kwargs": {"a": 1, "b": 2}},
            "decode": {"engine": {"max_num_seqs": 64, "engine_kwargs": {"b": 3}}},
        }
    )
    prefill, decode = config.engine_for("prefill"), config.engine_for("decode")
    assert (prefill.max_model_len, prefill.max_num_seqs, prefill.engine_kwargs) == (4096, 8, {"a": 1, "b": 2})
    assert (decode.max_model_len, decode.max_num_seqs, decode.engine_kwargs) == (4096, 64, {"a": 1, "b": 3})


def _gpus(options: dict[str, Any]) -> float:
    bundles = options.get("placement_group_bundles")
    if bundles:
        return sum(b.get("GPU", 0) for b in bundles)
    return options.get("ray_actor_options", {}).get("num_gpus", 0)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_config_shape(path: Path) -> None:
    (config,) = apps(path)
    assert config.model.startswith("meta-llama/")
    assert config.kv_transfer.connector == "NixlConnector"
    assert config.kv_transfer.kv_buffer_device == "auto" and config.kv_transfer.backends == ["UCX"]
    assert _gpus(config.router.deployment) == 0
    pools = []
    for role in ROLES:
        options = getattr(config, role).deployment
        engine = config.engine_for(role)
        assert "autoscaling_config" in options and "num_replicas" not in options
        scaling = options["autoscaling_config"]
        assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
        for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
            assert key in scaling, (role, key)
        tp = engine.tensor_parallel_size or 1
        assert _gpus(options) == tp, f"{role}: GPUs asked for must equal tensor_parallel_size"
        if tp > 1:
            assert options["placement_group_strategy"] == "STRICT_PACK"
            assert len(options["placement_group_bundles"]) == tp
        custom = options["ray_actor_options"].get("resources", {})
        assert custom, f"{role}: needs a custom resource to land on its own worker group"
        pools.append(set(custom))
        env = options["ray_actor_options"].get("runtime_env", {}).get("env_vars", {})
        assert "UCX_TLS" in env
        assert engine.gpu_memory_utilization and engine.max_model_len and engine.max_num_seqs
    assert not pools[0] & pools[1]
    assert config.engine_for("prefill").enable_prefix_caching is True


def test_replica_options_put_one_event_loop_per_replica_in_the_replicas_environment_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """serve_app/serve_env.py: the replicas' processes get REPLICA_ENV through their runtime_env (not the
    driver's environment, whose handles must keep working outside an asyncio loop); what a deployment's own
    runtime_env or this process's environment says wins."""
    from serve_app.serve_env import REPLICA_ENV, replica_options

    monkeypatch.delenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", raising=False)
    monkeypatch.delenv("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", raising=False)
    given = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}
    options = replica_options(given)
    assert options["num_replicas"] == 2 and options["ray_actor_options"]["num_cpus"] == 0.5
    assert options["ray_actor_options"]["runtime_env"]["env_vars"] == REPLICA_ENV
    assert "runtime_env" not in given["ray_actor_options"]  # (not changed in place)

    own = {"ray_actor_options": {"runtime_env": {"env_vars": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "X": "y"}}}}
    env = replica_options(own)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env == {**REPLICA_ENV, "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "X": "y"}
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")  # switched back for the whole cluster
    env = replica_options({})["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
