"""decode/sse.py against vLLM's own `chat_completion_stream_generator`: the same engine outputs through both, the
same bytes out (the SSE contract: role frame, deltas, finish, usage, errors, `[DONE]`), and the token ids beside
the frames equal to what decode cut out of vLLM's frames before (decode/feed.py `take_token_ids`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.outputs import CompletionOutput, RequestOutput

from decode import sse
from decode.feed import ShownIds, take_token_ids

PROMPT = [1, 17, 4, 99]
# (text, token ids) per engine step: quotes, backslashes, control characters, non-ASCII, a character split across
# two tokens (a step with ids and no text), several tokens in one step (a reader that fell behind).
STEPS = [
    ("Hello", [5]),
    (' "world"', [6]),
    ("\\n\n\t\x01\x1f\x7f", [7]),
    ("", [8]),
    ("é✓😀 \u2028", [9, 10]),
    ("</script><", [11]),
]


def serving(**overrides: Any) -> OpenAIServingChat:
    """vLLM's chat serving object without an engine: what its stream generator reads."""
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    settings = {
        "parser_cls": None,
        "enable_force_include_usage": False,
        "response_role": "assistant",
        "_include_reasoning_tokens_details": False,
        "enable_log_outputs": False,
        "request_logger": None,
        "system_fingerprint": None,
        "enable_prompt_tokens_details": False,
        "enable_per_request_metrics": False,
        "log_error_stack": False,
    }
    for key, value in {**settings, **overrides}.items():
        setattr(chat, key, value)
    return chat


def outputs(
    finish: str = "stop", stop_reason: int | str | None = None, steps: list[tuple[str, list[int]]] = STEPS
) -> list[RequestOutput]:
    made = []
    for i, (text, ids) in enumerate(steps):
        last = i == len(steps) - 1
        done = CompletionOutput(
            0, text, ids, None, None, finish_reason=finish if last else None, stop_reason=stop_reason
        )
        made.append(RequestOutput("r", None, PROMPT, None, [done], last, num_cached_tokens=3 if i == 0 else None))
    return made


async def _feed(items: list[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for item in items:
        yield item


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    )


@pytest.fixture(autouse=True)
def same_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both read `created` from the clock."""
    monkeypatch.setattr(time, "time", lambda: 1_790_000_000.5)


def run(
    chat: OpenAIServingChat,
    req: ChatCompletionRequest,
    items: list[RequestOutput],
    ids: Any = None,
    request_id: str = "chatcmpl-1",
    reference: OpenAIServingChat | None = None,
) -> tuple:
    """(vLLM's frames, this encoder's frames) for the same outputs; vLLM's from `reference` if given."""
    theirs = (reference or chat).chat_completion_stream_generator(
        req, _feed(items), request_id, "m", [], None, RequestResponseMetadata(request_id=request_id)
    )
    ours = sse.text_stream(
        chat, req, _feed(items), request_id, "m", RequestResponseMetadata(request_id=request_id), None, ids
    )
    return asyncio.run(_both(theirs, ours))


async def _both(theirs: Any, ours: Any) -> tuple[list[str], list[str]]:
    return [f async for f in theirs], [f async for f in ours]


CASES = {
    "plain": {},
    "usage": {"stream_options": {"include_usage": True}},
    "continuous usage": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "token ids": {"return_token_ids": True},
    "token ids and usage": {"return_token_ids": True, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_frames_are_byte_for_byte_vllms(fields: dict[str, Any], finish: str) -> None:
    chat, req = serving(), request(**fields)
    assert sse.text_only(chat, req)
    theirs, ours = run(chat, req, outputs(finish, stop_reason=7 if finish == "stop" else None))
    assert ours == theirs
    assert ours[-1] == "data: [DONE]\n\n" and '"finish_reason":"' + finish in ours[-2 - ("usage" in str(fields))]


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable_force_include_usage": True},
        {"system_fingerprint": "fp_1"},
        {"enable_prompt_tokens_details": True},
        {"response_role": "robot"},
        {"_include_reasoning_tokens_details": True, "enable_force_include_usage": True},
    ],
    ids=["forced usage", "fingerprint", "cached tokens", "role", "reasoning details"],
)
def test_server_settings_shape_the_frames_as_vllms(overrides: dict[str, Any]) -> None:
    chat = serving(**overrides)
    req = request(stream_options={"include_usage": True}) if "prompt" in str(overrides) else request()
    theirs, ours = run(chat, req, outputs())
    assert ours == theirs


def test_an_engine_error_ends_the_stream_as_vllms() -> None:
    chat, req = serving(), request()
    items = outputs()
    items[2].outputs[0].finish_reason = "error"
    theirs, ours = run(chat, req, items)
    assert ours == theirs and '"InternalServerError"' in ours[-2]


@pytest.mark.parametrize("mode", ["strip", "keep"])
def test_token_ids_travel_beside_the_frames(mode: str) -> None:
    """What the client gets is what decode made of vLLM's frames with ids in them (stripped, or kept), and the ids
    beside each frame are the ones it cut out, held back until text shows (ShownIds)."""
    chat, req = serving(), request(return_token_ids=True)
    theirs, ours = run(chat, req, outputs(), ids=mode)
    before, after = ShownIds(keep=mode == "keep"), ShownIds(keep=mode == "keep")
    for vllm_frame, frame in zip(theirs, ours, strict=True):
        text, prompt, tokens = before.take(vllm_frame)
        assert frame == text
        if isinstance(frame, sse.Frame):
            assert after.take_frame(frame) == (prompt, tokens)
        else:
            assert take_token_ids(vllm_frame, True)[1:] == (None, [])
    assert [t for f in ours if isinstance(f, sse.Frame) for t in f.token_ids] == [t for _, ids in STEPS for t in ids]


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
        {"logprobs": True},
        {"n": 2},
        {"echo": True},
        {"return_prompt_text": True},
    ],
    ids=["tools", "logprobs", "n", "echo", "prompt text"],
)
def test_anything_but_text_deltas_keeps_vllms_generator(fields: dict[str, Any]) -> None:
    assert not sse.text_only(serving(), request(**fields))


def test_an_answer_that_ends_on_an_empty_step_and_odd_request_ids() -> None:
    """The last step shows no text (an end-of-sequence token), and the request id (the client's X-Request-Id) holds
    what looks like the template's holes."""
    steps = [*STEPS[:2], ("", [12])]
    fields = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "return_token_ids": True}
    for request_id in ("abc987654322", "[987654321]", '"\ue000id\ue000"', "é 987654325"):
        theirs, ours = run(serving(), request(**fields), outputs(steps=steps), request_id=request_id)
        assert ours == theirs, request_id


def test_a_configured_tool_parser_is_not_run_for_a_request_without_tools() -> None:
    """With hermes configured (the shipped config), a request that offers no tools gets vLLM's frames of a server
    without a tool parser: its text as text, even text that looks like a call."""
    from transformers import AutoTokenizer
    from vllm.parser import ParserManager

    from local_models.llm import make_local_model

    hermes = ParserManager.get_parser(
        tool_parser_name="hermes",
        reasoning_parser_name=None,
        enable_auto_tools=True,
        tool_strict_level="auto",
        model_name="m",
        is_harmony=False,
        tokenizer=None,
    )
    chat = serving(parser_cls=hermes, model_config=None)
    steps = [("<tool_call>", [20]), ('{"name": "f", "arguments": {}}', [21]), ("</tool_call>", [22]), ("", [23])]
    for fields in ({}, {"tool_choice": None}, {"tool_choice": "none"}, {"include_reasoning": False}):
        req = request(**fields)
        assert sse.text_only(chat, req)
        theirs, ours = run(chat, req, outputs(steps=steps), reference=serving())
        assert ours == theirs
        assert '"content":"<tool_call>"' in ours[1]
    # vLLM itself, with hermes, writes the empty last step as `"delta":{}` (and, with a tokenizer whose `<tool_call>`
    # is a token of its own, makes a call of such text): what this encoder deliberately does not do.
    tokenizer = AutoTokenizer.from_pretrained(make_local_model())

    async def with_hermes() -> list[str]:
        stream = chat.chat_completion_stream_generator(
            request(), _feed(outputs(steps=steps)), "c", "m", [], tokenizer, RequestResponseMetadata(request_id="c")
        )
        return [f async for f in stream]

    frames = asyncio.run(with_hermes())
    assert '"delta":{},' in frames[-2] and '"delta":{"content":""},' in ours[-2]


class ByteTokenizer:
    """Byte-level BPE at its simplest: id 100 + b is the byte b (decoded as vLLM's detokenizer would, a broken
    character as U+FFFD)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 100 for i in ids).decode("utf-8", errors="replace")


def _ids(data: bytes) -> list[int]:
    return [100 + b for b in data]


def test_a_paced_frame_that_ends_inside_a_character_reports_those_ids_with_the_text_that_shows_them() -> None:
    """Two tokens a frame (decode/pacing.py): "a" and the first two bytes of "✓" show only "a"; the ids of the
    character's bytes are reported with the frame that completes it, so a resume never starts inside it."""
    check = "✓".encode()
    steps = [
        ("Hi", _ids(b"Hi")),
        ("a", _ids(b"a") + _ids(check[:2])),
        ("✓b", _ids(check[2:] + b"b")),
        ("!", _ids(b"!")),
    ]
    chat, req = serving(), request()
    ours = asyncio.run(
        _collect(
            sse.text_stream(
                chat,
                req,
                _feed(outputs(steps=steps)),
                "c",
                "m",
                RequestResponseMetadata(request_id="c"),
                None,
                "strip",
            )
        )
    )
    shown = ShownIds(keep=False, tokenizer=ByteTokenizer())
    released, held = [], []
    for f in ours:
        if isinstance(f, sse.Frame):
            released.append(shown.take_frame(f)[1])
            held.append(list(shown.held))
    assert released == [[], _ids(b"Hi"), _ids(b"a"), _ids(check + b"b"), _ids(b"!")]
    assert held == [[], [], _ids(check[:2]), [], []]  # (the character's two bytes wait for its third)


def test_the_ids_whose_text_is_not_shown_yet_are_counted_from_the_end() -> None:
    from decode.pacing import unshown

    tok, euro = ByteTokenizer(), "€".encode()  # (three bytes)
    assert unshown(tok, _ids(b"xy"), 2) == 0
    assert unshown(tok, _ids(b"x" + euro[:1]), 2) == 1
    assert unshown(tok, _ids(b"x" + euro[:2]), 3) == 2
    assert unshown(tok, _ids(euro[:1]) + _ids(euro[1:]), 2) == 0  # (it completes one begun in an earlier frame)
    assert unshown(tok, _ids(b"ab" * 8 + euro), 3) == 0  # (the window reaches the character's first byte)


async def _collect(stream: Any) -> list[Any]:
    return [f async for f in stream]


def test_a_request_started_while_paced_gets_vllms_stream_interval_once_it_is_known_to_be_text_only() -> None:
    from vllm.sampling_params import SamplingParams

    from decode import pacing

    class Client:
        def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
            return (prompt, params)

    client = pacing.PacedClient(Client())
    paced, unpaced, single, own = SamplingParams(), SamplingParams(), SamplingParams(), SamplingParams()
    own.stream_interval = 8  # (a client's own: a larger one stands)
    with pacing.pacing(2):
        client.generate("p", own, "r0")
        pacing.apply()
    with pacing.pacing(3):
        client.generate("p", paced, "r1")
        pacing.apply()  # (decode/sse.py: a text-only stream)
    with pacing.pacing(3):
        client.generate("p", unpaced, "r2")  # (not text-only: vLLM's own generator, never applied)
    with pacing.pacing(1):
        client.generate("p", single, "r3")
        pacing.apply()
    pacing.apply()  # (outside: nothing)
    assert (paced.stream_interval, unpaced.stream_interval, single.stream_interval) == (3, None, None)
    assert own.stream_interval == 8


def test_a_burst_of_starts_is_paced_as_the_streams_it_makes() -> None:
    """Starts in flight count: the answers of a burst that makes `min_streams` streams are paced, though none of
    them is a stream yet when the others decide."""
    from core.config import AppConfig
    from decode import pacing
    from decode.server import DecodeServer

    seen: list[int | None] = []

    class Engine:
        async def openai(self, endpoint: str, body: dict[str, Any]) -> Any:
            pace = pacing.PACE.get()
            seen.append(pace.tokens if pace is not None else None)
            await asyncio.sleep(0.01)  # (vLLM renders and tokenizes: the others start meanwhile)
            return {"error": {"message": "stop here", "code": 400}}

        def shutdown(self) -> None:
            pass

    server = object.__new__(DecodeServer.func_or_class)
    server.config = AppConfig.model_validate({"decode": {"pacing": {"min_streams": 3, "tokens": 2}}})
    server.engine, server.outboxes, server._starting = Engine(), {}, 0

    async def burst() -> None:
        starts = [server.start(consumer="r", stream_id=f"s{i}", endpoint="chat", body={}) for i in range(4)]
        await asyncio.gather(*starts, return_exceptions=True)

    asyncio.run(burst())
    assert seen == [None, None, 2, 2] and server._starting == 0


def test_vllms_frames_of_several_ids_hold_those_that_show_no_text_yet() -> None:
    """vLLM's generator (a client's own stream_interval, speculation): a frame of several ids whose last ones end
    inside a character reports them with the frame that shows their text, as decode's own frames do."""
    check = "✓".encode()

    def frame(text: str, ids: list[int], finish: str | None = None) -> str:
        end = f'"{finish}"' if finish else "null"
        delta = json.dumps({"content": text}, ensure_ascii=False, separators=(",", ":"))
        return f'data: {{"choices":[{{"delta":{delta},"finish_reason":{end},"token_ids":{ids}}}]}}\n\n'

    shown = ShownIds(keep=False, tokenizer=ByteTokenizer())
    frames = [
        frame("a", _ids(b"a") + _ids(check[:2])),
        frame("✓b", _ids(check[2:] + b"b")),
        frame("c", _ids(b"c") + _ids(check[:1]), finish="length"),  # (the end: nothing is held any more)
    ]
    assert [shown.take(f)[2] for f in frames] == [_ids(b"a"), _ids(check + b"b"), _ids(b"c" + check[:1])]
