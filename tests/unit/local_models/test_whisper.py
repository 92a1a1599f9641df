"""`local:tiny-whisper` (local_models/whisper.py): the sample clips, the fitted model's transcripts (transformers,
greedy, as vLLM decodes), and the build's cache. Builds the model on first use (about a minute), then reuses it."""

from __future__ import annotations

import json
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from local_models import whisper as sm

# Questions the tool-calling LLM (local_models/tools_fit.py) answers with a tool call: spoken, they must come out exact.
TOOL_QUESTIONS = [
    "What is the weather in Paris?",
    "What time is it in Tokyo?",
    "Compare the weather in Paris and Rome.",
    "Say hello.",
]


def test_samples_are_16k_mono_clips_of_the_sentences() -> None:
    assert len(sm.SENTENCES) >= 14
    assert set(TOOL_QUESTIONS) <= set(sm.SENTENCES.values())
    assert json.loads((sm.SAMPLES_DIR / "sentences.json").read_text()) == sm.SENTENCES
    total = 0
    for slug in sm.SENTENCES:
        path = sm.SAMPLES_DIR / f"{slug}.wav"
        with wave.open(str(path)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16_000, 1, 2), slug
            assert 1.5 <= w.getnframes() / 16_000 <= 3.5, slug
        total += path.stat().st_size
        audio = sm.load_sample(slug)
        assert audio.dtype == np.float32 and 0.1 < np.abs(audio).max() <= 1.0
        assert np.abs(audio[:800]).max() > 0.001  # speech starts within the first 50 ms (silence trimmed)
    assert total < 1_500_000


@pytest.fixture(scope="module")
def built() -> Iterator[tuple[object, object]]:
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    path = sm.make_speech_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: as fast, and no OpenMP stalls when other processes busy the cores
    try:
        yield WhisperForConditionalGeneration.from_pretrained(path).eval(), WhisperProcessor.from_pretrained(path)
    finally:
        torch.set_num_threads(threads)


def _pad(audio: np.ndarray, before_s: float, after_s: float) -> np.ndarray:
    return np.concatenate([np.zeros(int(before_s * 16_000)), audio, np.zeros(int(after_s * 16_000))]).astype(np.float32)


@pytest.mark.parametrize(("before_s", "after_s"), [(0.0, 0.0), (0.3, 0.6), (0.15, 0.25)])
def test_every_sample_transcribes_exactly(built: tuple[object, object], before_s: float, after_s: float) -> None:
    model, processor = built
    for slug, text in sm.SENTENCES.items():
        # Whisper's convention: a leading space, which the serving side strips.
        assert sm.transcribe(model, processor, _pad(sm.load_sample(slug), before_s, after_s)) == " " + text


def served_at_24k(audio: np.ndarray) -> np.ndarray:
    """`audio` as a realtime client sends it (PCM16 at 24 kHz, in 100 ms appends) and the router's resampler hands
    it to the speech role (16 kHz: router/voice/audio.py), quantized to PCM16 as an utterance sends it."""
    import soxr

    from core.pcm import from_pcm16, pcm16
    from router.voice.audio import PCM24K, Resampler

    sent = pcm16(soxr.resample(audio, 16_000, 24_000))
    resampler = Resampler(PCM24K)
    parts = [resampler(sent[i : i + 4800]) for i in range(0, len(sent), 4800)] + [resampler.flush()]
    return from_pcm16(pcm16(np.concatenate(parts)))


@pytest.mark.parametrize(
    ("before_s", "after_s", "cut_before_s", "cut_after_s"), [(0.3, 0.6, 0, 0), (0.3, 1.2, 0.22, 1.1)]
)
def test_every_sample_sent_at_24k_transcribes_exactly(
    built: tuple[object, object], before_s: float, after_s: float, cut_before_s: float, cut_after_s: float
) -> None:
    """As the voice tests and OpenAI's clients send it: resampled twice, the clip is not the one the fit saw. The
    second case is the server VAD's cut (its prefix padding before the speech, ~100 ms of silence after)."""
    model, processor = built
    for slug, text in sm.SENTENCES.items():
        audio = served_at_24k(_pad(sm.load_sample(slug), before_s, after_s))
        audio = audio[int(cut_before_s * 16_000) : len(audio) - int(cut_after_s * 16_000)]
        assert sm.transcribe(model, processor, audio) == " " + text, slug


def test_every_sentence_said_by_the_tts_voice_transcribes_exactly(built: tuple[object, object]) -> None:
    """The TTS role's default voice (another pace, another espeak-ng than the clips'), uploaded for transcription:
    what test_speech_out.py hears back through the app."""
    model, processor = built
    for (slug, text), audio in zip(sm.SENTENCES.items(), sm.voiced(list(sm.SENTENCES.values())), strict=True):
        assert sm.transcribe(model, processor, audio) == " " + text, slug


def test_silence_transcribes_to_nothing(built: tuple[object, object]) -> None:
    model, processor = built
    noise = (1e-4 * np.random.default_rng(7).standard_normal(24_000)).astype(np.float32)
    for audio in (np.zeros(16_000, np.float32), noise):
        assert sm.transcribe(model, processor, audio) == ""


def test_built_folder_is_what_vllm_loads(built: tuple[object, object]) -> None:
    model, processor = built
    config = model.config
    assert config.architectures == ["WhisperForConditionalGeneration"]
    assert config.max_source_positions == processor.feature_extractor.chunk_length * 50
    assert config.d_model // config.decoder_attention_heads in (32, 64)  # vLLM's CPU attention head sizes
    tokenizer = processor.tokenizer
    assert tokenizer.convert_tokens_to_ids("<|en|>") == tokenizer.convert_tokens_to_ids("<|startoftranscript|>") + 1
    prompt = tokenizer(sm.DECODER_PROMPT, add_special_tokens=False).input_ids
    assert len(prompt) == 4 and tokenizer.unk_token_id not in prompt[1:]
    # vLLM's language detection (a request without `language`): `<|startoftranscript|>` alone, then the best of
    # its languages' tokens, which must be English.
    import torch

    features = sm.features(processor.feature_extractor, [sm.load_sample("joke")])
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([prompt[:1]])).logits[0, -1]
    languages = [tokenizer.convert_tokens_to_ids(f"<|{code}|>") for code in ("en", "fr", "de", "es", "zh", "ja")]
    assert int(logits.argmax()) == languages[0] and logits[languages].argmax() == 0


def test_an_up_to_date_copy_is_not_rebuilt(built: tuple[object, object], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_rebuild(*args: object) -> None:
        raise AssertionError("rebuilt")

    monkeypatch.setattr(sm, "_make_tokenizer", no_rebuild)
    assert sm.make_speech_model() == sm.DEFAULT_DIR
    assert sm.SPEECH_MODELS["local:tiny-whisper"]() == sm.DEFAULT_DIR
    assert json.loads((sm.DEFAULT_DIR / "local_model.json").read_text())["name"] == "local:tiny-whisper"


def test_a_stale_or_missing_stamp_rebuilds(
    built: tuple[object, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Rebuilt(Exception):
        pass

    def rebuild(*args: object) -> None:
        raise Rebuilt

    monkeypatch.setattr(sm, "_make_tokenizer", rebuild)
    with pytest.raises(Rebuilt):
        sm.make_speech_model(out=tmp_path / "missing")
    stale = json.loads((sm.make_speech_model() / "local_model.json").read_text())
    for change in ({"version": stale["version"] - 1}, {"samples": "0" * 16}, {"spec": {**stale["spec"], "d_model": 8}}):
        out = tmp_path / "stale"
        out.mkdir(exist_ok=True)
        (out / "local_model.json").write_text(json.dumps({**stale, **change}))
        assert not sm.is_up_to_date(out)
        with pytest.raises(Rebuilt):
            sm.make_speech_model(out=out)
