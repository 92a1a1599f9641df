"""A held preemptive answer released by its end chunk on this router (router/sessions/provisional.py): the reader
streams
it before the owner's reply to its claim, and that reply decides whether the answer stays the owner's answer.
Real `AnswerReader`, `Held` and `Feeds`; the owner and the decode handle are scripted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prefill.client import PrefillClient
from router.sessions.answers import AnswerReader
from router.streams.feeds import Feeds
from tests.unit.router.test_feeds import FakeDecode
from tests.unit.router.test_router_answers import CHAT_ITEMS, Remote, reported

SESSION = "sess_r1_pre"
STREAM = "sess_r1_pre-t0-p1"
REQUEST = {
    "model": "local:tiny-llama",
    "messages": [{"role": "user", "content": "Hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "request_id": STREAM,
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]},
}
LIVE = {  # what the owner says of the live preemptive answer (prefill/preemptive.py `Preemptive.provisional`)
    "replica": "d1",
    "parked": f"preempt:{SESSION}:0:1",
    "stream_id": STREAM,
    "turn": 0,
    "endpoint": "chat",
    "request": {**REQUEST, "priority": 1, "return_token_ids": False},
    "include_usage": False,
    "stream": False,
    "end_sequence_id": 5,
}
ADOPT = {k: LIVE[k] for k in ("replica", "parked", "stream_id")}


class Owner:
    """Answers the first claim with the live preemptive answer; the next waits until the test lets the owner
    have the end chunk, then answers with `final`."""

    def __init__(self, final: dict[str, Any]) -> None:
        self.final = final
        self.has_end = asyncio.Event()
        self.reports_land = asyncio.Event()  # (cleared: a report takes until the test lets it land)
        self.reports_land.set()
        self.claims: list[dict[str, Any]] = []
        self.reports: list[dict[str, Any]] = []
        self.session_claim = Remote(self._claim)
        self.session_answer_done = Remote(self._done)
        self.session_streaming = Remote(self._streaming)

    def options(self, **options: Any) -> Owner:  # (the prefill client's handle options)
        return self

    async def _claim(self, **kwargs: Any) -> dict[str, Any]:
        self.claims.append(kwargs)
        if kwargs.get("holding") == "":
            return {"pending": True, "provisional": LIVE}
        await self.has_end.wait()
        return self.final

    async def _done(self, **kwargs: Any) -> dict[str, Any]:
        await self.reports_land.wait()
        self.reports.append(kwargs)
        return {"turn": kwargs["turn"], **kwargs["outcome"]}

    async def _streaming(self, **kwargs: Any) -> dict[str, Any]:
        return {}


class Ingress:
    def __init__(self, owner: Owner) -> None:
        self.owner = owner  # (its client's handle)
        self.prefill = PrefillClient(owner)
        self.decode = FakeDecode()
        self.feeds = Feeds(self.decode, "router-1")  # type: ignore[arg-type]


async def held_reader(final: dict[str, Any]) -> tuple[Ingress, AnswerReader, asyncio.Task[Any]]:
    """A reader waiting for the turn, holding the preemptive answer, whose first frames are here already."""
    ingress = Ingress(Owner(final))
    reader = AnswerReader(ingress, SESSION)
    opening = asyncio.ensure_future(reader.open())
    for _ in range(100):
        if SESSION in ingress.feeds.held:
            break
        await asyncio.sleep(0.001)
    await ingress.decode.batches.put(({STREAM: CHAT_ITEMS[0] + CHAT_ITEMS[1]}, {}, {}))
    await asyncio.sleep(0.01)
    assert not opening.done()  # (the turn has not ended)
    return ingress, reader, opening


async def test_an_end_chunk_here_releases_the_held_answer_before_the_owner_replies() -> None:
    final = {"turn": 0, "endpoint": "chat", "include_usage": False, "timing": {}, "adopt": ADOPT, "request": REQUEST}
    ingress, reader, opening = await held_reader(final)
    held = ingress.feeds.held[SESSION]
    assert not held.release(4) and not held.release(6)  # not the end of the input it was made from
    assert held.release(5)

    assert await asyncio.wait_for(opening, 1) is None  # without the owner's reply
    assert ingress.owner.claims[-1]["holding"] == STREAM  # (still on its way)
    assert "released" in reader.server_timing and reader.turn == 0
    items = reader.items()
    first, deltas = await anext(items)
    assert deltas == ["Hel"] and ingress.decode.confirmed == [STREAM]  # cap lifted, ordinary rank
    assert SESSION not in ingress.feeds.held  # read, no longer held: a second end chunk releases nothing
    assert not ingress.owner.reports  # nothing of it is reported before the owner says it is the answer

    ingress.owner.has_end.set()
    await ingress.decode.batches.put(({STREAM: CHAT_ITEMS[2] + CHAT_ITEMS[3]}, {STREAM: None}, {}))
    rest = [item async for item in items]
    await ingress.decode.batches.put(StopAsyncIteration())  # (the feed ends: only the reports are left to run)
    await reported()
    assert [d for _, ds in rest for d in ds] == ["lo", ", world"]
    assert [(r["turn"], r["outcome"]["status"], r["outcome"]["text"]) for r in ingress.owner.reports] == [
        (0, "completed", "Hello, world")
    ]


@pytest.mark.parametrize("how", ["refused", "refused 5xx", "other answer", "over before"])
async def test_a_released_answer_the_owner_does_not_confirm_is_withdrawn(how: str) -> None:
    """The owner refuses the end chunk (the router revokes it), or ends the turn with another answer (its claim
    names another request): the stream ends with an error frame, never another answer's text, and nothing of it
    is the owner's; an answer claimed meanwhile goes back to the owner."""
    other = {"turn": 0, "endpoint": "chat", "include_usage": False, "timing": {}, "request": REQUEST}
    ingress, reader, opening = await held_reader(other)
    assert ingress.feeds.held[SESSION].release(5)
    held = ingress.feeds.held[SESSION]
    assert await asyncio.wait_for(opening, 1) is None
    items = reader.items()
    _, deltas = await anext(items)
    assert deltas == ["Hel"]

    if how == "refused":
        held.revoke({"message": "session gone", "type": "NotFoundError", "code": 404})
    elif how == "refused 5xx":  # (an owner that failed: the stream must not be resumed elsewhere as if decode had)
        held.revoke({"message": "the end chunk did not reach the session", "type": "BadGateway", "code": 502})
    elif how == "over before":  # the whole answer, [DONE] and its end, came before the owner's reply
        await ingress.decode.batches.put(({STREAM: CHAT_ITEMS[2] + CHAT_ITEMS[3]}, {STREAM: None}, {}))
        await asyncio.sleep(0.01)
    ingress.owner.has_end.set()
    rest = "".join([forward async for forward, _ in items])
    await ingress.decode.batches.put(StopAsyncIteration())
    await reported()
    assert "the answer was withdrawn" in rest and rest.endswith("data: [DONE]\n\n")
    assert rest.count("data: [DONE]") == 1 and reader.outcome.status == "failed"
    assert (STREAM in ingress.decode.stopped) == (how != "over before")  # stopped on decode (unless it ended)
    # Nothing reported as this answer's outcome; the claimed other answer is given back for its next reader.
    assert [(r["turn"], r["outcome"]["status"]) for r in ingress.owner.reports] == [(0, "released")]


# The whole answer made before the turn ended (its own max_tokens, below `preemptive.max_tokens`, ended it, or a
# stop): the reader's first item carries its [DONE] too.


async def test_a_released_answer_made_whole_streams_its_text_before_the_owner_replies() -> None:
    """Its text goes out at the end chunk, as an answer cut off by its cap does; only its [DONE] waits for the owner
    to confirm it (a withdrawal still ends it with an error frame, not [DONE])."""
    final = {"turn": 0, "endpoint": "chat", "include_usage": False, "timing": {}, "adopt": ADOPT, "request": REQUEST}
    ingress, reader, opening = await held_reader(final)
    await ingress.decode.batches.put(({STREAM: "".join(CHAT_ITEMS[2:])}, {STREAM: None}, {}))
    await asyncio.sleep(0.01)
    assert ingress.feeds.held[SESSION].release(5)
    assert await asyncio.wait_for(opening, 1) is None
    items = reader.items()
    forward, deltas = await asyncio.wait_for(anext(items), 1)  # (the owner has not replied)
    assert deltas == ["Hel", "lo", ", world"] and "[DONE]" not in forward and not ingress.owner.reports

    ingress.owner.has_end.set()
    rest = [item async for item in items]
    await ingress.decode.batches.put(StopAsyncIteration())
    await reported()
    assert "".join(f for f, _ in rest).endswith("data: [DONE]\n\n") and not any(d for _, d in rest)
    assert [(r["turn"], r["outcome"]["status"], r["outcome"]["text"]) for r in ingress.owner.reports] == [
        (0, "completed", "Hello, world")
    ]


async def test_a_held_answer_made_whole_streams_its_text_before_its_end_is_reported() -> None:
    """Confirmed by the owner's reply (realtime's `response.create`, `/finish`): its text goes out at once; the
    end of the stream waits for the owner to have the outcome, the text does not."""
    final = {"turn": 0, "endpoint": "chat", "include_usage": False, "timing": {}, "adopt": ADOPT, "request": REQUEST}
    ingress, reader, opening = await held_reader(final)
    await ingress.decode.batches.put(({STREAM: "".join(CHAT_ITEMS[2:])}, {STREAM: None}, {}))
    await asyncio.sleep(0.01)
    ingress.owner.reports_land.clear()
    ingress.owner.has_end.set()
    assert await asyncio.wait_for(opening, 1) is None
    assert "held" in reader.server_timing and "released" not in reader.server_timing
    items = reader.items()
    forward, deltas = await asyncio.wait_for(anext(items), 1)  # (its report has not landed)
    assert deltas == ["Hel", "lo", ", world"] and "[DONE]" not in forward

    ending = asyncio.ensure_future(anext(items))
    await asyncio.sleep(0.01)
    assert not ending.done()  # [DONE] only once the owner has the outcome
    ingress.owner.reports_land.set()
    forward, deltas = await asyncio.wait_for(ending, 1)
    assert forward == "data: [DONE]\n\n" and deltas == [] and len(ingress.owner.reports) == 1
    await ingress.decode.batches.put(StopAsyncIteration())
    await reported()
