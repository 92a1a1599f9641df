"""Prometheus metrics of the router and the engine replicas, exported through Ray's metrics agent.

Ray serves every process's application metrics on each node's metrics port, prefixed `ray_` (so
`rtpd_ttft_seconds` is scraped as `ray_rtpd_ttft_seconds`); k8s/grafana-dashboard.json charts them.
Metrics are created on first use, inside the process that records them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BYTES_BUCKETS = [2**k for k in range(10, 34, 2)]


@functools.cache
def _metric(kind: str, name: str, description: str, tags: tuple[str, ...], buckets: tuple[float, ...] = ()) -> Any:
    from ray.util import metrics

    if kind == "counter":
        return metrics.Counter(name, description, tag_keys=tags)
    if kind == "gauge":
        return metrics.Gauge(name, description, tag_keys=tags)
    return metrics.Histogram(name, description, boundaries=list(buckets), tag_keys=tags)


def _safe(fn: Any) -> Any:
    """Metrics never break serving (e.g. outside a Ray worker in unit tests)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(Exception):
            fn(*args, **kwargs)

    return wrapper


@_safe
def inc(name: str, value: float = 1.0, description: str = "", **tags: str) -> None:
    if value:
        _metric("counter", name, description, tuple(sorted(tags))).inc(value, tags=tags or None)


@_safe
def set_gauge(name: str, value: float, description: str = "", **tags: str) -> None:
    _metric("gauge", name, description, tuple(sorted(tags))).set(value, tags=tags or None)


@_safe
def observe(
    name: str, value: float, description: str = "", buckets: list[float] = LATENCY_BUCKETS, **tags: str
) -> None:
    _metric("histogram", name, description, tuple(sorted(tags)), tuple(buckets)).observe(value, tags=tags or None)


# The metric names, in one place (the dashboard and the metrics test use the same list).
SESSIONS_OPEN = "rtpd_sessions_open"
SESSION_CHUNKS = "rtpd_session_chunks_total"
SESSION_INPUT_BYTES = "rtpd_session_input_bytes_total"
TTFT = "rtpd_ttft_seconds"
ITL = "rtpd_inter_token_latency_seconds"
LAST_CHUNK_TO_FIRST_TOKEN = "rtpd_last_chunk_to_first_token_seconds"
KV_TRANSFERS = "rtpd_kv_transfers_total"
KV_TRANSFER_BYTES = "rtpd_kv_transfer_bytes_total"
KV_TRANSFER_SECONDS = "rtpd_kv_transfer_seconds"
SCHEDULER_ADMISSIONS = "rtpd_scheduler_admissions_total"
SCHEDULER_EVICTIONS = "rtpd_scheduler_evictions_total"
KV_CACHE_USAGE = "rtpd_kv_cache_usage"
ERRORS = "rtpd_errors_total"
ROUTER_PREFILLS = "rtpd_router_prefills_total"  # by where (prefill | decode) and reason
SESSIONS_ADOPTED = "rtpd_sessions_adopted_total"  # sessions taken over from another replica, by why
SESSIONS_BUFFERED = "rtpd_sessions_buffered_total"  # sessions whose input waited for KV room to stream
PREEMPTIVE = "rtpd_preemptive_answers_total"  # preemptive answers, by outcome (started, delivered, discarded, ...)
PREEMPTIVE_DISCARDED_TOKENS = "rtpd_preemptive_discarded_tokens_total"  # tokens preemptive answers made, discarded
# Preemptive answers a router read, by how: "held" (its reader held the frames before the turn ended) or
# "adopted" (taken over from decode at claim time).
PREEMPTIVE_READ = "rtpd_preemptive_read_total"
SESSIONS_PROMOTED = "rtpd_sessions_promoted_total"  # buffered sessions that started streaming once room freed
SESSION_CALL_RETRIES = "rtpd_session_call_retries_total"  # router: session calls retried, by why
ADMISSIONS = "rtpd_admissions_total"  # router admission (router/admission/gate.py): by kind, outcome, reason
REALTIME_CLOSES = "rtpd_realtime_closes_total"  # realtime connections closed by the server, by code
TOOL_CALLS = "rtpd_tool_calls_total"  # router: tool calls in answers, by surface (chat, completion, session, realtime)
ADMISSION_LIMIT = "rtpd_admission_limit"  # router: its adaptive limit on admitted work in flight, per replica
ADMISSION_IN_FLIGHT = "rtpd_admission_in_flight"  # router: admitted sessions and requests in flight, per replica
ADMISSION_WAITING = "rtpd_admission_waiting"  # router: new work queued for admission, per replica
ADMISSION_WAIT = "rtpd_admission_wait_seconds"  # router: how long admitted work waited in the queue, by kind
# Voice (router/voice/, speech/). The router: audio seconds clients sent, by surface; how far a transcript lags the
# audio it covers (from the last audio sample it covers to the text's arrival); turns the VAD ended; barge-ins
# (speech that cancelled a response). The speech replicas: audio seconds transcribed (an utterance is transcribed
# again as it grows) and one transcription's time; their load is `record_autoscaling_stats`.
VOICE_AUDIO_SECONDS = "rtpd_voice_audio_seconds_total"
VOICE_TRANSCRIPT_DELAY = "rtpd_voice_transcript_delay_seconds"
VOICE_TURNS = "rtpd_voice_turns_total"
VOICE_BARGE_INS = "rtpd_voice_barge_ins_total"
SPEECH_AUDIO_SECONDS = "rtpd_speech_audio_seconds_total"
SPEECH_LATENCY = "rtpd_speech_transcription_seconds"
SPEECH_IN_FLIGHT = "rtpd_speech_in_flight"
# The speech-out role (tts/): audio synthesized, its real-time factor (synthesis time / audio time), syntheses in
# flight (its load); the router's audio sent to clients, and a response's first audio after it was asked for.
TTS_AUDIO_SECONDS = "rtpd_tts_audio_seconds_total"
TTS_REALTIME_FACTOR = "rtpd_tts_realtime_factor"
TTS_IN_FLIGHT = "rtpd_tts_in_flight"
AUDIO_OUT_SECONDS = "rtpd_audio_out_seconds_total"
FIRST_AUDIO_SECONDS = "rtpd_first_audio_seconds"
TTS_ERRORS = "rtpd_tts_errors_total"  # syntheses that failed, by `code` (at the router: by surface too)
# The descriptions, one per metric wherever it is recorded.
FIRST_AUDIO = "time from the request (a response, or an audio/speech call) to its first audio sent"
AUDIO_OUT = "audio seconds sent to clients"
TTS_FAILED = "syntheses that failed"

ALL = [
    SESSIONS_OPEN,
    SESSION_CHUNKS,
    SESSION_INPUT_BYTES,
    TTFT,
    ITL,
    LAST_CHUNK_TO_FIRST_TOKEN,
    KV_TRANSFERS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_SECONDS,
    SCHEDULER_ADMISSIONS,
    SCHEDULER_EVICTIONS,
    KV_CACHE_USAGE,
    ERRORS,
]

# The prefill streaming scheduler (prefill/scheduler/), per replica and policy. Evictions and swaps happen only
# under KV pressure, so these stay at zero in an unpressured run.
PREFILL_ADMISSIONS = "rtpd_prefill_admissions_total"
PREFILL_EVICTIONS = "rtpd_prefill_evictions_total"
PREFILL_SWAP_BLOCKS = "rtpd_prefill_swap_blocks_total"
PREFILL_SWAP_FALLBACKS = "rtpd_prefill_swap_fallbacks_total"
PREFILL_SWAP_BYTES = "rtpd_prefill_swap_bytes_total"
PREFILL_INVALIDATED_TOKENS = "rtpd_prefill_invalidated_tokens_total"
PREFILL_RECOMPUTED_TOKENS = "rtpd_prefill_recomputed_tokens_total"
PREFILL_CACHE_RETURNED_TOKENS = "rtpd_prefill_prefix_cache_returned_tokens_total"
PREFILL_QUEUE = "rtpd_prefill_queue"
# Work: prompt tokens the prefill engine computed, by what for (streamed session input, hand-offs, whole prompts).
PREFILL_COMPUTED_TOKENS = "rtpd_prefill_computed_tokens_total"

SCHEDULER_ALL = [
    PREFILL_ADMISSIONS,
    PREFILL_EVICTIONS,
    PREFILL_SWAP_BLOCKS,
    PREFILL_SWAP_FALLBACKS,
    PREFILL_SWAP_BYTES,
    PREFILL_INVALIDATED_TOKENS,
    PREFILL_RECOMPUTED_TOKENS,
    PREFILL_CACHE_RETURNED_TOKENS,
    PREFILL_QUEUE,
    PREFILL_COMPUTED_TOKENS,
]

# scheduler counter -> (metric, description, extra tags)
_SCHEDULER_COUNTERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "admissions": (PREFILL_ADMISSIONS, "requests the prefill scheduler received", {}),
    "evictions_recompute": (PREFILL_EVICTIONS, "prefill KV evictions by kind", {"kind": "recompute"}),
    "evictions_swap": (PREFILL_EVICTIONS, "prefill KV evictions by kind", {"kind": "swap"}),
    "swap_fallbacks": (PREFILL_SWAP_FALLBACKS, "swaps that became recomputes (host pool full, or late)", {}),
    "swapped_out_blocks": (PREFILL_SWAP_BLOCKS, "KV blocks swapped to or from host", {"direction": "out"}),
    "swapped_in_blocks": (PREFILL_SWAP_BLOCKS, "KV blocks swapped to or from host", {"direction": "in"}),
    "swapped_out_bytes": (PREFILL_SWAP_BYTES, "KV bytes swapped to host", {"direction": "out"}),
    "invalidated_tokens": (PREFILL_INVALIDATED_TOKENS, "tokens invalidated by input rewrites", {}),
    "recomputed_tokens": (PREFILL_RECOMPUTED_TOKENS, "tokens recomputed after an eviction", {}),
    "tokens_back_from_prefix_cache": (PREFILL_CACHE_RETURNED_TOKENS, "evicted tokens the prefix cache gave back", {}),
    "preemptions_engine": (PREFILL_EVICTIONS, "prefill KV evictions by kind", {"kind": "engine_preemption"}),
    **{
        f"computed_{kind}": (PREFILL_COMPUTED_TOKENS, "prompt tokens the prefill engine computed", {"kind": kind})
        for kind in ("streamed", "handoff", "whole")
    },
}


@_safe
def export_scheduler(stats: dict[str, Any], previous: dict[str, Any], replica: str) -> None:
    """Counters as deltas since the last export, queue lengths as gauges."""
    tags = {"replica": replica, "policy": str(stats.get("policy"))}
    for key, (name, description, extra) in _SCHEDULER_COUNTERS.items():
        inc(name, max(0, stats.get(key, 0) - previous.get(key, 0)), description, **tags, **extra)
    for queue in ("queue_running", "queue_waiting", "idle_sessions", "evicted_now"):
        set_gauge(PREFILL_QUEUE, stats.get(queue, 0), "prefill scheduler queues", **tags, queue=queue)


# Fault tolerance (docs/operations.md "Failures"): answers resumed on another decode replica after theirs failed, by
# outcome (resumed: continued from the tokens already sent; restarted: nothing was sent yet, the request was
# sent again; refused: the request cannot be resumed exactly; failed: no replica could take it), and KV loads a
# decode engine could not complete (recomputed there under `kv_load_failure_policy: recompute`).
DECODE_RESUMES = "rtpd_decode_resumes_total"
DECODE_KV_LOAD_FAILURES = "rtpd_decode_kv_load_failures_total"
DECODE_KV_LOAD_FAILED_TOKENS = "rtpd_decode_kv_load_failed_tokens_total"
FAULTS_ALL = [DECODE_RESUMES, DECODE_KV_LOAD_FAILURES, DECODE_KV_LOAD_FAILED_TOKENS]


@_safe
def export_kv_load_failures(stats: dict[str, Any], previous: dict[str, Any], replica: str) -> None:
    """A decode engine's KV load failures (engine/scheduler.py) as deltas since the last export."""
    for key, name, description in (
        ("kv_load_failed_requests", DECODE_KV_LOAD_FAILURES, "requests whose KV load failed on decode"),
        ("kv_load_failed_tokens", DECODE_KV_LOAD_FAILED_TOKENS, "tokens whose KV load failed on decode"),
    ):
        inc(name, max(0, stats.get(key, 0) - previous.get(key, 0)), description, replica=replica)
