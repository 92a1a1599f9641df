"""A synthesis run in a worker thread, its pieces handed to the event loop as they are made.

The embedded backends' work is CPU work in C or ONNX Runtime (the GIL released): it runs in a thread so that the
replica's event loop keeps serving other calls. The thread `put`s each piece as it is made; the caller takes them
in `batches`: whatever has been made by the time it asks, together (a fast backend's sentence in one item, not one
item per 100 ms buffer). The first batch goes as soon as there is one piece (the first sound); later ones at most
every `LINGER_S`: by then the client holds the first piece's audio to play, and espeak-ng, which makes two minutes
of speech in ~0.1 s, sends them in a few items rather than a thousand. `cancel()` (the caller gone) tells the thread
to stop at its next piece.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()
LINGER_S = 0.05


class Pieces(Generic[T]):
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._error: BaseException | None = None
        self.cancelled = False

    # The worker thread's side.
    def put(self, piece: T) -> None:
        self._send(piece)

    def end(self, error: BaseException | None = None) -> None:
        """The thread is done (with `error`, raised in the caller, if it failed)."""
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
        """`(pieces made since the last batch, whether the thread is done)`, until it is."""
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
