"""The router's side of a session answer: parsing decode's SSE and replays (router/sessions/outcome.py), and the reader
(router/sessions/answers.py) that claims an answer, streams it from decode and reports how it ended, with a fake owner
and decode."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from openai._streaming import SSEDecoder
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from core import tasks
from core.protocol import error_body
from prefill.client import PrefillClient
from router.sessions.answers import AnswerReader
from router.sessions.outcome import Outcome, completion_object, replay_frames
from router.streams.feeds import DecodeFailed

CREATED = 1_700_000_000
MODEL = "local:tiny-llama"
USAGE = {"prompt_tokens": 17, "total_tokens": 21, "completion_tokens": 4}


def frame(data: dict[str, Any]) -> str:
    """One SSE frame as vLLM's OpenAI server writes it (compact JSON)."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def chat_frame(delta: dict[str, Any], finish: str | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    head = {"id": "chatcmpl-9f1", "object": "chat.completion.chunk", "created": CREATED, "model": MODEL}
    return frame({**head, "choices": [choice]})


def completion_frame(text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return frame(
        {"id": "cmpl-9f1", "object": "text_completion", "created": CREATED, "model": MODEL, "choices": [choice]}
    )


def usage_frame(endpoint: str) -> str:
    """The last frame when usage was asked for: no choices."""
    head = {"id": "chatcmpl-9f1", "object": "chat.completion.chunk"}
    if endpoint == "completion":
        head = {"id": "cmpl-9f1", "object": "text_completion"}
    return frame({**head, "created": CREATED, "model": MODEL, "choices": [], "usage": USAGE})


# decode's items: one or more frames each (vLLM batches frames a slow reader has not taken)
CHAT_ITEMS = [
    chat_frame({"role": "assistant", "content": ""}),
    chat_frame({"content": "Hel"}),
    chat_frame({"content": "lo"}) + chat_frame({"content": ", world"}),
    chat_frame({"content": ""}, "stop") + usage_frame("chat") + DONE,
]
COMPLETION_ITEMS = [
    completion_frame(" Hel"),
    completion_frame("lo") + completion_frame(", world"),
    completion_frame("", "length"),
    usage_frame("completion"),
    DONE,
]
CHAT_RESPONSE = {"id": "chatcmpl-9f1", "created": CREATED, "model": MODEL}
COMPLETION_RESPONSE = {"id": "cmpl-9f1", "created": CREATED, "model": MODEL}


def absorb_all(items: list[str], keep_usage: bool) -> tuple[Outcome, str, list[str]]:
    outcome, forwarded, deltas = Outcome(), "", []
    for item in items:
        forward, item_deltas = outcome.absorb(item, keep_usage)
        forwarded += forward
        deltas += item_deltas
    return outcome, forwarded, deltas


# --- Outcome ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_usage", [True, False])
def test_absorb_a_chat_stream(keep_usage: bool) -> None:
    outcome, forwarded, deltas = absorb_all(CHAT_ITEMS, keep_usage)

    assert deltas == ["Hel", "lo", ", world"]
    assert outcome.text == "Hello, world" and outcome.finish_reason == "stop"
    assert outcome.usage == USAGE  # the owner learns the usage either way
    assert outcome.status == "completed" and outcome.error is None
    assert outcome.response == CHAT_RESPONSE
    everything = "".join(CHAT_ITEMS)
    assert forwarded == (everything if keep_usage else everything.replace(usage_frame("chat"), ""))
    assert forwarded.endswith(DONE)


@pytest.mark.parametrize("keep_usage", [True, False])
def test_absorb_a_completion_stream(keep_usage: bool) -> None:
    outcome, forwarded, deltas = absorb_all(COMPLETION_ITEMS, keep_usage)

    assert deltas == [" Hel", "lo", ", world"]
    assert outcome.text == " Hello, world" and outcome.finish_reason == "length"
    assert outcome.usage == USAGE and outcome.response == COMPLETION_RESPONSE
    everything = "".join(COMPLETION_ITEMS)
    assert forwarded == (everything if keep_usage else everything.replace(usage_frame("completion"), ""))


def test_absorb_an_item_of_only_a_dropped_usage_frame_forwards_nothing() -> None:
    outcome = Outcome()
    assert outcome.absorb(usage_frame("chat"), keep_usage=False) == ("", [])
    assert outcome.usage == USAGE


def test_absorb_an_error_frame() -> None:
    outcome = Outcome()
    outcome.absorb(chat_frame({"role": "assistant", "content": ""}) + chat_frame({"content": "Hi"}), False)
    error = {"message": "decode engine failed", "type": "InternalServerError", "param": None, "code": 500}
    forward, deltas = outcome.absorb(frame({"error": error}) + DONE, keep_usage=False)

    assert outcome.status == "failed" and outcome.error == error
    assert forward == frame({"error": error}) + DONE and deltas == []
    assert outcome.text == "Hi" and outcome.response == CHAT_RESPONSE


def test_absorb_skips_what_is_not_a_data_frame() -> None:
    outcome = Outcome()
    forward, deltas = outcome.absorb(": keep-alive\n\n" + chat_frame({"content": "x"}), keep_usage=False)
    assert forward == chat_frame({"content": "x"}) and deltas == ["x"]


def test_absorb_a_whole_response() -> None:
    chat = Outcome()
    chat.absorb_response(
        {
            **CHAT_RESPONSE,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "finish_reason": "stop"}],
            "usage": USAGE,
        }
    )
    assert (chat.text, chat.finish_reason, chat.usage, chat.response) == ("Hi!", "stop", USAGE, CHAT_RESPONSE)
    completion = Outcome()
    completion.absorb_response(
        {**COMPLETION_RESPONSE, "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}], "usage": USAGE}
    )
    assert (completion.text, completion.finish_reason) == (" ok", "length")


# --- replays -------------------------------------------------------------------------------------------
def summary(endpoint: str = "chat", **changes: Any) -> dict[str, Any]:
    return {
        "turn": 0,
        "status": "completed",
        "text": "Hello, world",
        "finish_reason": "stop",
        "usage": USAGE,
        "error": None,
        "response": CHAT_RESPONSE if endpoint == "chat" else COMPLETION_RESPONSE,
        **changes,
    }


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_replay_frames_parse_back_to_the_same_answer(endpoint: str, include_usage: bool) -> None:
    frames = replay_frames(endpoint, summary(endpoint), include_usage)

    assert frames.endswith(DONE) and frames.count(DONE) == 1
    outcome, forwarded, deltas = absorb_all([frames], keep_usage=True)
    assert forwarded == frames
    assert outcome.text == "Hello, world" and "".join(deltas) == "Hello, world"
    assert outcome.finish_reason == "stop" and outcome.status == "completed"
    assert outcome.usage == (USAGE if include_usage else None)
    assert outcome.response == summary(endpoint)["response"]


def test_replay_of_a_failed_answer_carries_its_error() -> None:
    error = error_body(500, "decode failed mid-stream")["error"]
    frames = replay_frames("chat", summary(status="failed", text="Hel", finish_reason=None, error=error), True)
    outcome, _, _ = absorb_all([frames], keep_usage=True)
    assert outcome.status == "failed" and outcome.error == error and outcome.text == "Hel"


def sse_events(text: str, piece: int) -> list[Any]:
    """The official openai client's SSE decoder over the bytes, arriving `piece` bytes at a time."""
    data = text.encode()
    return list(SSEDecoder().iter_bytes(iter([data[i : i + piece] for i in range(0, len(data), piece)])))


@pytest.mark.parametrize("piece", [7, 1 << 20])
@pytest.mark.parametrize("include_usage", [True, False])
def test_openai_client_decodes_a_chat_replay(include_usage: bool, piece: int) -> None:
    events = sse_events(replay_frames("chat", summary(), include_usage), piece)

    assert events[-1].data == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e.json()) for e in events[:-1]]
    assert all(c.id == "chatcmpl-9f1" and c.created == CREATED and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert [u.model_dump(exclude_none=True) for u in usage] == ([USAGE] if include_usage else [])
    if include_usage:
        assert chunks[-1].choices == []


def test_openai_client_decodes_a_completion_replay() -> None:
    events = sse_events(replay_frames("completion", summary("completion"), True), 5)
    assert events[-1].data == "[DONE]"
    chunks = [Completion.model_validate(e.json()) for e in events[:-1]]
    assert chunks[0].choices[0].text == "Hello, world" and chunks[0].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == USAGE["total_tokens"]


def test_openai_client_decodes_forwarded_decode_frames() -> None:
    _, forwarded, _ = absorb_all(CHAT_ITEMS, keep_usage=False)
    events = sse_events(forwarded, 11)
    chunks = [ChatCompletionChunk.model_validate(e.json()) for e in events[:-1]]
    assert events[-1].data == "[DONE]" and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, world"


def test_replay_of_an_answer_without_output_is_valid_openai() -> None:
    frames = replay_frames("chat", summary(status="cancelled", text="", finish_reason=None, response={}), False)
    for event in sse_events(frames, 1 << 20)[:-1]:
        ChatCompletionChunk.model_validate(event.json())


def test_completion_object_for_chat_and_completion() -> None:
    chat = completion_object("chat", summary())
    assert chat == {
        **CHAT_RESPONSE,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello, world"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    completion = completion_object("completion", summary("completion", finish_reason="length"))
    assert completion == {
        **COMPLETION_RESPONSE,
        "object": "text_completion",
        "choices": [{"index": 0, "text": "Hello, world", "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE,
    }
    # Without decode's metadata, `created` is now.
    bare = completion_object("chat", summary(response={}, text=None))
    assert abs(bare["created"] - time.time()) < 5 and bare["choices"][0]["message"]["content"] == ""


# --- AnswerReader with a fake owner and decode -----------------------------------------------------------
class Remote:
    """A deployment handle method: `.remote(...)` gives an awaitable."""

    def __init__(self, fn: Callable[..., Awaitable[Any]] | Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class FakeOwner:
    """The session's owner prefill replica: scripted claim and result, recorded reports."""

    def __init__(self, claim: dict[str, Any], result: dict[str, Any] | None = None) -> None:
        self.claim, self.result = claim, result
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.reports: list[dict[str, Any]] = []
        self.session_claim = Remote(self._claim)
        self.session_result = Remote(self._result)
        self.session_answer_done = Remote(self._done)

    def options(self, **options: Any) -> FakeOwner:  # (the prefill client's handle options)
        return self

    async def _claim(self, **kwargs: Any) -> dict[str, Any]:
        assert kwargs.pop("tenant") == ""  # every session call says whose it is (no API keys here)
        self.calls.append(("session_claim", kwargs))
        return self.claim

    async def _result(self, **kwargs: Any) -> dict[str, Any]:
        assert kwargs.pop("tenant") == ""  # every session call says whose it is (no API keys here)
        self.calls.append(("session_result", kwargs))
        assert self.result is not None
        return self.result

    async def _done(self, **kwargs: Any) -> dict[str, Any]:
        assert kwargs.pop("tenant") == ""  # every session call says whose it is (no API keys here)
        """Records the report; answers as `session_answer_done` does: the answer's summary, whose `error` is
        None when there was none."""
        self.reports.append(kwargs)
        return {"turn": kwargs["turn"], **kwargs["outcome"]}


class FakeDecodeStream:
    """A request's stream from its decode feed (router.streams.feeds.DecodeStream): items, or an exception, which
    reaches the reader as `DecodeFailed` as the feed reports it."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if self.cancelled or not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise DecodeFailed(error_body(500, f"decode failed mid-stream: {item}")["error"])
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeDecode:
    """The router's decode feeds (router.streams.feeds.Feeds): `open` gives a stream, or the answer when it is
    not one."""

    def __init__(self, items: list[Any]) -> None:
        self.stream = FakeDecodeStream(items)
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.held: dict[str, Any] = {}  # (readers holding a preemptive answer: none here)

    async def open(self, endpoint: str, request: dict[str, Any]) -> Any:
        self.requests.append((endpoint, request))
        first = self.stream.items[0] if self.stream.items else None
        if isinstance(first, dict):
            self.stream.items.pop(0)
            return first if "error" in first else {"response": first}
        return self.stream


class FakeIngress:
    def __init__(self, owner: FakeOwner, decode_items: list[Any] | None = None) -> None:
        self.prefill = PrefillClient(owner)
        self.decode = self.feeds = FakeDecode(decode_items or [])


DECODE_REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]},
}


def claim(endpoint: str = "chat", include_usage: bool = False, **rest: Any) -> dict[str, Any]:
    return {"turn": 0, "endpoint": endpoint, "include_usage": include_usage, **rest}


async def reported() -> list[Any]:
    """Let the reader's background reports run; what they ended with (a result or an exception)."""
    ended: list[Any] = []
    while tasks._kept:
        ended += await asyncio.gather(*list(tasks._kept), return_exceptions=True)
    return ended


@pytest.mark.parametrize("include_usage", [False, True])
async def test_reader_streams_decode_frames_and_reports_once(include_usage: bool) -> None:
    owner = FakeOwner(claim(include_usage=include_usage, request=DECODE_REQUEST, last_chunk_time=time.time()))
    ingress = FakeIngress(owner, CHAT_ITEMS)
    reader = AnswerReader(ingress, "sess_r1_abc")

    assert await reader.open() is None
    assert ingress.decode.requests == [("chat", DECODE_REQUEST)]
    forwarded, deltas = "", []
    async for forward, item_deltas in reader.items():
        forwarded += forward
        deltas += item_deltas
    reader.release()  # what /events does when its generator ends: a no-op once reported
    await reported()

    expected = "".join(CHAT_ITEMS)
    assert forwarded == (expected if include_usage else expected.replace(usage_frame("chat"), ""))
    assert deltas == ["Hel", "lo", ", world"]
    assert ingress.decode.stream.cancelled  # nothing keeps running on decode
    assert owner.reports == [
        {
            "session_id": "sess_r1_abc",
            "turn": 0,
            "outcome": {
                "status": "completed",
                "text": "Hello, world",
                "finish_reason": "stop",
                "usage": USAGE,
                "error": None,
                "response": CHAT_RESPONSE,
                "tool_calls": [],
            },
        }
    ]
    assert owner.calls == [
        (
            "session_claim",
            {
                "session_id": "sess_r1_abc",
                "turn": None,
                "fresh": False,
                "adopts": True,
                "reclaim": False,
                "holding": "",
            },
        )
    ]  # (it holds no preemptive answer; a first claim, neither fresh nor a reclaim)


async def test_a_report_of_a_completed_answer_ends_cleanly() -> None:
    owner = FakeOwner(claim(request=DECODE_REQUEST))
    reader = AnswerReader(FakeIngress(owner, CHAT_ITEMS), "sess_r1_abc")
    assert await reader.open() is None
    async for _ in reader.items():
        pass
    await reported()
    assert len(owner.reports) == 1
    # The report was awaited before [DONE] reached the client, and it ended cleanly.
    task = reader._reported
    assert task is not None and task.done() and task.exception() is None
    assert task.result() == {"turn": 0, **owner.reports[0]["outcome"]}


async def test_reader_replays_an_answer_that_is_over() -> None:
    owner = FakeOwner(claim("completion", include_usage=True, answer=summary("completion")))
    ingress = FakeIngress(owner)
    reader = AnswerReader(ingress, "sess_r1_abc", turn=0)

    assert await reader.open() is None
    items = [item async for item in reader.items()]
    await reported()

    assert items == [(replay_frames("completion", summary("completion"), True), ["Hello, world"])]
    assert ingress.decode.requests == [] and owner.reports == []
    assert reader.summary == summary("completion")


async def test_a_second_reader_waits_for_the_first_to_end() -> None:
    streaming = summary(status="streaming", text="", finish_reason=None, usage=None, response={})
    owner = FakeOwner(claim(answer=streaming), result={"session_id": "s", "answer": summary()})
    reader = AnswerReader(FakeIngress(owner), "sess_r1_abc")

    assert await reader.open() is None
    assert owner.calls[-1] == ("session_result", {"session_id": "sess_r1_abc", "turn": 0, "wait": True})
    assert await reader.whole() == completion_object("chat", summary())
    await reported()
    assert owner.reports == []


async def test_a_failed_answer_without_text_is_an_error() -> None:
    error = error_body(429, "prefill capacity exhausted")["error"]
    owner = FakeOwner(claim(answer=summary(status="failed", text="", error=error)))
    assert await AnswerReader(FakeIngress(owner), "sess_r1_abc").open() == {"error": error}


async def test_a_claim_error_is_returned_and_nothing_is_reported() -> None:
    owner = FakeOwner(error_body(404, "session sess_r1_abc not found", "session_id"))
    reader = AnswerReader(FakeIngress(owner), "sess_r1_abc", turn=0)
    result = await reader.open()
    await reported()
    assert result is not None and result["error"]["code"] == 404
    assert owner.reports == []


async def test_a_client_that_stops_reading_makes_the_answer_cancelled() -> None:
    owner = FakeOwner(claim(request=DECODE_REQUEST))
    ingress = FakeIngress(owner, CHAT_ITEMS)
    reader = AnswerReader(ingress, "sess_r1_abc")
    assert await reader.open() is None

    items = reader.items()
    await items.__anext__()  # the role frame
    await items.__anext__()  # "Hel"
    await items.aclose()  # the client left
    reader.release()
    await reported()

    assert ingress.decode.stream.cancelled
    assert len(owner.reports) == 1
    outcome = owner.reports[0]["outcome"]
    assert outcome["status"] == "cancelled" and outcome["text"] == "Hel" and outcome["usage"] is None


async def test_an_error_as_decodes_first_item_fails_the_answer() -> None:
    error = error_body(400, "max_tokens is too large", "max_tokens")
    owner = FakeOwner(claim(request=DECODE_REQUEST))
    reader = AnswerReader(FakeIngress(owner, [error]), "sess_r1_abc")

    assert await reader.open() == error
    await reported()

    assert len(owner.reports) == 1
    assert owner.reports[0]["outcome"]["status"] == "failed"
    assert owner.reports[0]["outcome"]["error"] == error["error"]


async def test_decode_failing_before_its_first_item_fails_the_answer() -> None:
    owner = FakeOwner(claim(request=DECODE_REQUEST))
    reader = AnswerReader(FakeIngress(owner, [RuntimeError("replica died")]), "sess_r1_abc")
    result = await reader.open()
    await reported()
    assert result is not None and result["error"]["code"] == 500 and "replica died" in result["error"]["message"]
    assert [r["outcome"]["status"] for r in owner.reports] == ["failed"]


async def test_decode_failing_mid_stream_ends_the_stream_with_an_error() -> None:
    owner = FakeOwner(claim(request=DECODE_REQUEST))
    reader = AnswerReader(FakeIngress(owner, [*CHAT_ITEMS[:2], RuntimeError("replica died")]), "sess_r1_abc")
    assert await reader.open() is None

    forwarded = "".join([forward async for forward, _ in reader.items()])
    await reported()

    assert forwarded.endswith(DONE) and "decode failed mid-stream" in forwarded
    outcome = owner.reports[0]["outcome"]
    assert outcome["status"] == "failed" and outcome["text"] == "Hel" and outcome["error"]["code"] == 500


async def test_reader_whole_answer() -> None:
    body = {
        **CHAT_RESPONSE,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "finish_reason": "stop"}],
        "usage": USAGE,
    }
    owner = FakeOwner(claim(request=DECODE_REQUEST))
    ingress = FakeIngress(owner, [body])
    reader = AnswerReader(ingress, "sess_r1_abc")

    assert await reader.open(stream=False) is None
    endpoint, request = ingress.decode.requests[0]
    assert endpoint == "chat" and request["stream"] is False and "stream_options" not in request
    assert DECODE_REQUEST["stream"] is True  # the claim's request is not changed
    assert await reader.whole() == body
    await reported()

    outcome = owner.reports[0]["outcome"]
    assert (outcome["status"], outcome["text"], outcome["usage"]) == ("completed", "Hi!", USAGE)


async def test_a_reader_that_claimed_nothing_cancels_but_never_releases() -> None:
    """Realtime `response.cancel` right after `response.create`, before the reader's claim: the cancel reaches
    the owner (it ends the unclaimed answer, or the session would stay answering); a reader that only waited
    (an early reader let go, an `/events` client that left before its turn ended) gives nothing back."""
    owner = FakeOwner({"pending": True})
    ingress = FakeIngress(owner, [])
    early = AnswerReader(ingress, "sess_r1_abc", turn=0)
    early.release()
    await reported()
    assert owner.reports == []
    cancelled = AnswerReader(ingress, "sess_r1_abc", turn=0, surface="realtime")
    cancelled.cancel()
    await reported()
    assert [(r["turn"], r["outcome"]["status"]) for r in owner.reports] == [(0, "cancelled")]
