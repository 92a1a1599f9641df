"""Under load, a text answer leaves decode a few tokens a frame: vLLM's own `stream_interval`, chosen per request.

Every frame costs the same whatever it carries: vLLM's output handler makes a RequestOutput and wakes the
request's task, decode/sse.py fills a frame, the feed carries it, the router writes it to the client's socket and
the proxy reads and writes it again. With many streams on a replica, one frame per token is most of the serving
CPU per token (bench/token_path.py), and those cores are the engine's on a CPU machine and the relay's ceiling on
a GPU one. So a chat answer that is nothing but text (decode/sse.py `text_only`) started while the replica runs at
least `min_streams` streams gets `stream_interval` = `tokens`: vLLM sends its first token and its end at once and
the tokens between `tokens` at a time, each at most `tokens - 1` engine steps late. With fewer streams every token
leaves the moment it is made. The interval is chosen when the request starts and kept to its end. Only decode's
own encoder paces (`decode.text_encoder: decode`, the default): with vLLM's generator every token is a frame.

A frame of several tokens can end inside a character (byte-level BPE), its last tokens' text not shown yet:
decode/feed.py `ShownIds` reports those ids only with the frame that shows their text (`unshown`), as it does for a
frame of one such token.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pace:
    """The stream interval for the request started within `pacing`, and its sampling parameters once it is."""

    tokens: int
    started: list[Any] = field(default_factory=list)  # (the SamplingParams the serving layer passed to generate)

    def apply(self) -> None:
        """The request is a text-only stream: it goes `tokens` at a time (set before the engine sees the request:
        `generate` is an async generator, run from the stream's first read)."""
        for params in self.started:  # (a client's own larger interval stands)
            params.stream_interval = max(params.stream_interval or 1, self.tokens)


PACE: contextvars.ContextVar[Pace | None] = contextvars.ContextVar("rtpd_pace", default=None)


@contextlib.contextmanager
def pacing(tokens: int) -> Iterator[None]:
    """The text-only stream the serving layer starts within this block goes `tokens` at a time (1: each token)."""
    token = PACE.set(Pace(tokens) if tokens > 1 else None)
    try:
        yield
    finally:
        PACE.reset(token)


def apply() -> None:
    """Called by decode/sse.py for a text-only stream started within `pacing`."""
    if (pace := PACE.get()) is not None:
        pace.apply()


class PacedClient:
    """The serving layer's engine client: vLLM's own (or the hold's, decode/hold.py), noting the sampling
    parameters of a request started within `pacing`."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncGenerator[Any, None]:
        if (pace := PACE.get()) is not None and hasattr(params, "stream_interval"):
            pace.started.append(params)
        return self._client.generate(prompt, params, request_id, **kwargs)


def install(engine: Any) -> None:
    for serving in engine.serving_layers:
        serving.engine_client = PacedClient(serving.engine_client)


def unshown(tokenizer: Any, generated: list[int], new: int, skip_special_tokens: bool = True) -> int:
    """How many of the last `new` ids of `generated` (a frame's, whose text shows) end inside a character: their
    text is not in the frame yet. vLLM's detokenizer holds text back while the decoded bytes end in an incomplete
    character (U+FFFD), so the same test on a window of the last ids (a character is at most four bytes, each id
    at least one) tells how many."""
    for k in range(new - 1):  # (the frame shows text: its first id's at least)
        end = len(generated) - k
        window = generated[max(0, end - 8) : end]
        if not tokenizer.decode(window, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            return k
    return new - 1
