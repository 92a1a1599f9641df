"""Server VAD on the sample clips: Silero's probabilities turned into OpenAI's server_vad events."""

from __future__ import annotations

import numpy as np

from local_models.whisper import load_sample
from router.voice.vad import FRAME, RATE, SpeechDetector, VadSettings


def run(audio: np.ndarray, settings: VadSettings, chunk: int = 480) -> list:
    detector = SpeechDetector(settings)
    events = []
    for i in range(0, len(audio), chunk):  # (appends of any size: frames are cut by the detector)
        events += detector.feed(audio[i : i + chunk])
    return events


def padded(slug: str, before_s: float, after_s: float) -> tuple[np.ndarray, int, int]:
    clip = load_sample(slug)
    audio = np.concatenate([np.zeros(int(before_s * RATE)), clip, np.zeros(int(after_s * RATE))]).astype(np.float32)
    return audio, int(before_s * RATE), int(before_s * RATE) + len(clip)


def test_a_clip_in_silence_starts_pauses_and_stops_on_the_audio_clock() -> None:
    audio, onset, end = padded("weather_paris", 0.5, 1.0)
    events = run(audio, VadSettings(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500))
    assert [e.kind for e in events] == ["started", "paused", "stopped"]
    started, paused, stopped = events
    # Onset within a frame or two of the clip's start, less the padding; the pause near its end.
    assert abs(started.sample - (onset - 300 * RATE // 1000)) <= 3 * FRAME
    assert started.ms == started.sample * 1000 // RATE
    assert abs(paused.sample - end) <= 4 * FRAME
    assert stopped.sample == paused.sample + 500 * RATE // 1000


def test_silence_and_a_high_threshold_start_nothing() -> None:
    assert run(np.zeros(RATE * 2, np.float32), VadSettings()) == []
    noise = (np.random.default_rng(0).standard_normal(RATE * 2) * 1e-3).astype(np.float32)
    assert run(noise, VadSettings()) == []
    audio, _, _ = padded("say_hello", 0.3, 0.8)
    assert run(audio, VadSettings(threshold=1.0)) == []


def test_a_silence_shorter_than_the_window_keeps_the_turn_open() -> None:
    """Two clips 300 ms apart with a 500 ms window: one turn (a pause, speech again, then the stop)."""
    first, _, _ = padded("say_hello", 0.3, 0.3)
    second, _, _ = padded("thanks", 0.0, 1.0)
    events = run(np.concatenate([first, second]), VadSettings(silence_duration_ms=500))
    kinds = [e.kind for e in events]
    assert kinds[0] == "started" and kinds[-1] == "stopped" and kinds.count("started") == 1
    assert "resumed" in kinds and kinds.count("stopped") == 1
    shorter = run(np.concatenate([first, second]), VadSettings(silence_duration_ms=200))
    assert [e.kind for e in shorter].count("stopped") >= 2


def test_the_silence_window_counts_from_where_the_sound_ended() -> None:
    """Silero's probability stays over the threshold for a frame or two of silence after speech (up to 104 ms past
    a clip's end here): the window must count the silence the user left, not the model's lag. On every clip, the
    turn's end (`stopped` less the window) is within 32 ms of the clip's last sample, and the stop is decided
    within a frame of the window's end."""
    from local_models.whisper import SENTENCES

    window = 500 * RATE // 1000
    for slug in SENTENCES:
        audio, _, end = padded(slug, 0.5, 1.0)
        detector = SpeechDetector(VadSettings(silence_duration_ms=500))
        for i in range(0, len(audio), 320):
            stopped = [e for e in detector.feed(audio[i : i + 320]) if e.kind == "stopped"]
            if stopped:
                break
        assert stopped, slug
        off_ms = (stopped[0].sample - window - end) * 1000 // RATE
        assert abs(off_ms) <= 32, (slug, off_ms)
        assert detector.samples - stopped[0].sample <= FRAME, slug


def test_the_window_ends_with_the_append_that_completes_it() -> None:
    """A microphone's 20 ms appends: the turn stops in the append that holds the window's end, not up to a frame
    (32 ms) later when the frame it falls in is complete."""
    from local_models.whisper import SENTENCES

    append = 320
    for slug in SENTENCES:
        audio, _, _ = padded(slug, 0.5, 1.0)
        detector = SpeechDetector(VadSettings(silence_duration_ms=500))
        for i in range(0, len(audio), append):
            stopped = [e for e in detector.feed(audio[i : i + append]) if e.kind == "stopped"]
            if stopped:
                break
        assert stopped, slug
        received = i + append
        assert 0 <= received - stopped[0].sample < append, (slug, received - stopped[0].sample)


def test_speech_again_before_the_window_ends_keeps_the_turn() -> None:
    """Deciding before the frame is complete still heeds every frame the model has heard: speech that resumes
    50 ms before the window's end, wherever that falls within the model's frame, is one turn with what came
    before."""
    clip, _, _ = padded("weather_paris", 0.5, 1.0)
    for shift in range(0, FRAME, 64):
        first = np.concatenate([np.zeros(shift, np.float32), clip])
        stop = next(e for e in run(first, VadSettings(silence_duration_ms=500), 320) if e.kind == "stopped").sample
        for slug in ("joke", "two_plus_two", "thanks"):
            cut = stop - 50 * RATE // 1000
            audio = np.concatenate([first[:cut], load_sample(slug).astype(np.float32), np.zeros(RATE, np.float32)])
            kinds = [e.kind for e in run(audio, VadSettings(silence_duration_ms=500), 320)]
            assert kinds.count("started") == 1 and kinds.count("stopped") == 1, (shift, slug, kinds)
