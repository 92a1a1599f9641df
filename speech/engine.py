"""The speech role's engine: a vLLM speech-to-text engine (Whisper family), with vLLM's own transcription layer.

Its own `AsyncLLM`, not the LLM's: an encoder-decoder model cannot take a KV connector, and it has no business with
the LLM's KV. Every transcription, the realtime socket's partial ones as much as `/v1/audio/transcriptions`, goes
through vLLM's `OpenAIServingTranscription` (the model's own prompt, language handling, long audio split at
quiet points, usage), fed 16-bit PCM WAV at the model's rate: the router resamples what clients send.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

from core.config import AppConfig, EngineConfig
from engine import ipc_wait
from engine.llm import install_fate_sharing
from engine.stats import EngineTotals, NoPrometheusStatLogger, TotalsStatLogger

logger = logging.getLogger(__name__)


def resolve_speech_model(model: str) -> str:
    """`local:tiny-whisper` is the project's generated speech model; anything else is a hub id or a path."""
    from local_models.whisper import SPEECH_MODELS

    if model in SPEECH_MODELS:
        return str(SPEECH_MODELS[model]())
    return model


def build_args(app: AppConfig) -> Any:
    """The argparse namespace `vllm serve` would build for the speech model."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    speech = app.speech
    assert speech.model is not None
    cfg: EngineConfig = speech.engine
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", resolve_speech_model(speech.model)])
    args.served_model_name = [speech.model_name]
    args.disable_log_stats = False  # our stat logger needs them
    args.limit_mm_per_prompt = {"audio": 1}
    simple = {
        "max_model_len": cfg.max_model_len,
        "dtype": cfg.dtype,
        "block_size": cfg.block_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "enforce_eager": cfg.enforce_eager,
        "kv_cache_memory_bytes": int(cfg.kv_cache_gb * 2**30) if cfg.kv_cache_gb else None,
    }
    for key, value in {**simple, **cfg.engine_kwargs}.items():
        if value is not None:
            setattr(args, key, value)
    return args


class SpeechEngine:
    """An AsyncLLM of a speech-to-text model and vLLM's transcription serving object."""

    def __init__(self, app: AppConfig) -> None:
        self.app = app
        self.totals = EngineTotals()
        self.client: Any = None
        self.serving: Any = None
        self.sample_rate = 16000

    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(self.app.speech.engine.env)
        ipc_wait.configure(self.app.speech.engine.ipc_spin_us)
        args = build_args(self.app)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        install_fate_sharing()  # its processes die with this replica (engine/llm.py)
        self.client = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[TotalsStatLogger.factory(self.totals, {"role": "speech"}), NoPrometheusStatLogger],
            disable_log_stats=False,
        )
        state = State()
        tasks = await self.client.get_supported_tasks()
        if "transcription" not in tasks:
            raise ValueError(f"speech.model {self.app.speech.model!r} cannot transcribe (its tasks: {tasks})")
        await init_app_state(self.client, state, args, tasks)
        self.serving = state.openai_serving_transcription
        self.sample_rate = int(self.serving.asr_config.sample_rate)
        self.max_clip_s = self.serving.asr_config.max_audio_clip_s
        logger.info("speech engine ready: model=%s rate=%d", args.model, self.sample_rate)

    async def transcribe(self, wav: bytes, fields: dict[str, Any]) -> Any:
        """One OpenAI transcription request (`fields`: the form's fields) of a WAV file: an `ErrorResponse`, a
        response model, or (`stream: true`) an async generator of SSE strings."""
        from fastapi import UploadFile
        from pydantic import ValidationError
        from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest

        serving = self.serving
        try:
            request = TranscriptionRequest.model_validate({**fields, "file": UploadFile(io.BytesIO(wav))})
        except ValidationError as e:
            from vllm.entrypoints.serve.engine.protocol import ErrorResponse

            from core.protocol import validation_error_body

            return ErrorResponse.model_validate(validation_error_body(e))
        try:
            return await serving.create_transcription(wav, request, None)
        except Exception as e:  # vLLM raises ValueError for audio it refuses
            return serving.create_error_response(e)

    async def check_health(self) -> None:
        await self.client.check_health()

    def shutdown(self) -> None:
        if self.serving is not None:
            self.serving.shutdown()
        if self.client is not None:
            self.client.shutdown()
