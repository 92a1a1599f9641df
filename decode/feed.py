"""One stream per (router replica, decode replica) carrying the frames of every request between them.

Each item that crosses a Ray hop has a fixed cost, and with one stream per request that cost is paid per
token per request: at 128 streams it, not the engine, set the app's token rate. A feed carries, in one item,
everything every one of a router's requests on this replica produced since the last item, so the hop costs one
item per engine step whatever the number of streams. Never waits to batch: an item leaves as soon as the router
asks for the next one and anything is ready.

    router                                  decode replica
      start(stream_id, request) ─────────►  engine request; frames go to the router's outbox
      feed(consumer, replica) ◄── {stream_id: frames}, {stream_id: None | error}, {stream_id: ids} ── outbox
      stop(stream_id)  ─────────►  abort (the client left)

A feed with no stream left ends after a few idle seconds (the router opens a new one with its next request):
a permanent call would keep a draining replica from ever stopping. A feed that attaches while an older one of
the same router is still attached takes the outbox over; the older one puts back what it took and leaves.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from decode import pacing
from decode.sse import Frame

TokenIds = tuple[list[int] | None, list[int]]  # (the prompt's ids, once; the ids generated since the last item)
# (frames by stream, ended streams: None or error, token ids by stream: what the router resumes an answer from)
Batch = tuple[dict[str, str], dict[str, dict[str, Any] | None], dict[str, TokenIds]]

# vLLM's `return_token_ids` fields in a frame. A key in a JSON string value has its quotes escaped, so only the
# real keys match; `"token_ids"` never matches inside `"prompt_token_ids"` (the quote).
_IDS = re.compile(r'"(prompt_token_ids|token_ids)":\[([0-9, ]*)\]')


def take_token_ids(text: str, keep: bool) -> tuple[str, list[int] | None, list[int]]:
    """The frames' token ids (prompt ids, generated ids) and the frames without them (`null`, as vLLM writes a
    frame whose request did not ask for ids) unless `keep`. A regex, not a JSON parse: this is every token's
    path."""
    prompt: list[int] | None = None
    tokens: list[int] = []

    def cut(match: re.Match[str]) -> str:
        nonlocal prompt
        ids = [int(i) for i in match.group(2).split(",")] if match.group(2).strip() else []
        if match.group(1) == "token_ids":
            tokens.extend(ids)
        elif prompt is None:
            prompt = ids
        return match.group(0) if keep else f'"{match.group(1)}":null'

    if "token_ids" not in text:
        return text, None, tokens
    return _IDS.sub(cut, text), prompt, tokens


# A frame that shows text (chat content or reasoning, completion text), and one that ends its choice.
_SHOWS_TEXT = re.compile(r'"(?:content|text|reasoning|reasoning_content)":"[^"]')
_FINISHED = '"finish_reason":"'


class ShownIds:
    """One stream's token ids, each reported once the text it makes has been shown.

    vLLM's detokenizer shows nothing for a token that ends inside a character (byte-level BPE) until a later one
    completes it. A continuation whose prompt ended at such a token is detokenized from a broken prefix, and vLLM
    then writes the whole prompt's text into the answer (a resumed session answer was seen carrying its rendered
    prompt). So the router learns an id only with the text it belongs to, and a resume regenerates the held ones.
    A frame of several ids (decode/pacing.py, a client's own `stream_interval`, speculation) may show the text of its
    first ids only: with the engine's tokenizer, its last ids that show no text yet are held as well
    (`pacing.unshown`), unless it ends the answer."""

    def __init__(self, keep: bool, tokenizer: Any = None, skip_special_tokens: bool = True) -> None:
        self.keep = keep
        self.held: list[int] = []
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # (the request's: how its detokenizer shows them)
        self.recent: list[int] = []  # the last ids made (a character may begin in an earlier frame)

    def take(self, text: str) -> tuple[str, list[int] | None, list[int]]:
        """`take_token_ids` of one frame, its ids held back while it shows no text (unless it ends the answer)."""
        text, prompt, tokens = take_token_ids(text, self.keep)
        shows = _FINISHED in text or _SHOWS_TEXT.search(text) is not None
        return text, prompt, self._release(tokens, shows, text)

    def take_frame(self, frame: Frame) -> tuple[list[int] | None, list[int]]:
        """The ids beside a frame decode/sse.py wrote (nothing to cut out of it), held back as `take` holds them."""
        return frame.prompt_ids, self._release(frame.token_ids, frame.shows, frame)

    def _release(self, tokens: list[int], shows: bool, text: str) -> list[int]:
        """The ids to report with a frame of `tokens` whose SSE text is `text`."""
        unshown = 0
        if self.tokenizer is not None and tokens:
            self.recent += tokens
            del self.recent[:-16]
            if len(tokens) > 1 and shows and _FINISHED not in text:
                unshown = pacing.unshown(self.tokenizer, self.recent, len(tokens), self.skip_special_tokens)
        if tokens and not shows:
            self.held.extend(tokens)
            return []
        if self.held:
            tokens, self.held = self.held + tokens, []
        if unshown:
            tokens, self.held = tokens[:-unshown], tokens[-unshown:]
        return tokens


class Outbox:
    """What one router's streams produced and it has not yet taken."""

    def __init__(self) -> None:
        self.frames: dict[str, list[str]] = {}
        self.ended: dict[str, dict[str, Any] | None] = {}
        self.ids: dict[str, TokenIds] = {}
        self.ready = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}  # stream id -> the task pumping its engine output
        self.drained_at = time.monotonic()  # when the router last took an item (an abandoned outbox is reaped)
        self.owner: object | None = None  # the feed reading it (a newer feed of the same router takes it over)

    @property
    def attached(self) -> bool:
        return self.owner is not None

    @property
    def idle(self) -> bool:
        return not (self.tasks or self.frames or self.ended)

    def put(self, stream_id: str, text: str, prompt: list[int] | None = None, tokens: list[int] | None = None) -> None:
        self.frames.setdefault(stream_id, []).append(text)
        if prompt is not None or tokens:
            had_prompt, had = self.ids.get(stream_id, (None, []))
            self.ids[stream_id] = (had_prompt if had_prompt is not None else prompt, had + (tokens or []))
        self.ready.set()

    def end(self, stream_id: str, error: dict[str, Any] | None = None) -> None:
        self.ended[stream_id] = error
        self.tasks.pop(stream_id, None)
        self.ready.set()

    async def take(self, idle_s: float | None = None) -> Batch | None:
        """Everything ready now (waits until something is); None if nothing came within `idle_s`. (A timer, not
        `asyncio.wait_for`, which makes a task per call: this is every engine step's path.)"""
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self.ready.set()

        timer = None
        if idle_s is not None and not (self.frames or self.ended):
            timer = asyncio.get_running_loop().call_later(idle_s, expire)
        try:
            while not (self.frames or self.ended):  # (another reader may have woken first and taken it)
                if expired:
                    return None
                await self.ready.wait()
                self.ready.clear()
        finally:
            if timer is not None:
                timer.cancel()
        self.ready.clear()
        frames = {sid: "".join(parts) for sid, parts in self.frames.items()}
        ended, ids, self.frames, self.ended, self.ids = self.ended, self.ids, {}, {}, {}
        self.drained_at = time.monotonic()
        return frames, ended, ids

    def restore(self, batch: Batch) -> None:
        """Put back a batch its reader could not deliver (it was taken over), ahead of anything newer."""
        frames, ended, ids = batch
        for stream_id, text in frames.items():
            self.frames[stream_id] = [text, *self.frames.get(stream_id, [])]
        for stream_id, (prompt, tokens) in ids.items():
            newer_prompt, newer = self.ids.get(stream_id, (None, []))
            self.ids[stream_id] = (prompt if prompt is not None else newer_prompt, tokens + newer)
        self.ended = {**ended, **self.ended}
        if frames or ended:
            self.ready.set()

    def hand_over(self, stream_id: str, to: Outbox) -> bool:
        """Move one stream, what it produced and its pump, to another consumer's outbox (a preemptive answer a
        router adopts); False if this outbox never had it or it was taken already."""
        if stream_id not in self.tasks and stream_id not in self.frames and stream_id not in self.ended:
            return False
        if (frames := self.frames.pop(stream_id, None)) is not None:
            to.frames.setdefault(stream_id, []).extend(frames)
        if stream_id in self.ids:
            to.ids[stream_id] = self.ids.pop(stream_id)
        if stream_id in self.ended:
            to.ended[stream_id] = self.ended.pop(stream_id)
        if (task := self.tasks.pop(stream_id, None)) is not None:
            to.tasks[stream_id] = task
        if frames or stream_id in to.ended:
            to.ready.set()
        return True

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
