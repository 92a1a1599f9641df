"""One sentence's audio from the TTS role (tts/client.py), read in a task of its own: a spoken message's sentence
(router/realtime/audio_out.py `AudioOut`), or a held preemptive answer's first one (router/realtime/early_speech.py).

Its chunks go into a queue as the TTS role streams them, None last. A failure is a chunk too: the TTS role's error
chunk, or one made here (`failure`) when the call raised (its replica died) or sent nothing for `CHUNK_TIMEOUT_S`.
`close()` (not needed: interrupted, failed, discarded) cancels the task; a stream not read to its end is closed, which
cancels the synthesis on its replica (tts/client.py `SpeechStream`, which bounds each wait).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tts.client import SpeechChunk, SpeechStream

CHUNK_TIMEOUT_S = 10.0  # a synthesis that sends nothing for this long has failed
Key = tuple[str, str, float]  # what a synthesis speaks: (text, voice, speed)


def failure(message: str) -> SpeechChunk:
    """A failure of the call itself, as the TTS role's error chunks are."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "tts_failed"}}


class Synthesis:
    """One sentence's audio from the TTS role, read in a task of its own into a queue (None ends it)."""

    def __init__(self, tts: Any, text: str, voice: str, speed: float) -> None:
        self.key: Key = (text, voice, speed)
        self.queue: asyncio.Queue[SpeechChunk | None] = asyncio.Queue()
        self.closed = False
        self.task = asyncio.create_task(self._read(tts))

    async def _read(self, tts: Any) -> None:
        text, voice, speed = self.key
        stream: SpeechStream | None = None
        try:
            stream = SpeechStream(tts.synthesize(text, voice=voice, speed=speed), CHUNK_TIMEOUT_S)
            while (chunk := await stream.next()) is not None:
                self.queue.put_nowait(chunk)
        except TimeoutError:
            self.queue.put_nowait(failure(f"the TTS role sent no audio for {CHUNK_TIMEOUT_S:g} s"))
        except Exception as e:  # its replica died (Ray's errors), or the call could not be made
            self.queue.put_nowait(failure(f"the TTS role failed ({type(e).__name__})"))
        finally:
            self.queue.put_nowait(None)
            if stream is not None:
                stream.close()

    async def next(self) -> SpeechChunk | None:
        return await self.queue.get()

    def close(self) -> None:
        """Not needed (interrupted, failed, discarded): stopped, its TTS stream closed. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.task.cancel()
        self.queue.put_nowait(None)  # (a task cancelled before it ran never ends its queue)
