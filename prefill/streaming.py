"""Keep a growing prompt's KV resident on a prefill engine while its input arrives.

Built on vLLM's streaming input (`AsyncLLM.generate` over an async generator of `StreamingInput`): each
appended chunk is prefilled on arrival, the request keeps its KV blocks between chunks, and nothing already
computed is computed again. Each chunk produces one throw-away token (max_tokens=1); vLLM drops a chunk's
last sampled token from the context, so the resident context is exactly the tokens sent.

Calls on a session never wait for the engine: `sync` records the tokens the session wants resident and a
per-session sender passes them on in short chunks (`max_chunk_tokens`, the scheduler's `partial_chunk_tokens`),
one in flight at a time, so a step of partial input stays short. A version arriving while a chunk prefills
waits for it and the latest goes next, so versions that arrive faster than they prefill are coalesced. vLLM's
streaming input is append-only: when a version changes tokens already sent (a rewrite in update mode, or a
chunk boundary that fell inside a word), the request is truncated in place to the longest common prefix
between two engine steps, whatever its state: a chunk in flight is ended there, part-way through its prefill
(the prefill scheduler frees exactly the KV after the prefix, on the device and in the swap pool;
prefill/scheduler/core.py `invalidate`). Superseded work therefore costs at most the engine step running when
the rewrite came, and a rewrite waits for nothing. A token is sent once it has stood unchanged for
`SETTLE_S` (the prefix every version of the last `SETTLE_S` shares): appended input goes with that lag, however
fast it comes, and a rewrite right behind a version (update traces rewrite ~40 ms apart) is seen before the
tokens it changes are prefilled. While rewrites keep coming (within `REWRITE_QUIET_S`), only the prefix every
recent version shares is prefilled: the unstable rest is computed once, by the hand-off or when rewrites stop.
Where this replica's sessions rewrite (prefill/rewrite_depth.py), a session that has not appended to its input
streams only the share of each fresh version that past rewrites kept, the rest once the version has stood for
`REWRITE_QUIET_S`: a first version's tail is not computed only to be rewritten.

At end of input (`finish_input`) nothing more is streamed: what was not sent yet, the hand-off computes as
complete work. A chunk in flight that holds the input's tokens is waited for, ranked as complete work
meanwhile (so the hand-off never waits behind partial input ranked below it); one the final input no longer
has is aborted.

Every request of the session carries its session id and arrival time (`extra_args`), which the scheduler's
policies rank by. Waits on the engine are bounded: past `timeout` the caller gets `TimeoutError`.

The hand-off to decode is a separate one-token request over the final prompt with `do_remote_decode`
(vLLM does not return `kv_transfer_params` for a streaming request); it hits the prefix cache for every full
block this session computed and the scheduler gives it a copy of the last, partial one, so it computes only
the input that had not been streamed yet. The other way round holds too: a chunk appended to the session's
request shares what the prefix cache holds (a hand-off's blocks, another session's), as a new request would
(prefill/scheduler/cache_hits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from prefill.rewrite_depth import RewriteDepth, is_rewrite

logger = logging.getLogger(__name__)
# A token is prefilled once it has stood unchanged this long: a rewrite right behind a version (update traces
# rewrite ~40 ms apart at the median) is seen before the tokens it changes are computed. The lag is off the
# critical path: at end of input the hand-off computes what was not sent.
SETTLE_S = 0.08
# After a rewrite the input is unstable: only the prefix every recent version shares is prefilled while it
# streams (the rest is computed by the hand-off, as when not streaming), until no rewrite came for this long.
REWRITE_QUIET_S = 1.0


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StreamingPrefill:
    """One session's resident prompt on one engine. `sync(tokens)` sets the tokens the session wants resident
    and returns at once; the session's sender passes them to the engine: at most one chunk in flight, later
    versions coalesced into the next chunk, a rewrite applied between chunks (see the module's docstring)."""

    def __init__(
        self,
        engine: Any,
        request_id: str,
        timeout: float = 60.0,
        settle_s: float | None = None,
        rewrite_quiet_s: float | None = None,
        max_chunk_tokens: int | None = None,
        depth: RewriteDepth | None = None,
    ) -> None:
        self.engine = engine  # engine.llm.Engine
        self.base_id = request_id
        self.arrival = time.time()
        self.timeout = timeout
        self.generation = 0  # bumped on every replacement: each is a new engine request
        self.target: list[int] = []  # the tokens the session wants resident (its latest stable input)
        self.sent: list[int] = []  # the tokens given to the engine request
        self.request_ids: list[str] = []
        self.rewrites = 0
        self.invalidated_tokens = 0  # sent tokens a rewrite dropped (computed or not)
        self.superseded_chunks = 0  # chunks in flight that the final input no longer had (aborted at its end)
        self.chunks_cut = 0  # chunks in flight a rewrite ended part-way (cut between two engine steps)
        self.coalesced = 0  # versions that never reached the engine (a later one did)
        self.closed = False  # closed for good (the session ended): nothing is sent to the engine again
        self.input_done = False  # the turn's input ended: nothing more is streamed (the hand-off computes it)
        self.settle_s = SETTLE_S if settle_s is None else settle_s
        self.rewrite_quiet_s = REWRITE_QUIET_S if rewrite_quiet_s is None else rewrite_quiet_s
        self.max_chunk_tokens = max_chunk_tokens or 2**31  # longer input goes in pieces, one in flight at a time
        self._changes: deque[tuple[float, int]] = deque()  # (when, tokens kept) of the versions of the last settle_s
        self._rewrite_at = -math.inf  # when the latest rewrite came
        self._changed_at = -math.inf  # when the latest version came
        self.depth = depth  # the replica's rewrites, recorded and consulted (None: nothing held for them)
        self.appends = False  # the session extended its input: it streams every version whole
        self._stable = 0  # tokens every version since the rewrites began shares
        self._inflight_from = 0  # tokens resident before the chunk in flight
        self._queue: asyncio.Queue[Any] | None = None
        self._consumer: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._chunks_sent = 0
        self._chunks_done = 0
        self._progress = asyncio.Condition()
        self._lock = asyncio.Lock()  # the engine request is changed by one coroutine at a time
        self._error: BaseException | None = None

    @property
    def active(self) -> bool:
        """Whether the session has an engine request, or input on its way to one."""
        return (self._consumer is not None and not self._consumer.done()) or self.target != self.sent

    @property
    def wanted(self) -> list[int]:
        return self._wanted(time.monotonic())

    def _wanted(self, now: float) -> list[int]:
        """What the session wants resident: the latest tokens, or while rewrites come, only their stable prefix;
        of a fresh version of a session that may rewrite, the share this replica's rewrites keep."""
        cap = len(self.target)
        if now - self._rewrite_at < self.rewrite_quiet_s:
            cap = self._stable
        if self._holding(now):
            assert self.depth is not None
            cap = min(cap, int(self.depth.hold_fraction() * len(self.target)))
        return self.target[: max(cap, common_prefix_len(self.sent, self.target))]  # (what is resident stays)

    def _holding(self, now: float) -> bool:
        """Whether the latest version's tail waits for it to stand (see prefill/rewrite_depth.py)."""
        return self.depth is not None and not self.appends and now - self._changed_at < self.rewrite_quiet_s

    @property
    def goal(self) -> list[int]:
        return self._goal(time.monotonic())

    def _goal(self, now: float) -> list[int]:
        """What the sender makes resident now: of `wanted`, the tokens that stood unchanged for `settle_s`."""
        while self._changes and self._changes[0][0] <= now - self.settle_s:
            self._changes.popleft()
        wanted = self._wanted(now)
        settled = min((kept for _, kept in self._changes), default=len(wanted))
        return wanted[: max(settled, common_prefix_len(self.sent, wanted))]  # (what is resident stays)

    def _grows_at(self, now: float) -> float | None:
        """When `goal` may next grow by itself (a version settles, or the rewrites' quiet time ends)."""
        times = [t + self.settle_s for t, _ in self._changes]
        if self._wanted(now) != self.target:  # the rewrites' or the version's quiet time ends
            times += [t + self.rewrite_quiet_s for t in (self._rewrite_at, self._changed_at)]
            times = [t for t in times if t > now] or [now]  # (one of them is ahead: see `_wanted`)
        return min(times, default=None)

    @property
    def prefilled(self) -> bool:
        """The engine holds the session's whole latest input (nothing held back, waiting to be sent or in flight)."""
        return bool(self.sent) and self.target == self.sent and not self.busy and self._consumer is not None

    @property
    def busy(self) -> bool:
        """A chunk is in flight: the engine has not finished prefilling what it was given."""
        return self._chunks_done < self._chunks_sent

    async def sync(self, tokens: list[int]) -> None:
        """Make `tokens` the session's resident tokens (the sender gets them to the engine)."""
        if self._error is not None:
            raise self._error
        if self.closed:
            return  # a late caller (a re-prefill queued before the session ended) must not start a request
        if self.target != self.sent:
            self.coalesced += 1  # the version not yet sent is superseded before it cost anything
        now = time.monotonic()
        if (lcp := common_prefix_len(self.target, tokens)) < len(self.target):  # a rewrite
            recent = now - self._rewrite_at < self.rewrite_quiet_s
            self._stable = min(self._stable, lcp) if recent else lcp
            self._rewrite_at = now
        if self.target and not is_rewrite(len(self.target), lcp) and len(tokens) > len(self.target):
            self.appends = True
        if self.depth is not None:
            self.depth.record(len(self.target), lcp)
        if tokens != self.target:
            self._changed_at = now
        if self.settle_s > 0:
            self._changes.append((now, lcp))
        self.target, self.input_done = list(tokens), False
        self._wake.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_loop())

    async def _send_loop(self) -> None:
        try:
            while not self.closed and self._error is None:
                now = time.monotonic()
                goal = self._goal(now)
                if self.input_done or goal == self.sent:
                    grows_at = None if self.input_done else self._grows_at(now)
                    await self._sleep(None if grows_at is None else max(0.0, grows_at - now))  # (until it settles)
                    continue
                if self.busy and common_prefix_len(goal, self.sent) == len(self.sent):
                    # More input while a (short) chunk is in flight waits for it: the latest version then goes as
                    # one chunk (versions arriving faster than they prefill cost one chunk, not one each).
                    await self._sleep(None)  # (woken by new input, or by the chunk's completion)
                    continue
                # (A rewrite does not wait: the engine cuts the request between two steps, chunk in flight or not.)
                async with self._lock:
                    if not self.closed and not self.input_done:
                        await self._apply(list(self.goal))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to the session's next call
            logger.exception("streaming prefill %s: sending input failed", self.base_id)
            self._error = e
            async with self._progress:
                self._progress.notify_all()

    async def _sleep(self, timeout: float | None) -> None:
        """Until woken (new input, a chunk done, close), or `timeout` seconds."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _apply(self, tokens: list[int]) -> None:
        """Append the next chunk of `tokens`; a rewrite first cuts the (idle) request back to the common prefix in
        place, or replaces a request that is gone."""
        lcp = common_prefix_len(self.sent, tokens)
        if lcp < len(self.sent):
            self.rewrites += 1
            self.invalidated_tokens += len(self.sent) - lcp
            cut = None
            if self._consumer is not None and not self._consumer.done():
                cut = await self.engine.utility("rtpd_invalidate", self.base_id, lcp)  # cut in place
            if cut is None:  # gone: a new request; the prefix cache gives back the LCP's full blocks
                await self._close()
                self.sent = []
            else:
                kept, ended = cut
                self.sent = self.sent[:kept]
                if ended:  # the chunk in flight was ended there, without output
                    self.chunks_cut += ended
                    async with self._progress:
                        self._chunks_done += ended
                        self._progress.notify_all()
        new = tokens[len(self.sent) : len(self.sent) + self.max_chunk_tokens]
        self._inflight_from = len(self.sent)
        if new:
            if self._consumer is None or self._consumer.done():
                self._start()
            assert self._queue is not None
            self._queue.put_nowait(self._chunk(list(new)))  # a copy: vLLM extends the list it is given
            self._chunks_sent += 1
        self.sent = tokens[: len(self.sent) + len(new)]
        async with self._progress:
            self._progress.notify_all()

    @property
    def extra_args(self) -> dict[str, Any]:
        """What the prefill scheduler ranks this session's requests by (prefill/scheduler/core.py)."""
        return {"rtpd_session": self.base_id, "rtpd_arrival": self.arrival}

    async def input_ended(self) -> None:
        """The session's input is whole: its pending prefill ranks as complete work from now on, ahead of
        every partial input (no priority inversion behind its own hand-off), and is not evicted first."""
        if self._consumer is not None and not self._consumer.done() or self.target != self.sent:
            with contextlib.suppress(Exception):  # (an engine without the streaming scheduler ranks nothing)
                await self.engine.utility("rtpd_input_ended", self.base_id)

    def stop_input(self) -> None:
        """The turn's input ended and its answer needs nothing more from this engine (a preemptive answer made from
        it): nothing more is streamed, and nothing is waited for."""
        self.input_done = True
        self._wake.set()

    async def finish_input(self, timeout: float | None = None) -> None:
        """The turn's input ended: nothing more is streamed (what was not sent, the hand-off computes as
        complete work). A chunk in flight whose tokens are still the input's is waited for, ranked as complete
        work meanwhile, so that the hand-off finds its blocks cached; one the input no longer has is aborted."""
        self.input_done = True
        self._wake.set()
        async with self._lock:  # (the sender is not midway through a change)
            if not self.busy:
                return
            if common_prefix_len(self.sent, self.target) <= self._inflight_from:
                self.superseded_chunks += 1
                await self._close()  # all of it superseded: the hand-off must not wait behind it
                self.sent = []
                return
        await self.input_ended()
        async with self._progress:
            waiting = self._progress.wait_for(lambda: not self.busy or self._error is not None or self.closed)
            await asyncio.wait_for(waiting, timeout or self.timeout)
        if self._error is not None:
            raise self._error

    async def catch_up(self, timeout: float) -> bool:
        """Send the whole latest input now, settling and rewrite holds notwithstanding, and wait (at most `timeout`)
        until the engine has computed it. For a hand-off made while the input may still grow (a preemptive answer
        at a pause): it then reuses the session's KV (full blocks from the prefix cache, the partial one copied),
        where otherwise it would compute the input and the session's request compute it again once it settled.
        Whether the engine holds the whole input (if not, the caller goes on without it; nothing is cut)."""
        if self.closed or self.input_done or self._error is not None:
            return False
        await asyncio.shield(self._send_all())  # (a caller cancelled meanwhile leaves the request consistent)
        with contextlib.suppress(TimeoutError):
            async with self._progress:
                idle = self._progress.wait_for(lambda: not self.busy or self._error is not None or self.closed)
                await asyncio.wait_for(idle, timeout)
        return self.prefilled

    async def _send_all(self) -> None:
        async with self._lock:
            while not self.closed and not self.input_done and self.sent != self.target:
                await self._apply(list(self.target))  # (in max_chunk_tokens pieces, queued behind each other)

    async def wait_computed(self, timeout: float | None = None) -> None:
        """Wait until the engine has prefilled the session's latest tokens (at most `timeout`, default the
        session's admission timeout; then `TimeoutError`)."""

        def done() -> bool:
            return self._error is not None or self.closed or (self.wanted == self.sent and not self.busy)

        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(done), timeout or self.timeout)
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """End the engine request and free its KV blocks (full blocks stay in the prefix cache), for good."""
        self.closed = True  # before the lock: a sync queued behind it finds the session over
        self._wake.set()
        async with self._lock:
            await self._close()
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        self.target = list(self.sent)

    async def _close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None and not consumer.done():
            consumer.cancel()  # closing vLLM's output generator aborts the request
            await asyncio.gather(consumer, return_exceptions=True)
        self._queue = None
        async with self._progress:
            self._chunks_done = self._chunks_sent
            self._progress.notify_all()

    def _chunk(self, token_ids: list[int]) -> Any:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        return StreamingInput(prompt=TokensPrompt(prompt_token_ids=token_ids))

    def _start(self) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.generation += 1
        request_id = f"{self.base_id}-stream{self.generation}"
        self.request_ids.append(request_id)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queue = queue

        async def inputs() -> AsyncGenerator[Any, None]:
            while (item := await queue.get()) is not None:
                yield item

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=self.extra_args,
        )
        outputs = self.engine.client.generate(inputs(), params, request_id)
        self._consumer = asyncio.create_task(self._consume(outputs))

    async def _consume(self, outputs: AsyncGenerator[Any, None]) -> None:
        try:
            async for out in outputs:
                # Each chunk samples exactly one (throw-away) token when it is fully prefilled. Count tokens,
                # not outputs: vLLM merges delta outputs a slow consumer has not taken, keeping one
                # finish_reason for several chunks, but concatenating their tokens.
                done = len(out.outputs[0].token_ids) if out.outputs else 0
                if done:
                    async with self._progress:
                        self._chunks_done += done
                        self._progress.notify_all()
                    self._wake.set()  # the sender may send what waited for this chunk
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine failed this request: surface it to the session
            logger.exception("streaming prefill %s failed", self.base_id)
            self._error = e
            async with self._progress:
                self._progress.notify_all()
            self._wake.set()
        finally:
            await outputs.aclose()
