"""A synthesis made away from the event loop, its pieces handed to the loop as they are made.

The embedded backends' work is CPU work in C or ONNX Runtime (the GIL released): it runs in a thread of the
backend's own (one per process for espeak-ng, whose state is global; one per voice for Piper), never the loop's
shared default pool, so that the replica's event loop keeps serving other calls and no pool thread sits waiting for
a backend another call holds. A call's work is a series of steps (a sentence each, core/sentences.py) that `in_turns`
queues on that thread one at a time, each behind the steps other calls queued meanwhile: calls take turns a
sentence at a time, and a short sentence waits for at most one sentence of a long input, not all of it. Everything
a piece needs (resampling to 24 kHz, placing its words) is done in the thread too: the loop only joins pieces.

The thread `put`s each piece as it is made; the caller takes them in `batches`: whatever has been made by the time
it asks, together (a fast backend's sentence in one item, not one item per 100 ms buffer). The first batch goes as
soon as there is one piece (the first sound); later ones at most every `LINGER_S`: by then the client holds the
first piece's audio to play, and espeak-ng, which makes two minutes of speech in ~0.1 s, sends them in a few items
rather than a thousand. `cancel()` (the caller gone) stops the call at its next step (espeak-ng: its next buffer).
The producer may also be a task on the loop itself (tts/backends/openai_http.py: a remote's reads, batched alike).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

from tts.audio import ms
from tts.client import SpeechChunk
from tts.words import WordQueue

T = TypeVar("T")
_END = object()
LINGER_S = 0.05

# A piece of speech as a worker makes it: PCM16 mono at 24 kHz, and the words that start in it (their spans in the
# text, their times in ms from the call's start).
Speech = tuple[bytes, list[tuple[int, int, float]]]


class Pieces(Generic[T]):
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._error: BaseException | None = None
        self.cancelled = False

    # The producer's side (a worker thread, or a task on the loop).
    def put(self, piece: T) -> None:
        self._send(piece)

    def end(self, error: BaseException | None = None) -> None:
        """The producer is done (with `error`, raised in the caller, if it failed)."""
        self._error = error
        self._send(_END)

    def _send(self, item: object) -> None:
        if self.cancelled:  # nobody reads any more (and the loop may be gone)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop closed under a caller that left
            self.cancelled = True

    # The caller's side.
    def cancel(self) -> None:
        self.cancelled = True

    async def batches(self) -> AsyncIterator[tuple[list[T], bool]]:
        """`(pieces made since the last batch, whether the producer is done)`, until it is."""
        done, last = False, None
        while not done:
            got = [await self._queue.get()]
            while True:
                while not self._queue.empty():
                    got.append(self._queue.get_nowait())
                if got[-1] is _END or last is None or (wait := last + LINGER_S - self._loop.time()) <= 0:
                    break
                try:  # (the end may come first: then at once)
                    got.append(await asyncio.wait_for(self._queue.get(), wait))
                except asyncio.TimeoutError:
                    break
            done = got[-1] is _END
            if done:
                got.pop()
                if self._error is not None:
                    raise self._error
            last = self._loop.time()
            yield got, done  # type: ignore[misc]


def in_turns(executor: Executor, pieces: Pieces[Any], steps: Iterator[None]) -> None:
    """Runs `steps` (a generator: one step per `next`, a sentence say) on `executor`, a one-thread executor shared by
    the calls of a backend: each step is queued behind the steps already waiting there, so the calls take turns a
    step at a time. Ends `pieces` once the steps are done (with the error of one that raised); stops, the steps
    closed, at the first step after the caller left."""

    def step() -> None:
        try:
            if pieces.cancelled:
                steps.close()
                return
            next(steps)
        except StopIteration:
            pieces.end()
            return
        except BaseException as e:  # handed to the caller: raised in its task, not lost in this thread
            pieces.end(e)
            return
        try:
            executor.submit(step)
        except RuntimeError as e:  # the executor shut down (the backend closed, the process exiting)
            steps.close()
            pieces.end(e)

    executor.submit(step)


async def speech_chunks(pieces: Pieces[Speech]) -> AsyncIterator[SpeechChunk]:
    """A worker's `Speech` pieces as the backend's items: each batch's audio joined, with the words that start in
    the audio sent so far (the rest at the end)."""
    words, sent = WordQueue(), 0
    async for batch, done in pieces.batches():
        pcm = b"".join(audio for audio, _ in batch)
        for _, placed in batch:
            for start, end, at_ms in placed:
                words.add(start, end, at_ms)
        sent += len(pcm)
        due = words.rest() if done else words.due(ms(sent))
        if pcm or due:
            yield {"audio": pcm, "words": due}
