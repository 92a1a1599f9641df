"""The application builder behind `serve run configs/config.yaml` (`import_path: serve_app.builder:build_app`)."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from core.config import AppConfig
from decode.server import DecodeServer
from prefill.server import PrefillServer
from router.app import Router
from serve_app.serve_env import replica_options
from speech.server import SpeechServer
from tts.server import TtsServer

SESSION_ROUTER = "router.placement:SessionAffinityRouter"
DECODE_ROUTER = "router.placement:DecodeRouter"
SPEECH_ROUTER = "router.placement:SpeechRouter"
# The roles behind the router take handle calls only (start, feed, prefill, session calls): Serve's access log writes
# a line per call, which nobody reads, to files that grow with traffic; their errors are logged as before. (py-spy
# put the line at ~4% of a prefill replica's samples under 1-token chats; its CPU per request did not move
# measurably without it: 3.45 / 3.48 ms.) The router keeps its HTTP access log. `deployment.logging_config` overrides.
INTERNAL_LOGGING = {"logging_config": {"enable_access_log": False}}
TTS_DEFAULT_OPTIONS = {"ray_actor_options": {"num_cpus": 0.1}}


def build_app(args: dict[str, Any]) -> Application:
    config = AppConfig.model_validate(args)
    from local_models.llm import LOCAL_MODELS

    if config.model in LOCAL_MODELS:
        # Make it once here, before replicas start, so that they never race to write it.
        LOCAL_MODELS[config.model]()
    # Replicas get the config without deployment options, so that scaling (num_replicas, autoscaling) is a
    # lightweight update in Serve rather than a restart of every replica.
    roles = ("router", "prefill", "decode", "speech", "tts")
    payload = config.model_dump(mode="json", exclude={role: {"deployment"} for role in roles})
    decode_router = {"request_router_class": DECODE_ROUTER, "request_routing_stats_period_s": 1.0}
    decode_options = replica_options(
        {"request_router_config": decode_router, **INTERNAL_LOGGING, **config.decode.deployment}
    )
    decode = DecodeServer.options(**decode_options).bind(payload)
    # Streaming sessions live on one prefill replica: route their calls by session id.
    router_config = {"request_router_class": SESSION_ROUTER, "request_routing_stats_period_s": 1.0}
    # A stopping replica hands its sessions over within `prefill.drain_timeout_s` (prefill/failover.py); Serve
    # must not kill it before: its graceful shutdown allows the drain and a margin, unless the config says more.
    drain_budget = {"graceful_shutdown_timeout_s": config.prefill.drain_timeout_s + 30}
    prefill_options = {
        "request_router_config": router_config,
        **drain_budget,
        **INTERNAL_LOGGING,
        **config.prefill.deployment,
    }
    prefill = PrefillServer.options(**replica_options(prefill_options)).bind(payload, decode)
    # The speech role, when the config names a speech model: an engine of its own (speech/server.py).
    speech = None
    if config.speech.model is not None:
        from local_models.whisper import SPEECH_MODELS

        if config.speech.model in SPEECH_MODELS:
            SPEECH_MODELS[config.speech.model]()  # made once here, as the LLM's
        speech_router = {"request_router_class": SPEECH_ROUTER, "request_routing_stats_period_s": 1.0}
        speech_options = {"request_router_config": speech_router, **INTERNAL_LOGGING, **config.speech.deployment}
        speech = SpeechServer.options(**replica_options(speech_options)).bind(payload)
    # The speech-out role, when the config names a TTS backend (tts/server.py). Its replicas hold no state between
    # calls: Serve's own routing (power of two choices) fits.
    # It is on by default (espeak-ng): a replica asks for a tenth of a core unless the config says otherwise (espeak-ng
    # speaks at ~1/500 of real time; Serve's default, a whole core, would not fit beside the engines on two).
    tts = None
    if config.tts.backend is not None:
        tts_options = {**TTS_DEFAULT_OPTIONS, **INTERNAL_LOGGING, **config.tts.deployment}
        tts = TtsServer.options(**replica_options(tts_options)).bind(payload)
    router = Router.options(**replica_options(config.router.deployment))
    return router.bind(prefill, decode, payload, speech, tts=tts)
