"""The application builder behind `serve run configs/config.yaml` (`import_path: serve_app.builder:build_app`)."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from decode.server import DecodeServer
from prefill.server import PrefillServer
from router.app import Router
from serve_app.config import AppConfig
from serve_app.serve_env import replica_options

SESSION_ROUTER = "router.placement:SessionAffinityRouter"
DECODE_ROUTER = "router.placement:DecodeRouter"


def build_app(args: dict[str, Any]) -> Application:
    config = AppConfig.model_validate(args)
    from serve_app.local_model import LOCAL_MODELS

    if config.model in LOCAL_MODELS:
        # Make it once here, before replicas start, so that they never race to write it.
        LOCAL_MODELS[config.model]()
    # Replicas get the config without deployment options, so that scaling (num_replicas, autoscaling) is a
    # lightweight update in Serve rather than a restart of every replica.
    payload = config.model_dump(mode="json", exclude={role: {"deployment"} for role in ("router", "prefill", "decode")})
    decode_router = {"request_router_class": DECODE_ROUTER, "request_routing_stats_period_s": 1.0}
    decode_options = replica_options({"request_router_config": decode_router, **config.decode.deployment})
    decode = DecodeServer.options(**decode_options).bind(payload)
    # Streaming sessions live on one prefill replica: route their calls by session id.
    router_config = {"request_router_class": SESSION_ROUTER, "request_routing_stats_period_s": 1.0}
    # A stopping replica hands its sessions over within `prefill.drain_timeout_s` (prefill/failover.py); Serve
    # must not kill it before: its graceful shutdown allows the drain and a margin, unless the config says more.
    drain_budget = {"graceful_shutdown_timeout_s": config.prefill.drain_timeout_s + 30}
    prefill_options = {"request_router_config": router_config, **drain_budget, **config.prefill.deployment}
    prefill = PrefillServer.options(**replica_options(prefill_options)).bind(payload, decode)
    return Router.options(**replica_options(config.router.deployment)).bind(prefill, decode, payload)
