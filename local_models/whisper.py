"""`local:tiny-whisper`: the project's generated speech-to-text model, fitted at build time to the sample clips.

A Whisper checkpoint (`WhisperForConditionalGeneration`, Hugging Face format, float32, ~0.3 M parameters) that
builds in ~20-45 s on one core: 2 encoder + 2 decoder layers, 64 wide, 5 s audio windows, a byte-level BPE tokenizer
trained on the sample sentences, with Whisper's special tokens. vLLM serves it with the code that serves any Whisper
model; users name a real one (e.g. openai/whisper-small) in the config instead.

Nothing downloadable can recognize speech here, so the decoder is fitted, from seeded weights, until greedy decoding
transcribes every clip in speech/samples/ exactly, with a logit margin, also as the serving side cuts them: with
0-400 ms of silence (or faint noise) before, 0-700 ms after, a little of an edge cut off, sent at 16 kHz or at
24 kHz (resampled twice on its way, `served`); and each sentence as the TTS role's default voice says it
(`voiced`). Silence or faint noise alone transcribes to "" (the decoder ends at once). Other speech gives one of
the sentences, or garbage. Asked for the language (vLLM detects it when a request names none), it answers `<|en|>`.
The encoder is a fixed random feature map without position embeddings (`_init_encoder`, `_fit`): where a clip sits
in the window does not matter.

Transcripts follow Whisper's convention: a leading space (" What is the weather in Paris?"); callers `.strip()`.
The decoder prompt is vLLM's: `<|startoftranscript|><|en|><|transcribe|><|notimestamps|>` (`DECODER_PROMPT`).

    python -m local_models.whisper [--out DIR] [--force]

From code: `make_speech_model()`, or by config name `SPEECH_MODELS["local:tiny-whisper"]()`; both return the
model's directory, built on first use (models/tiny-whisper) and reused while its stamp matches.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import logging
import time
import wave
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from local_models.fit import Recipe, fit, margin_loss, margins, one_thread
from local_models.llm import MODELS_DIR

log = logging.getLogger(__name__)
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "speech" / "samples"  # (the speech role's demo clips)
SENTENCES: dict[str, str] = json.loads((SAMPLES_DIR / "sentences.json").read_text())
DEFAULT_DIR = MODELS_DIR / "tiny-whisper"
VERSION = 6  # bump when the recipe changes, so stale copies are rebuilt
RATE = 16_000  # Hz: Whisper's, and the sample clips'
DECODER_PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
SEED = 1234
MAX_STEPS = 1000
CHECK_EVERY = 25  # steps between margin checks over the whole train and held-out sets
MIN_MARGIN = 3.0  # logits: every target token beats every rival by this much, so vLLM's kernels decode the same


@dataclass(frozen=True)
class SpeechModelSpec:
    """The model's shape, tokenizer size and fitting recipe (all of it goes in the stamp)."""

    d_model: int = 64
    ffn_dim: int = 256
    layers: int = 2  # encoder and decoder each
    heads: int = 2  # 64 / 2 = 32 per head: a head size vLLM's CPU attention supports
    num_mel_bins: int = 80
    # Seconds per window. vLLM reserves `max_source_positions` = 50 per second encoder positions per request, and
    # every request encodes a whole padded window: 5 s instead of Whisper's 30 s is ~10x less encoder work.
    chunk_length: int = 5
    max_target_positions: int = 128  # decoder positions: vLLM's max_model_len (prompt 4 + up to 124 tokens)
    bpe_vocab: int = 512  # byte-level BPE, before the special tokens
    train_copies: int = 20  # per clip: the clip as is and shifted/padded/cut copies
    heldout_copies: int = 8  # per clip, other offsets, only to verify
    voiced_copies: int = 6  # per sentence as the TTS role's default voice says it (`voiced`), and 2 held out
    batch: int = 64
    lr: float = 5e-3
    version: int = VERSION

    @property
    def max_source_positions(self) -> int:
        return self.chunk_length * 50  # 100 mel frames a second, halved by the encoder's stride-2 conv


SPEC = SpeechModelSpec()


def load_sample(slug: str) -> np.ndarray:
    """The clip `speech/samples/<slug>.wav` as float32 samples at 16 kHz in [-1, 1]."""
    with wave.open(str(SAMPLES_DIR / f"{slug}.wav")) as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (RATE, 1, 2):
            raise ValueError(f"{slug}.wav is not 16 kHz mono 16-bit PCM")
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return (pcm / 32768.0).astype(np.float32)


def _samples_digest() -> str:
    """What the fit saw: the sentences, the clips' bytes (regenerated clips must rebuild the model) and what the TTS
    voice's renditions depend on (`voiced`: espeak-ng's version, the voice and its pace)."""
    from importlib.metadata import version

    tts, name = _tts_voice()
    voice = [version("espeakng-loader"), name, tts.words_per_minute]
    h = hashlib.sha256(json.dumps([SENTENCES, voice], sort_keys=True).encode())
    for slug in sorted(SENTENCES):
        h.update((SAMPLES_DIR / f"{slug}.wav").read_bytes())
    return h.hexdigest()[:16]


def _special_tokens() -> list[str]:
    """Whisper's special tokens, in Whisper's order: transformers' tokenizer finds a language's token by its offset
    from `<|startoftranscript|>`, and vLLM looks up the `<|xx|>` of each of its 57 languages (all in this list)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *(f"<|{code}|>" for code in LANGUAGES),
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nocaptions|>",
        "<|notimestamps|>",
    ]


def _make_tokenizer(spec: SpeechModelSpec):  # -> transformers.WhisperTokenizer
    """A byte-level BPE trained on the sentences (each word one token: short targets fit fast) and a little of
    Python's own English documentation (so other text gets ordinary merges), as a `WhisperTokenizer`."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizer

    english = [text for _, text in sorted(pydoc_data.topics.topics.items())][:40]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([" " + s for s in SENTENCES.values()] * 50 + english, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = WhisperTokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]])
    # (`<|endoftext|>` is there already: WhisperTokenizer's bos/eos/unk, right after the BPE's tokens, as Whisper's)
    tokenizer.add_special_tokens({"additional_special_tokens": _special_tokens()[1:]})
    tokenizer.model_max_length = spec.max_target_positions
    return tokenizer


def _feature_extractor(spec: SpeechModelSpec):  # -> transformers.WhisperFeatureExtractor
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=spec.num_mel_bins, sampling_rate=RATE, hop_length=160, n_fft=400, chunk_length=spec.chunk_length
    )


def features(extractor: Any, audio: list[np.ndarray]):  # -> torch.Tensor [batch, mels, frames]
    """Log-mel features as vLLM computes them (its Whisper processor calls the same extractor this way)."""
    return extractor(audio, sampling_rate=RATE, truncation=True, return_tensors="pt").input_features


@dataclass(frozen=True)
class Cut:
    """How one copy of a clip sits in the window: as a VAD segment would hand it over."""

    pre_ms: int = 0  # silence before
    post_ms: int = 0  # silence after
    trim_start_ms: int = 0  # speech cut off the start
    trim_end_ms: int = 0  # speech cut off the end
    noise: float = 0.0  # standard deviation of faint Gaussian noise over the whole segment
    rate: int = RATE  # the client's: other than 16 kHz, the audio reaches the model resampled twice (`served`)

    def apply(self, clip: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        ms = RATE // 1000
        speech = clip[self.trim_start_ms * ms : len(clip) - self.trim_end_ms * ms]
        audio = np.concatenate([np.zeros(self.pre_ms * ms), speech, np.zeros(self.post_ms * ms)]).astype(np.float32)
        if self.rate != RATE:
            audio = served(audio, self.rate)
        if self.noise:
            audio = audio + self.noise * rng.standard_normal(len(audio))
        return audio.astype(np.float32)


def served(audio: np.ndarray, rate: int) -> np.ndarray:
    """16 kHz `audio` as a client at `rate` sends it (PCM16, 100 ms appends) and the serving side hands it to the
    model: resampled to 16 kHz by the router's streaming resampler (core/pcm.py `resample_stream`), as PCM16.
    Not the clip the recording made: the two resamplings move a near-tied transcript to another sentence (the moon
    clip sent at 24 kHz came out as the news one on a model fitted without them)."""
    import soxr

    from core.pcm import from_pcm16, pcm16, resample_stream

    sent = from_pcm16(pcm16(soxr.resample(audio, RATE, rate)))
    stream, step = resample_stream(rate, RATE), rate // 10
    parts = [stream.resample_chunk(sent[i : i + step]) for i in range(0, len(sent), step)]
    parts.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
    return from_pcm16(pcm16(np.concatenate(parts)))


def _tts_voice() -> tuple[Any, str]:
    """The TTS role's default config (core/config.py `TtsConfig`) and its default voice's espeak-ng name."""
    from core.config import TtsConfig

    config = TtsConfig()
    return config, config.voice_map()[config.default_voice]


def voiced(texts: list[str]) -> list[np.ndarray]:
    """Each text as the TTS role's default voice says it (tts/backends/espeak.py: espeak-ng at the config's pace, at
    24 kHz), uploaded for transcription (core/pcm.py `decode_upload`: 16 kHz). Not the clips: another pace and
    another espeak-ng, so a model fitted to the clips alone heard some of them as another sentence, by chance."""
    import asyncio

    from core.pcm import decode_upload, from_pcm16, wav_bytes
    from tts.backends.espeak import EspeakBackend
    from tts.client import RATE as TTS_RATE

    config, voice = _tts_voice()

    async def speak() -> list[bytes]:
        backend = EspeakBackend(config)
        await backend.start([voice])
        out = []
        for text in texts:
            out.append(b"".join([c["audio"] async for c in backend.synthesize(text, voice, 1.0) if "audio" in c]))
        return out

    return [from_pcm16(decode_upload(wav_bytes(pcm, TTS_RATE), RATE)) for pcm in asyncio.run(speak())]


def random_cuts(rng: np.random.Generator, n: int) -> list[Cut]:
    """`n` seeded cuts in the ranges the serving side produces."""

    def maybe(p: float, value: int) -> int:
        return value if rng.random() < p else 0

    return [
        Cut(
            pre_ms=int(rng.integers(0, 401)),
            post_ms=int(rng.integers(0, 701)),
            trim_start_ms=maybe(0.4, int(rng.integers(5, 41))),
            trim_end_ms=maybe(0.4, int(rng.integers(5, 81))),
            noise=float(rng.choice([0.0, 0.0, 1e-4, 5e-4])),
            rate=int(rng.choice([RATE, 24_000])),  # (OpenAI's clients send 24 kHz)
        )
        for _ in range(n)
    ]


def _silences(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """`n` segments of silence: digital zeros, or faint noise of 0.2-3 s (empty transcript)."""
    out = [np.zeros(RATE, dtype=np.float32)]
    for _ in range(n - 1):
        seconds, level = rng.uniform(0.2, 3.0), float(rng.choice([3e-5, 1e-4, 3e-4, 1e-3]))
        out.append((level * rng.standard_normal(int(seconds * RATE))).astype(np.float32))
    return out


def _dataset(spec: SpeechModelSpec, tokenizer: Any, extractor: Any, *, heldout: bool):
    """(features, decoder inputs, targets) for every copy of every clip, plus silences. Targets are -100 over the
    prompt (but its language) and padding. The held-out set uses other seeds, and 300 ms before / 600 ms after."""
    import torch

    rng = np.random.default_rng(SEED + 1 if heldout else SEED)
    prompt = tokenizer(DECODER_PROMPT, add_special_tokens=False).input_ids
    eot = tokenizer.eos_token_id
    audio: list[np.ndarray] = []
    answers: list[list[int]] = []
    # (Synthesized again for each set: in one process espeak-ng's renditions differ by a few samples from one call
    # to the next, so the held-out set hears other renditions than the training set. Sharing one would change them.)
    for (slug, text), rendition in zip(SENTENCES.items(), voiced(list(SENTENCES.values())), strict=True):
        clip = load_sample(slug)
        cuts = [Cut(pre_ms=300, post_ms=600)] if heldout else [Cut()]
        cuts += random_cuts(rng, (spec.heldout_copies if heldout else spec.train_copies) - 1)
        # (the rendition as uploaded: its own silence around it, at 16 kHz)
        spoken = [replace(cut, rate=RATE) for cut in random_cuts(rng, 2 if heldout else spec.voiced_copies)]
        for source, cut in [*((clip, c) for c in cuts), *((rendition, c) for c in spoken)]:
            audio.append(cut.apply(source, rng))
            answers.append(tokenizer(" " + text, add_special_tokens=False).input_ids + [eot])
    for silence in _silences(rng, 3 if heldout else 6):
        audio.append(silence)
        answers.append([eot])
    if max(len(a) for a in audio) > spec.chunk_length * RATE:
        raise ValueError("a training segment is longer than the model's window")
    width = len(prompt) + max(len(a) for a in answers) - 1
    inputs = torch.full((len(answers), width), eot)
    targets = torch.full((len(answers), width), -100)
    for i, answer in enumerate(answers):
        ids = prompt + answer
        inputs[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        targets[i, len(prompt) - 1 : len(ids) - 1] = torch.tensor(answer)
        targets[i, 0] = prompt[1]  # `<|en|>` after `<|startoftranscript|>`: vLLM's language detection, if asked
    return features(extractor, audio), inputs, targets


def _init_encoder(model: Any) -> None:
    """Make the (fixed, random: see `_fit`) encoder a good feature map for where VAD cuts land.

    - No position embeddings (zeros instead of Whisper's sinusoids): convolutions and self-attention are then
      shift-equivariant, so a clip with 0.1 s or 0.4 s of silence before it encodes to the same vectors, moved.
      The decoder's cross-attention cannot tell where they sit, and transcribes the same (vLLM, like
      transformers, loads the table from the checkpoint).
    - He-scaled convolutions: with Whisper's 0.02 init the spectrogram's content reaches the encoder's output
      ~30x fainter than its inputs' scale; at this scale the decoder learns to tell clips apart in ~200 steps.
    """
    import torch

    encoder = model.model.encoder
    with torch.no_grad():
        encoder.embed_positions.weight.zero_()
        for conv in (encoder.conv1, encoder.conv2):
            conv.weight.normal_(0.0, (2.0 / (conv.in_channels * conv.kernel_size[0])) ** 0.5)
            conv.bias.zero_()


def _fit(model: Any, train: tuple, heldout: tuple, spec: SpeechModelSpec) -> dict[str, Any]:
    """Fit the decoder until every train and held-out target wins by MIN_MARGIN (local_models/fit.py); what it took.

    The encoder stays a fixed random feature map of the log-mel (convolutions, then two random attention layers):
    its outputs are computed once, and each step trains only the decoder (cross-attention learns where the
    content is, whatever the shift), several times cheaper than training through the 250-position encoder. That
    buys many cut copies of each clip, which is what makes held-out cuts work; seeded minibatches.
    (Trained end to end instead, 5 copies a clip took ~180 full-batch steps and still failed held-out cuts.)
    """
    import torch

    encoder = model.model.encoder.requires_grad_(False)
    model.eval()  # (no dropout anyway; eval for the frozen parts)
    with torch.no_grad():
        encoded = torch.cat([encoder(x).last_hidden_state for x in train[0].split(64)])
        heldout_encoded = torch.cat([encoder(x).last_hidden_state for x in heldout[0].split(64)])
    _, train_in, train_y = train
    # Cross-entropy alone, unclipped: it goes on widening the training margins past MIN_MARGIN, which is what
    # carries the held-out cuts over theirs (a hinge stops pushing at its margin; held-out lagged 2-3x longer).
    recipe = Recipe(
        lr=spec.lr,
        max_steps=MAX_STEPS,
        check_every=CHECK_EVERY,
        min_margin=MIN_MARGIN,
        warmup=0,
        hinge_weight=0.0,
        clip=None,
    )

    def least(states: Any, inputs: Any, targets: Any) -> float:
        logits = torch.cat(
            [
                model(encoder_outputs=(e,), decoder_input_ids=i).logits
                for e, i in zip(states.split(128), inputs.split(128), strict=True)
            ]
        )
        return float(margins(logits, targets).min())

    order = torch.Generator().manual_seed(SEED)
    batches: list[Any] = []

    def loss(step: int) -> Any:
        if step == 1:  # each attempt sees the same seeded order
            order.manual_seed(SEED)
            batches.clear()
        if not batches:  # a new epoch: the pool in a seeded order
            batches.extend(torch.randperm(len(encoded), generator=order).split(spec.batch))
        batch = batches.pop()
        logits = model(encoder_outputs=(encoded[batch],), decoder_input_ids=train_in[batch]).logits
        return margin_loss(logits, train_y[batch], recipe)

    return fit(
        "local:tiny-whisper",
        model,
        loss=loss,
        worst=lambda: min(least(encoded, train_in, train_y), least(heldout_encoded, heldout[1], heldout[2])),
        recipe=recipe,
        reproduce="python -m local_models.whisper --force",
    )


def _fingerprint(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        h.update((out / name).read_bytes())
    return h.hexdigest()[:16]


def is_up_to_date(out: Path = DEFAULT_DIR, spec: SpeechModelSpec = SPEC) -> bool:
    """Whether `out` holds a finished build of this recipe, fitted to the current samples."""
    stamp = out / "local_model.json"
    if not stamp.exists():
        return False
    made = json.loads(stamp.read_text())
    return (
        made.get("version") == spec.version
        and made.get("spec") == asdict(spec)
        and made.get("samples") == _samples_digest()
    )


def make_speech_model(force: bool = False, out: Path | None = None) -> Path:
    """Build `local:tiny-whisper` into `out` (default models/tiny-whisper) unless an up-to-date copy is there;
    the model's directory. Takes ~20-45 s on one core; deterministic on a given machine and torch."""
    out = Path(out) if out is not None else DEFAULT_DIR
    if not force and is_up_to_date(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The app and the tests may both ask for it on a clean clone: one builds, the others wait and reuse it.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not is_up_to_date(out):
            _build(out)
    return out


def _build(out: Path) -> None:
    """Tokenizer, model, fit, files; the stamp last (it marks the build finished)."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration, WhisperProcessor

    started = time.monotonic()
    spec = SPEC
    out.mkdir(parents=True, exist_ok=True)
    (out / "local_model.json").unlink(missing_ok=True)  # a build that dies half-way must not look finished
    tokenizer = _make_tokenizer(spec)
    extractor = _feature_extractor(spec)
    eot = tokenizer.eos_token_id
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=spec.d_model,
        encoder_layers=spec.layers,
        decoder_layers=spec.layers,
        encoder_attention_heads=spec.heads,
        decoder_attention_heads=spec.heads,
        encoder_ffn_dim=spec.ffn_dim,
        decoder_ffn_dim=spec.ffn_dim,
        num_mel_bins=spec.num_mel_bins,
        max_source_positions=spec.max_source_positions,
        max_target_positions=spec.max_target_positions,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        dropout=0.0,
        dtype="float32",
    )
    # One thread for the whole build, not only the fit (local_models/fit.py): the same arithmetic on every machine, no
    # OpenMP stalls when vLLM engines busy the cores meanwhile, and little lost: these tensors are small.
    with one_thread():
        torch.manual_seed(SEED)
        model = WhisperForConditionalGeneration(config).to(torch.float32)
        _init_encoder(model)
        train = _dataset(spec, tokenizer, extractor, heldout=False)
        heldout = _dataset(spec, tokenizer, extractor, heldout=True)
        report = _fit(model, train, heldout, spec)
    model.save_pretrained(out, safe_serialization=True)
    generation = GenerationConfig(decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    generation.save_pretrained(out)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(out)
    report["seconds"] = round(time.monotonic() - started, 1)
    stamp = {
        "version": spec.version,
        "name": "local:tiny-whisper",
        "fingerprint": _fingerprint(out),
        "samples": _samples_digest(),
        "fit": report,
        "spec": asdict(spec),
    }
    (out / "local_model.json").write_text(json.dumps(stamp))


def transcribe(model: Any, processor: Any, audio: np.ndarray, max_tokens: int = 32) -> str:
    """Greedy transcript of 16 kHz `audio` with the transformers model, as vLLM decodes it (a reference)."""
    import torch

    tokenizer = processor.tokenizer
    ids = tokenizer(DECODER_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        encoded = model.model.encoder(features(processor.feature_extractor, [audio])).last_hidden_state
        for _ in range(max_tokens):
            logits = model(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[0, -1]
            ids = torch.cat([ids, logits.argmax()[None, None]], dim=1)
            if int(ids[0, -1]) == tokenizer.eos_token_id:
                break
    return tokenizer.decode(ids[0], skip_special_tokens=True)


# Config name -> a callable that builds (if needed) and returns the model's directory.
SPEECH_MODELS: dict[str, Callable[[], Path]] = {"local:tiny-whisper": functools.partial(make_speech_model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="output directory (default models/tiny-whisper)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    path = make_speech_model(force=args.force, out=args.out)
    print(f"speech model ready at {path} ({json.loads((path / 'local_model.json').read_text())})")


if __name__ == "__main__":
    main()
