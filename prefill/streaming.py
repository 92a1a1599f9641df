"""Keep a growing prompt's KV resident on a prefill engine while its input arrives.

Built on vLLM's streaming input (`AsyncLLM.generate` over an async generator of `StreamingInput`): each
appended chunk is prefilled on arrival, the request keeps its KV blocks between chunks, and nothing already
computed is computed again. Each chunk produces one throw-away token (max_tokens=1); vLLM drops a chunk's
last sampled token from the context, so the resident context is exactly the tokens sent.

vLLM's streaming input is append-only. When retokenising the input changes tokens already sent (a rewrite in
update mode, or a chunk boundary that fell inside a word), the prefill scheduler truncates the idle request
to the longest common prefix of the old and new tokens, freeing exactly the KV after it (on the device and
in the swap pool; prefill/scheduler/core.py `invalidate`), and the new suffix is appended. Should the
request not be idle, it is replaced by a new one, and the prefix cache gives back the LCP's full blocks.

Every request of the session carries its session id and arrival time (`extra_args`), which the scheduler's
policies rank by. Waits on the engine are bounded: past `timeout` the caller gets `TimeoutError`.

The hand-off to decode is a separate one-token request over the final prompt with `do_remote_decode`
(vLLM does not return `kv_transfer_params` for a streaming request); it hits the prefix cache for every full
block this session computed, so it computes at most the last partial block plus whatever input had not
been streamed yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

logger = logging.getLogger(__name__)
REWRITE_WAIT_S = 2.0  # how long a rewrite waits for the engine request to go idle before replacing it


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StreamingPrefill:
    """One session's resident prompt on one engine: `sync(tokens)` makes the resident tokens equal `tokens`."""

    def __init__(self, engine: Any, request_id: str, timeout: float = 60.0) -> None:
        self.engine = engine  # serve_app.engine.Engine
        self.base_id = request_id
        self.arrival = time.time()
        self.timeout = timeout
        self.generation = 0  # bumped on every rewrite: each rewrite is a new engine request
        self.sent: list[int] = []
        self.request_ids: list[str] = []
        self.rewrites = 0
        self.invalidated_tokens = 0
        self._queue: asyncio.Queue[Any] | None = None
        self._consumer: asyncio.Task[None] | None = None
        self._chunks_sent = 0
        self._chunks_done = 0
        self._progress = asyncio.Condition()
        self._lock = asyncio.Lock()  # calls on one session may run concurrently on the replica
        self._error: BaseException | None = None
        self.closed = False  # closed for good (the session ended): nothing is sent to the engine again

    @property
    def active(self) -> bool:
        return self._consumer is not None and not self._consumer.done()

    async def sync(self, tokens: list[int]) -> None:
        """Append the new suffix of `tokens`, or replace the request when a sent token changed."""
        async with self._lock:
            await self._sync(tokens)

    async def _sync(self, tokens: list[int]) -> None:
        if self.closed:
            return  # a late caller (a re-prefill queued before the session ended) must not start a request
        if self._error is not None:
            raise self._error
        lcp = common_prefix_len(self.sent, tokens)
        if lcp < len(self.sent):
            self.rewrites += 1
            self.invalidated_tokens += len(self.sent) - lcp
            kept = None
            if self.active:
                with contextlib.suppress(TimeoutError):  # a short wait for the request to go idle, never more
                    await self.wait_computed(REWRITE_WAIT_S)
            if self.active and self._chunks_done >= self._chunks_sent:  # idle: truncate it in place
                kept = await self.engine.utility("rtpd_invalidate", self.base_id, lcp)
            if kept is None:  # busy (or gone): replace it; the prefix cache gives back the LCP's full blocks
                await self._close()
                self.sent = []
            else:
                self.sent = self.sent[:kept]
        new = tokens[len(self.sent) :]
        if not new:
            return
        if not self.active:
            self._start()
        assert self._queue is not None
        self._queue.put_nowait(self._chunk(list(new)))  # a copy: vLLM extends the list it is given
        self.sent = list(tokens)
        self._chunks_sent += 1

    @property
    def extra_args(self) -> dict[str, Any]:
        """What the prefill scheduler ranks this session's requests by (prefill/scheduler/core.py)."""
        return {"rtpd_session": self.base_id, "rtpd_arrival": self.arrival}

    async def wait_computed(self, timeout: float | None = None) -> None:
        """Wait until the engine has prefilled everything sent so far (at most `timeout`, default the
        session's admission timeout; then `TimeoutError`)."""
        async with self._progress:
            await asyncio.wait_for(
                self._progress.wait_for(lambda: self._chunks_done >= self._chunks_sent or self._error is not None),
                timeout or self.timeout,
            )
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """End the engine request and free its KV blocks (full blocks stay in the prefix cache), for good."""
        self.closed = True  # before the lock: a sync queued behind it finds the session over
        async with self._lock:
            await self._close()

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
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine failed this request: surface it to the session
            logger.exception("streaming prefill %s failed", self.base_id)
            self._error = e
            async with self._progress:
                self._progress.notify_all()
        finally:
            await outputs.aclose()
