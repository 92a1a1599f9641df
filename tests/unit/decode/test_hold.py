"""decode/hold.py: a held answer's two inputs, what the serving layer above sees, and which requests are held.
The engine here is a script of vLLM's streaming-input behaviour (the end to end test is
tests/integration/test_preemptive.py: the real engine holds it with its KV, and nothing is computed again)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from decode.hold import Hold, HoldingClient, holdable, install, starting, tokens_fed_again

PROMPT = [1, 5, 9, 12]


def params(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 10), output_kind=RequestOutputKind.DELTA, **kw)


def output(prompt_ids: list[int], token: int, finish: str | None, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "", [token], None, None, finish_reason=finish)
    return RequestOutput("r", None, prompt_ids, None, [completion], finished)


class Engine:
    """vLLM's streaming input as the caller sees it: each input makes its `max_tokens` tokens (token n is 100 + n)
    and ends with finish_reason "length" and `finished` False while the input stream is open; the prompt ids
    grow by each later input's tokens (the same list, as vLLM's)."""

    def __init__(self, end_at: int | None = None) -> None:
        self.inputs: list[tuple[list[int], int]] = []  # (prompt ids, max_tokens) of each input
        self.end_at = end_at  # the model's end of sequence at this token

    async def generate(self, stream: Any, params: SamplingParams, request_id: str) -> AsyncGenerator[Any, None]:
        prompt_ids: list[int] = []
        made = 0
        if isinstance(stream, dict):  # (an ordinary request: one input)
            stream = one(stream, params)
        async for chunk in stream:
            ids = list(chunk.prompt["prompt_token_ids"])
            prompt_ids.extend(ids)
            self.inputs.append((ids, chunk.sampling_params.max_tokens))
            for i in range(chunk.sampling_params.max_tokens):
                made += 1
                if made == self.end_at:
                    yield output(prompt_ids, 100 + made, "stop")
                    break
                last = i == chunk.sampling_params.max_tokens - 1
                yield output(prompt_ids, 100 + made, "length" if last else None)
        # (the input stream closed: vLLM's generate ends)


async def one(prompt: dict, params: SamplingParams) -> AsyncGenerator[Any, None]:
    from vllm.engine.protocol import StreamingInput

    yield StreamingInput(prompt=prompt, sampling_params=params)


async def collect(client: HoldingClient, hold: Hold | None, sp: SamplingParams, release_after: int | None = None):
    with starting(hold):
        stream = client.generate({"prompt_token_ids": list(PROMPT)}, sp, "r")
    seen: list[tuple[int, str | None, int]] = []
    async for out in stream:
        c = out.outputs[0]
        seen.append((c.token_ids[-1], c.finish_reason, len(out.prompt_token_ids)))
        if hold is not None and release_after is not None and len(seen) == release_after:
            await asyncio.sleep(0.01)
            assert hold.held
            hold.release()
    return seen


def test_a_held_answer_stops_at_its_cap_and_goes_on_from_its_last_token_when_released() -> None:
    async def run() -> None:
        engine = Engine()
        hold = Hold(3)
        before = tokens_fed_again()
        seen = await collect(HoldingClient(engine), hold, params(max_tokens=10), release_after=3)
        assert hold.used and tokens_fed_again() == before + 1  # (decode's stats: a decode step, not a prompt's)
        # One stream above: tokens 101..110, the only finish_reason the answer's own, the prompt as it was.
        assert [t for t, _, _ in seen] == list(range(101, 111))
        assert [f for _, f, _ in seen] == [None] * 9 + ["length"]
        assert {n for _, _, n in seen} == {len(PROMPT)}
        # Below: the prompt with max_tokens at the cap, then the cap's last token (vLLM drops it from the
        # context) with the rest.
        assert engine.inputs == [(PROMPT, 3), ([103], 7)]

    asyncio.run(run())


def test_nothing_goes_on_before_release() -> None:
    async def run() -> None:
        engine = Engine()
        hold = Hold(2)
        task = asyncio.ensure_future(collect(HoldingClient(engine), hold, params(max_tokens=6)))
        await asyncio.sleep(0.05)
        assert hold.held and len(engine.inputs) == 1 and not task.done()
        hold.release()
        assert [t for t, _, _ in await asyncio.wait_for(task, 5)] == list(range(101, 107))

    asyncio.run(run())


def test_an_answer_that_ends_within_its_cap_is_not_held() -> None:
    async def run() -> None:
        engine = Engine(end_at=2)
        hold = Hold(3)
        seen = await asyncio.wait_for(collect(HoldingClient(engine), hold, params(max_tokens=10)), 5)
        assert seen[-1][:2] == (102, "stop") and not hold.held and len(engine.inputs) == 1

    asyncio.run(run())


def test_what_is_held() -> None:
    assert holdable(params(max_tokens=10), 3)
    assert holdable(params(max_tokens=10, temperature=0.7, top_p=0.9, repetition_penalty=1.1), 3)
    assert not holdable(params(max_tokens=3), 3)  # (nothing past the cap)
    assert not holdable(params(max_tokens=10, stop=["."]), 3)  # (vLLM's streaming input takes no stop strings)
    assert not holdable(params(max_tokens=10, frequency_penalty=0.5), 3)  # (counts output the split moves)
    assert not holdable(params(max_tokens=10, min_tokens=5), 3)
    assert not holdable(params(max_tokens=10, seed=7), 3)
    assert not holdable(params(max_tokens=10, n=2), 3)
    assert not holdable(SamplingParams(max_tokens=10), 3)  # (a final-only request)


def test_requests_started_without_a_hold_go_straight_to_the_engine() -> None:
    async def run() -> None:
        engine = Engine()
        client = HoldingClient(engine)
        seen = await collect(client, None, params(max_tokens=4))  # (one input: 4 tokens, no hold involved)
        assert len(seen) == 4 and engine.inputs == [(PROMPT, 4)]
        hold = Hold(3)
        await collect(client, hold, params(max_tokens=10, stop=["x"]))  # not holdable: vLLM's own request
        assert not hold.used

    asyncio.run(run())


def test_holds_only_on_an_engine_that_schedules_synchronously() -> None:
    """vLLM's streaming input stopped at a segment's max_tokens is unsafe under async scheduling (CUDA's default)."""

    class Serving:
        engine_client = object()

    class Engine:
        def __init__(self, async_scheduling: bool) -> None:
            self.async_scheduling = async_scheduling
            self.serving_layers = (Serving(), Serving())

    sync, overlapped = Engine(False), Engine(True)
    assert install(sync) and all(isinstance(s.engine_client, HoldingClient) for s in sync.serving_layers)
    assert not install(overlapped) and not any(
        isinstance(s.engine_client, HoldingClient) for s in overlapped.serving_layers
    )


def test_a_hold_not_released_in_time_ends_at_its_cap() -> None:
    """Held past max_s: the input stream ends (vLLM frees the request and its KV) and the hold says so, so that
    decode ends the stream at the cap as for an answer not held."""

    async def run() -> None:
        engine = Engine()
        hold = Hold(2, max_s=0.05)
        seen = await asyncio.wait_for(collect(HoldingClient(engine), hold, params(max_tokens=6)), 5)
        assert hold.expired and not hold.held and len(engine.inputs) == 1
        assert [t for t, _, _ in seen] == [101, 102]
        hold.release()  # (too late: nothing goes on)
        assert len(engine.inputs) == 1

    asyncio.run(run())


def test_a_closed_hold_never_goes_on() -> None:
    """Closed (its stream is being stopped), a release that comes while vLLM aborts the request sends no second
    input: the input stream waits to be cancelled instead of ending (its end would be another input too)."""

    async def run() -> None:
        engine = Engine()
        hold = Hold(2)
        task = asyncio.ensure_future(collect(HoldingClient(engine), hold, params(max_tokens=6)))
        await asyncio.sleep(0.05)
        assert hold.held
        hold.close()
        hold.release()
        await asyncio.sleep(0.05)
        assert len(engine.inputs) == 1 and not task.done()  # (no second input, and no end of input)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert len(engine.inputs) == 1

    asyncio.run(run())
