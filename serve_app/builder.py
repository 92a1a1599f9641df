"""The application builder behind `serve run configs/config.yaml` (`import_path: serve_app.builder:build_app`)."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from decode.server import DecodeServer
from prefill.server import PrefillServer
from router.app import Router
from serve_app.config import LOCAL_MODEL, AppConfig

SESSION_ROUTER = "router.placement:SessionAffinityRouter"


def build_app(args: dict[str, Any]) -> Application:
    config = AppConfig.model_validate(args)
    if config.model == LOCAL_MODEL:
        # Make it once here, before replicas start, so that they never race to write it.
        from serve_app.local_model import make_local_model

        make_local_model()
    payload = config.model_dump(mode="json")
    decode = DecodeServer.options(**config.decode.deployment).bind(payload)
    # Streaming sessions live on one prefill replica: route their calls by session id.
    prefill_options = {"request_router_config": {"request_router_class": SESSION_ROUTER}, **config.prefill.deployment}
    prefill = PrefillServer.options(**prefill_options).bind(payload, decode)
    return Router.options(**config.router.deployment).bind(prefill, decode, payload)
