"""Held answers: a preemptive answer stops at its cap with its KV kept, and goes on from there when its turn is
confirmed, with nothing computed again.

A preemptive answer (prefill/preemptive.py) is made before the turn is confirmed, and whatever it makes past the
first few tokens is wasted when the user goes on. Decode runs it as a vLLM streaming-input request
(`AsyncLLM.generate` over a stream of `StreamingInput`): the first input is the prompt with `max_tokens` = the cap.
At the cap the engine keeps the request and its KV blocks, waiting for more input (WAITING_FOR_STREAMING_REQ).
`release` sends the second input: the last token it sampled (vLLM drops a chunk's last sampled token from the
context) with the rest of the answer's `max_tokens`, so the answer goes on exactly as one uninterrupted request
would. The serving layer above sees one stream: the end of the first input is hidden from it.

Only requests whose sampling the split cannot change are held (`holdable`); others keep the cap of
decode/server.py (the stream ends there and a router goes on from its ids, router/streams/resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncGenerator, Iterator
from typing import Any

logger = logging.getLogger(__name__)
# The longest an answer is held at its cap. Past it the engine request ends (its KV freed: a held request can be
# neither preempted nor evicted) and the stream ends at the cap as an answer not held does (`expired`).
HOLD_MAX_S = 10.0
# Tokens fed again to held answers that went on, in this process: one each. vLLM counts it a prompt token (it is
# its second input's); it is the decode step an answer never held would have run on it (decode's stats).
fed_again = 0


def tokens_fed_again() -> int:
    return fed_again


# The hold for the request the serving layer is about to start (`starting`, around that call).
HOLD: contextvars.ContextVar[Hold | None] = contextvars.ContextVar("rtpd_hold", default=None)


@contextlib.contextmanager
def starting(hold: Hold | None) -> Iterator[None]:
    """The request the serving layer starts within this block is held by `hold` (if it can be)."""
    token = HOLD.set(hold)
    try:
        yield
    finally:
        HOLD.reset(token)


def holdable(params: Any, cap: int) -> bool:
    """Whether a request with these SamplingParams can stop at `cap` and go on unchanged: one sequence streamed
    in deltas (what vLLM's streaming input takes: no stop strings), more to make than the cap, and nothing whose
    state the split resets (output-token penalties and min_tokens count the output, which the second input
    moves into the prompt; a grammar's, a watermark's or a thinking budget's state; a seed's generator)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return (
        isinstance(params, SamplingParams)
        and params.n == 1
        and params.output_kind == RequestOutputKind.DELTA
        and not params.stop
        and params.max_tokens is not None
        and params.max_tokens > cap
        and not params.min_tokens
        and not params.presence_penalty
        and not params.frequency_penalty
        and params.structured_outputs is None
        and params.seed is None
        and params.prompt_logprobs is None
        and not params.bad_words
        and not params.watermarking
        and params.thinking_token_budget is None
        and not params.repetition_detection
    )


class Hold:
    """One held answer: its first input ends at `cap` tokens; `release` lets it go on."""

    def __init__(self, cap: int, max_s: float = HOLD_MAX_S) -> None:
        self.cap, self.max_s = cap, max_s
        self.used = False  # the serving layer's request is this hold's (`holdable`)
        self.expired = False  # held `max_s` without a release: its request ended at the cap
        self.closed = False  # its stream is being stopped: it never goes on
        self._released = asyncio.Event()
        self._first_end: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._last_token: int | None = None

    @property
    def held(self) -> bool:
        """It stopped at the cap and waits for `release` (its KV blocks kept)."""
        capped = self._first_end.done() and self._first_end.result()
        return capped and not self._released.is_set() and not self.expired

    def release(self) -> None:
        """The turn is confirmed: the answer goes on (at once if it is at its cap, else when it gets there)."""
        if not self.closed:
            self._released.set()

    def close(self) -> None:
        """Its stream is about to be stopped (call before cancelling it): a release that comes while vLLM aborts
        the request must not send the second input, which would start the answer again as a request of its own."""
        self.closed = True
        self._released.set()

    async def _inputs(self, prompt: Any, first: Any, rest: Any) -> AsyncGenerator[Any, None]:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        yield StreamingInput(prompt=prompt, sampling_params=first)
        if not await self._first_end:  # it ended within the cap: the answer is whole
            return
        try:
            await asyncio.wait_for(self._released.wait(), self.max_s)
        except TimeoutError:
            self.expired = True
            return  # (vLLM's last input: the request ends, its KV freed)
        if self.closed:  # (not the last input either: vLLM cancels this stream as it aborts the request)
            await asyncio.Event().wait()
        assert self._last_token is not None
        global fed_again
        fed_again += 1
        yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=[self._last_token]), sampling_params=rest)

    async def generate(
        self, client: Any, prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        """`client.generate` as the serving layer called it, in two inputs split at the cap."""
        first, rest = params.clone(), params.clone()
        first.max_tokens = self.cap
        rest.max_tokens = params.max_tokens - self.cap
        rest.extra_args = {k: v for k, v in (params.extra_args or {}).items() if k != "kv_transfer_params"} or None
        prompt_ids: list[int] | None = None
        try:
            async for out in client.generate(self._inputs(prompt, first, rest), params, request_id, **kwargs):
                if prompt_ids is None and out.prompt_token_ids is not None:
                    prompt_ids = list(out.prompt_token_ids)  # (vLLM appends each input's tokens to it)
                out.prompt_token_ids = prompt_ids  # (usage counts the answer's prompt, not the token fed again)
                completion = out.outputs[0] if out.outputs else None
                if completion is not None and completion.token_ids:
                    self._last_token = completion.token_ids[-1]
                if not self._first_end.done() and completion is not None and completion.finish_reason is not None:
                    capped = completion.finish_reason == "length"
                    if capped:  # the cap, not the answer's end: nobody above sees it
                        completion.finish_reason = completion.stop_reason = None
                    self._first_end.set_result(capped)
                yield out
        finally:
            if not self._first_end.done():
                self._first_end.set_result(False)


class HoldingClient:
    """The serving layer's engine client: vLLM's own, except that a request started under a `Hold` (HOLD) that
    it can take is held at the cap."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncGenerator[Any, None]:
        hold = HOLD.get()
        reasoning = kwargs.get("reasoning_ended") is not None or kwargs.get("reasoning_parser_kwargs") is not None
        if hold is None or hold.used or reasoning or not holdable(params, hold.cap):
            return self._client.generate(prompt, params, request_id, **kwargs)
        hold.used = True
        return hold.generate(self._client, prompt, params, request_id, **kwargs)


def install(engine: Any) -> bool:
    """Start the serving layers' requests on a HoldingClient (engine/llm.py `Engine`, once started), unless
    the engine schedules asynchronously (vLLM's default on CUDA): a streaming-input request stopped at its
    `max_tokens` can then be left unschedulable or handed a token of the step in flight (vllm-project/vllm#50692,
    vllm-project/vllm-omni#5183), so preemptive answers keep the cap that ends their stream instead."""
    if engine.async_scheduling:
        logger.info("async scheduling: preemptive answers stop at their cap instead of being held there")
        return False
    for serving in engine.serving_layers:
        serving.engine_client = HoldingClient(serving.engine_client)
    return True
