"""Client audio formats (router/voice/audio.py, router/voice/encode.py): parsing GA and beta names, G.711 decoding
and encoding, 16-bit PCM checks, streaming resampling, and speech encoded in a client's output format."""

from __future__ import annotations

import numpy as np
import pytest

from router.voice.audio import PCM24K, AudioError, AudioFormat, Resampler, b64decode, parse_format, samples
from router.voice.encode import Encoder, alaw, ulaw


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"type": "audio/pcm", "rate": 24000}, PCM24K),
        ({"type": "audio/pcm"}, PCM24K),
        ({"type": "audio/pcm", "rate": 16000}, AudioFormat("pcm16", 16000)),
        ("pcm16", PCM24K),
        ({"type": "audio/pcmu"}, AudioFormat("ulaw", 8000)),
        ("g711_alaw", AudioFormat("alaw", 8000)),
    ],
)
def test_formats_ga_and_beta(value, expected) -> None:
    assert parse_format(value, "session.audio.input.format") == expected


@pytest.mark.parametrize(
    ("value", "param"),
    [({"type": "audio/pcm", "rate": 11025}, "f.rate"), ({"type": "audio/ogg"}, "f"), ("wav", "f"), (3, "f")],
)
def test_unknown_formats_are_refused_naming_the_field(value, param) -> None:
    with pytest.raises(AudioError) as e:
        parse_format(value, "f")
    assert e.value.param == param


def test_g711_tables_match_the_standard_expansion() -> None:
    audioop = pytest.importorskip("audioop")
    every = bytes(range(256))
    for codec, decode in (("ulaw", audioop.ulaw2lin), ("alaw", audioop.alaw2lin)):
        reference = np.frombuffer(decode(every, 2), "<i2") / 32768.0
        assert np.array_equal(samples(every, AudioFormat(codec, 8000)), reference.astype(np.float32))


def test_odd_pcm16_byte_counts_and_bad_base64_are_refused() -> None:
    with pytest.raises(AudioError, match="even"):
        samples(b"\x00\x01\x02", PCM24K)
    with pytest.raises(AudioError):
        b64decode("not base64!!")
    with pytest.raises(AudioError):
        b64decode(None)


def test_resampling_in_chunks_matches_resampling_whole() -> None:
    """24 kHz in 100 ms appends comes out as 16 kHz with no seams: close to the whole signal resampled at once."""
    import soxr

    t = np.arange(24000 * 2) / 24000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    pcm = (tone * 32767).astype("<i2").tobytes()
    resampler = Resampler(PCM24K)
    parts = [resampler(pcm[i : i + 4800]) for i in range(0, len(pcm), 4800)] + [resampler.flush()]
    streamed = np.concatenate(parts)
    whole = soxr.resample(samples(pcm, PCM24K), 24000, 16000, quality="LQ")
    assert abs(len(streamed) - len(whole)) <= 2
    n = min(len(streamed), len(whole))
    assert np.max(np.abs(streamed[:n] - whole[:n])) < 1e-3
    assert np.max(np.abs(streamed[:n] - soxr.resample(samples(pcm, PCM24K), 24000, 16000)[:n])) < 5e-3  # HQ's


def test_the_resampler_holds_back_little_audio() -> None:
    """What the filter keeps until more audio comes is what the VAD hears late: under 8 ms (libsoxr HQ: 21 ms)."""
    resampler = Resampler(PCM24K)
    pcm = np.zeros(24000, "<i2").tobytes()
    out = sum(len(resampler(pcm[i : i + 960])) for i in range(0, len(pcm), 960))  # 20 ms appends
    assert 16000 - out < 8 * 16


def test_same_rate_audio_passes_through() -> None:
    fmt = AudioFormat("pcm16", 16000)
    pcm = (np.arange(100, dtype="<i2") * 10).tobytes()
    assert np.array_equal(Resampler(fmt)(pcm), samples(pcm, fmt))


def test_g711_encoding_matches_the_reference_for_every_sample() -> None:
    audioop = pytest.importorskip("audioop")
    every = np.arange(-32768, 32768, dtype="<i2")
    assert ulaw(every) == audioop.lin2ulaw(every.tobytes(), 2)
    assert alaw(every) == audioop.lin2alaw(every.tobytes(), 2)


@pytest.mark.parametrize("codec", ["ulaw", "alaw"])
def test_speech_encoded_as_g711_at_8_khz_decodes_back_close_to_it(codec: str) -> None:
    """24 kHz PCM16 (the TTS role's) as G.711 at 8 kHz, in 100 ms pieces then flushed: as long as the speech, and
    the tone heard back."""
    import soxr

    t = np.arange(24000) / 24000
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)
    pcm = (tone * 32767).astype("<i2").tobytes()
    encoder = Encoder(AudioFormat(codec, 8000), 24000)
    out = b"".join(encoder(pcm[i : i + 4800]) for i in range(0, len(pcm), 4800)) + encoder.flush()
    assert len(out) == 8000  # one byte a sample, the whole second
    heard = samples(out, AudioFormat(codec, 8000))
    expected = soxr.resample(tone.astype(np.float32), 24000, 8000)
    assert np.max(np.abs(heard[100:-100] - expected[100:-100])) < 0.02


def test_pcm16_at_the_speech_rate_passes_through_and_other_rates_are_resampled() -> None:
    pcm = (np.arange(2400, dtype="<i2") * 3).tobytes()
    encoder = Encoder(PCM24K, 24000)
    assert encoder(pcm) == pcm and encoder.flush() == b""
    encoder = Encoder(AudioFormat("pcm16", 16000), 24000)
    out = encoder(pcm) + encoder.flush()
    assert len(out) == 1600 * 2
