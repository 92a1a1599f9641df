"""Resuming an answer on another decode replica (router/streams/resume.py, router/streams/feeds.py, decode/feed.py):
the token
ids cut out of decode's frames, the continuation request, its frames in the original stream's shape, and a
stream whose replica dies mid-answer read on to the end with no token repeated or lost."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from core.protocol import parse_sse
from decode.feed import Outbox, take_token_ids
from router.streams import resume
from router.streams.feeds import DecodeFailed, DecodeStream, Feeds
from tests.unit.router.test_feeds import FakeStreamingCall, Method

# Frames as vLLM 0.32 writes them with `return_token_ids` (and, below, without: `null`).
CHAT_ROLE = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,'
    '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    '"prompt_token_ids":[%s],"prompt_text":null}\n\n'
)
CHAT_TOKEN = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,'
    '"delta":{"content":"%s"},"logprobs":null,"finish_reason":null,"token_ids":[%s]}]}\n\n'
)
COMPLETION = (
    'data: {"id":"cmpl-9","object":"text_completion","created":8,"model":"m","choices":[{"index":0,"text":"%s",'
    '"logprobs":null,"finish_reason":%s,"stop_reason":null,"prompt_token_ids":%s,"token_ids":[%s]}]}\n\n'
)


def completion_frame(text: str, ids: str, prompt: str | None = None, finish: str | None = None) -> str:
    return COMPLETION % (text, json.dumps(finish), f"[{prompt}]" if prompt is not None else "null", ids)


def usage_frame(obj: str, prompt: int, completion: int) -> str:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    frame = {"id": "cmpl-x", "object": obj, "created": 9, "model": "m", "choices": [], "usage": usage}
    return "data: " + json.dumps(frame, separators=(",", ":")) + "\n\n"


# --- decode: the ids out of the frames ----------------------------------------------------------------------
def test_chat_frames_lose_their_ids_to_null_as_without_return_token_ids() -> None:
    text = CHAT_ROLE % "1,2,3" + CHAT_TOKEN % ("He", "10") + CHAT_TOKEN % ('llo \\"token_ids\\":[5]', "11,12")
    stripped, prompt, tokens = take_token_ids(text, keep=False)
    assert prompt == [1, 2, 3] and tokens == [10, 11, 12]
    assert '"prompt_token_ids":null' in stripped and stripped.count('"token_ids":null') == 2
    assert '\\"token_ids\\":[5]' in stripped  # text that looks like the field is the answer's, untouched
    assert [f["choices"][0]["delta"].get("content") for f in parse_sse(stripped)] == ["", "He", 'llo "token_ids":[5]']


def test_completion_frames_and_ids_the_client_asked_for() -> None:
    text = completion_frame("a", "10", prompt="1,2") + completion_frame("b", "11", finish="length")
    stripped, prompt, tokens = take_token_ids(text, keep=False)
    assert (prompt, tokens) == ([1, 2], [10, 11])
    choices = [f["choices"][0] for f in parse_sse(stripped)]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in choices] == [(None, None), (None, None)]
    kept, prompt, tokens = take_token_ids(text, keep=True)
    assert kept == text and (prompt, tokens) == ([1, 2], [10, 11])
    assert take_token_ids("data: [DONE]\n\n", keep=False) == ("data: [DONE]\n\n", None, [])


def test_the_outbox_carries_the_ids_beside_the_frames_and_restores_them_in_order() -> None:
    async def run() -> Any:
        box = Outbox()
        box.put("a", "f1", [1, 2], [10])
        box.put("a", "f2", None, [11])
        batch = await box.take()
        box.put("a", "f3", None, [12])
        box.restore(batch)
        return batch, await box.take()

    batch, again = asyncio.run(run())
    assert batch == ({"a": "f1f2"}, {}, {"a": ([1, 2], [10, 11])})
    assert again == ({"a": "f1f2f3"}, {}, {"a": ([1, 2], [10, 11, 12])})


def test_ids_whose_text_is_held_back_are_reported_only_with_the_text_that_shows_them() -> None:
    """A token that ends inside a character (byte-level BPE) shows no text until the next one completes it. A
    continuation whose prompt ended there would be detokenized from a broken prefix: vLLM then writes the whole
    prompt's text into the answer (seen in CI: a resumed session answer carried its rendered prompt). So decode
    reports an id only once the text it belongs to has been shown, and a resume regenerates the rest."""
    from decode.server import DecodeServer

    frames = [
        completion_frame(" inter", "10", prompt="1,2"),
        completion_frame("", "11"),  # half of a character: held back by vLLM's detokenizer
        completion_frame("", "12"),
        completion_frame("\u00e9 bu", "13"),  # the character, shown
        completion_frame("", "14", finish="length"),  # the end: nothing is held back any more
    ]
    seen: list[Any] = []

    class Box(Outbox):
        def put(self, stream_id: str, text: str, prompt: list[int] | None = None, tokens: Any = None) -> None:
            seen.append((prompt, list(tokens or [])))

    async def engine() -> AsyncIterator[str]:
        for frame in frames:
            yield frame

    box = Box()
    server = object.__new__(DecodeServer.func_or_class)
    server.routes, server.holds = {"s": box}, {}
    server.engine = types.SimpleNamespace(tokenizer=None)  # (vLLM's frames of one id each: no tokenizer needed)
    asyncio.run(server._pump(engine(), "s", "strip"))
    assert seen == [([1, 2], [10]), (None, []), (None, []), (None, [11, 12, 13]), (None, [14])]


# --- the continuation ---------------------------------------------------------------------------------------
def progress(prompt: list[int] | None, generated: list[int]) -> resume.Progress:
    p = resume.Progress(prompt=prompt, generated=list(generated), sent=True)
    p.meta = {"id": "chatcmpl-1", "created": 7, "model": "m"}
    return p


def test_a_chat_request_goes_on_as_a_completion_of_its_prompt_and_tokens() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 10,
        "max_tokens": 12,
        "min_tokens": 4,
        "temperature": 0,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "request_id": "req",
        "kv_transfer_params": {"remote_block_ids": [1]},
        "truncate_prompt_tokens": 2,
    }
    out = resume.continuation(body, progress([1, 2, 3], [10, 11, 12, 13, 14, 15]), 1)
    assert out == {
        "model": "m",
        "prompt": [1, 2, 3, 10, 11, 12, 13, 14, 15],
        "max_tokens": 4,  # the lower of the two limits, less the 6 tokens already sent
        "min_tokens": 0,
        "temperature": 0,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "request_id": "req-resume1",
        "return_token_ids": True,
    }
    completion = {"prompt": "x", "max_tokens": 5, "stream": True}
    assert resume.continuation(completion, progress([7], [8, 9]), 2)["max_tokens"] == 3
    assert "max_tokens" not in resume.continuation({"messages": []}, progress([7], [8]), 1)  # the context's limit
    restarted = resume.restart({**body, "return_token_ids": True}, 2)
    assert "kv_transfer_params" not in restarted and restarted["messages"] == body["messages"]


@pytest.mark.parametrize(
    ("endpoint", "extra", "why"),
    [
        ("chat", {"n": 2}, "n > 1"),
        ("chat", {"tools": [{"type": "function"}]}, "tools"),
        ("chat", {"tool_choice": "auto"}, "tools"),
        ("chat", {"response_format": {"type": "json_object"}}, "structured outputs"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("completion", {"logprobs": 0}, "logprobs"),
        ("completion", {"echo": True}, "echo"),
        ("chat", {"stop": ["\n"]}, "stop strings"),
        ("chat", {"frequency_penalty": 0.5}, "presence/frequency penalties"),
        ("chat", {"logprobs": False, "n": 1, "tool_choice": "none", "stop": [], "presence_penalty": 0}, None),
    ],
)
def test_requests_a_continuation_cannot_reproduce_are_refused(endpoint: str, extra: dict, why: str | None) -> None:
    assert resume.refusal(endpoint, {"stream": True, **extra}) == why  # type: ignore[arg-type]


def test_continuation_frames_become_the_chat_streams_chunks_with_usage_summed() -> None:
    rewrite = resume.Rewriter("chat", progress([1, 2, 3], [10, 11]), keep_ids=False)
    text = completion_frame("C", "12") + completion_frame("D", "13", finish="length")
    text += usage_frame("text_completion", 5, 2) + "data: [DONE]\n\n"
    out = rewrite(text)
    frames = parse_sse(out)
    assert out.endswith("data: [DONE]\n\n")
    assert all(f["id"] == "chatcmpl-1" and f["created"] == 7 and f["model"] == "m" for f in frames)
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert [f["choices"][0]["delta"] for f in frames[:2]] == [{"content": "C"}, {"content": "D"}]
    assert [f["choices"][0]["finish_reason"] for f in frames[:2]] == [None, "length"]
    assert frames[0]["choices"][0]["token_ids"] is None and "stop_reason" not in frames[0]["choices"][0]
    assert frames[2]["choices"] == [] and frames[2]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 7,
        "completion_tokens": 4,
    }
    # The same shape as vLLM's own chat frame without ids, byte for byte.
    assert out.split("\n\n")[0] == (CHAT_TOKEN % ("C", "12")).replace("[12]", "null").strip()


def test_continuation_frames_of_a_completion_keep_the_ids_the_client_asked_for() -> None:
    p = progress([1], [10])
    p.meta = {"id": "cmpl-9", "created": 8, "model": "m"}
    frames = parse_sse(resume.Rewriter("completion", p, keep_ids=True)(completion_frame("b", "11", prompt="1,10")))
    choice = frames[0]["choices"][0]
    assert (frames[0]["id"], frames[0]["object"], choice["text"]) == ("cmpl-9", "text_completion", "b")
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (None, [11])  # the prompt's went out first


# --- a stream whose replica dies ----------------------------------------------------------------------------
class FakeCall:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        async def result() -> Any:
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value

        return result().__await__()


class Pool:
    """A decode deployment handle over several replicas: `start` answers what `starts` says in turn; each
    replica's feed yields what the test pushes for it (an exception fails it, as a dead replica's does)."""

    def __init__(self, starts: list[Any]) -> None:
        self.starts = list(starts)
        self.started: list[dict[str, Any]] = []
        self.batches: dict[str, asyncio.Queue[Any]] = {}
        self.stopped: list[dict[str, Any]] = []
        self.start = Method(self._start)
        self.feed = Method(self._feed)
        self.stop = Method(lambda **kw: self.stopped.append(kw) or FakeCall(None))

    def options(self, **_: Any) -> Pool:
        return self

    def queue(self, replica: str) -> asyncio.Queue[Any]:
        return self.batches.setdefault(replica, asyncio.Queue())

    def _start(self, **kwargs: Any) -> FakeCall:
        self.started.append(kwargs)
        return FakeCall(self.starts.pop(0))

    def _feed(self, *, consumer: str, replica: str, direct: bool = False) -> FakeStreamingCall:
        async def gen() -> AsyncIterator[Any]:
            while True:
                batch = await self.queue(replica).get()
                if isinstance(batch, BaseException):
                    raise batch
                yield batch

        return FakeStreamingCall(gen())  # (its batches as the call's items, as a replica that could not wait)


def batch(stream_id: str, text: str, ended: bool = False) -> Any:
    """What decode sends for `text` (ids cut out, beside it)."""
    stripped, prompt, tokens = take_token_ids(text, keep=False)
    return {stream_id: stripped}, ({stream_id: None} if ended else {}), {stream_id: (prompt, tokens)}


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True, "temperature": 0}


def test_a_chat_stream_whose_replica_dies_goes_on_elsewhere_with_no_token_repeated_or_lost() -> None:
    async def run() -> tuple[str, Pool]:
        pool = Pool([{"replica": "d1"}, {"replica": "d2"}])
        feeds = Feeds(pool, "r")  # type: ignore[arg-type]
        body = {**CHAT, "stream_options": {"include_usage": True}, "kv_transfer_params": {"remote_block_ids": [1]}}
        stream = await feeds.open("chat", body)
        assert isinstance(stream, DecodeStream)
        sid = stream.stream_id
        pool.queue("d1").put_nowait(batch(sid, CHAT_ROLE % "1,2,3" + CHAT_TOKEN % ("A", "10")))
        pool.queue("d1").put_nowait(batch(sid, CHAT_TOKEN % ("B", "11")))
        pool.queue("d1").put_nowait(ActorDiedError())
        rest = completion_frame("C", "12", prompt="1,2,3,10,11") + completion_frame("D", "13")
        pool.queue("d2").put_nowait(batch(sid, rest))
        pool.queue("d2").put_nowait(batch(sid, completion_frame("E", "14", finish="length")))
        pool.queue("d2").put_nowait(batch(sid, usage_frame("text_completion", 5, 3) + "data: [DONE]\n\n", True))
        return "".join([text async for text in stream]), pool

    text, pool = asyncio.run(run())
    frames = parse_sse(text)
    assert "".join(f["choices"][0]["delta"].get("content", "") for f in frames if f["choices"]) == "ABCDE"
    assert sum(f["choices"][0]["delta"].get("role") == "assistant" for f in frames if f["choices"]) == 1
    assert {f["id"] for f in frames} == {"chatcmpl-1"} and text.count("[DONE]") == 1
    assert frames[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5}
    assert all("token_ids" not in f or f.get("prompt_token_ids") is None for f in frames)
    first, again = pool.started
    assert first["endpoint"] == "chat" and first["ids"] == "strip" and first["body"]["return_token_ids"] is True
    assert again["endpoint"] == "completion" and again["avoid"] == ["d1"] and again["stream_id"] == first["stream_id"]
    assert again["body"]["prompt"] == [1, 2, 3, 10, 11] and again["body"]["max_tokens"] == 3
    assert "kv_transfer_params" not in again["body"] and "messages" not in again["body"]


def test_a_stream_that_failed_before_any_frame_is_sent_again_whole_without_its_kv() -> None:
    async def run() -> tuple[str, Pool]:
        pool = Pool([{"replica": "d1"}, {"replica": "d2"}])
        feeds = Feeds(pool, "r")  # type: ignore[arg-type]
        stream = await feeds.open("chat", {**CHAT, "kv_transfer_params": {"remote_block_ids": [1]}})
        assert isinstance(stream, DecodeStream)
        sid = stream.stream_id
        pool.queue("d1").put_nowait(({}, {sid: {"message": "engine dead", "code": 500}}, {}))
        pool.queue("d2").put_nowait(batch(sid, CHAT_ROLE % "1" + CHAT_TOKEN % ("A", "10") + "data: [DONE]\n\n", True))
        return "".join([text async for text in stream]), pool

    text, pool = asyncio.run(run())
    assert [f["choices"][0]["delta"] for f in parse_sse(text)] == [
        {"role": "assistant", "content": ""},
        {"content": "A"},
    ]
    again = pool.started[1]
    assert again["endpoint"] == "chat" and "kv_transfer_params" not in again["body"] and again["avoid"] == ["d1"]


def test_a_start_on_a_dead_replica_goes_to_another_and_a_stream_past_its_last_token_just_ends() -> None:
    async def run() -> tuple[str, Pool]:
        pool = Pool([ActorDiedError(), {"replica": "d2"}])
        feeds = Feeds(pool, "r")  # type: ignore[arg-type]
        body = {"prompt": "x", "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
        stream = await feeds.open("completion", {**body, "kv_transfer_params": {"remote_block_ids": [1]}})
        assert isinstance(stream, DecodeStream)
        pool.queue("d2").put_nowait(batch(stream.stream_id, completion_frame("a", "10", "1", finish="length")))
        pool.queue("d2").put_nowait(RuntimeError("replica died"))
        return "".join([text async for text in stream]), pool

    text, pool = asyncio.run(run())
    assert "kv_transfer_params" not in pool.started[1]["body"] and len(pool.started) == 2  # no start for the end
    frames = parse_sse(text)
    assert frames[-1]["usage"] == {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}
    assert frames[-1]["id"] == "cmpl-9" and text.endswith("data: [DONE]\n\n")


def test_stops_refused_requests_and_repeated_failures_end_with_the_error() -> None:
    async def failing(body: dict[str, Any], errors: list[Any]) -> tuple[dict[str, Any], Pool]:
        pool = Pool([{"replica": f"d{i}"} for i in range(len(errors))])
        feeds = Feeds(pool, "r")  # type: ignore[arg-type]
        stream = await feeds.open("chat", body)
        assert isinstance(stream, DecodeStream)
        for i, error in enumerate(errors):
            pool.queue(f"d{i}").put_nowait(batch(stream.stream_id, CHAT_ROLE % "1"))
            pool.queue(f"d{i}").put_nowait(({}, {stream.stream_id: error}, {}))
        with pytest.raises(DecodeFailed) as failed:
            _ = [text async for text in stream]
        return failed.value.error, pool

    boom = {"message": "boom", "code": 500}
    error, pool = asyncio.run(failing(CHAT, [{"message": "stopped", "code": 499}]))
    assert error["code"] == 499 and len(pool.started) == 1  # a stop is not a failure
    error, pool = asyncio.run(failing({**CHAT, "n": 2}, [boom]))
    assert error is boom and len(pool.started) == 1 and "return_token_ids" not in pool.started[0]["body"]
    error, pool = asyncio.run(failing(CHAT, [boom, boom, boom]))
    assert len(pool.started) == 1 + resume.MAX_RESUMES and pool.started[-1]["avoid"] == ["d0", "d1"]
