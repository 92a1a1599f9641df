"""Tool calls without an engine: calls put together from vLLM's streamed fragments, replayed whole, checked on
the way in; a session's conversation with calls and their results (REST chunks, journal replay); the Realtime
`function_call` flow against a fake owner replica."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.chat_render import template_messages, template_tools
from core.protocol import parse_sse, sse
from local_models.tools_fit import TOOLS
from prefill.conversation import Conversation
from prefill.journal import replay
from prefill.session import Session, SessionError, SessionLimits, StartPolicy
from prefill.streaming import StreamingPrefill
from router.openai import tool_calls
from router.sessions.outcome import Outcome, completion_object, replay_frames
from tests.unit.router.test_realtime import ANSWER, USER_ITEM, FakePrefill, connect, until

CALL_ID = "chatcmpl-tool-abc"


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


# A streamed answer as vLLM's hermes parser sends it: text before the call, the call's name, arguments in pieces.
STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Let me check."}),
    chunk({"tool_calls": [{"index": 0, "id": CALL_ID, "type": "function", "function": {"name": "get_weather"}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call-2", "type": "function", "function": {"name": "get_time"}}]}),
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"timezone": "UTC"}'}}]}),
    chunk({}, "tool_calls"),
]
CALLS = [
    {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}},
]


def test_streamed_fragments_make_whole_calls() -> None:
    outcome = Outcome()
    for frame in STREAM:
        outcome.absorb(sse(frame), keep_usage=False)
    assert outcome.tool_calls == CALLS
    assert outcome.text == "Let me check." and outcome.finish_reason == "tool_calls"
    assert tool_calls.count_in_frames("".join(sse(f) for f in STREAM)) == 2


def test_a_whole_response_carries_its_calls() -> None:
    outcome = Outcome()
    message = {"role": "assistant", "content": None, "tool_calls": CALLS}
    outcome.absorb_response({"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]})
    assert outcome.tool_calls == CALLS and outcome.text == ""


def test_a_replayed_answer_has_the_same_calls_and_the_openai_client_reads_them() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    summary = {"status": "completed", "text": "Let me check.", "finish_reason": "tool_calls", "tool_calls": CALLS}
    outcome = Outcome()
    frames = replay_frames("chat", summary, include_usage=False)
    outcome.absorb(frames, keep_usage=False)
    assert outcome.tool_calls == CALLS and outcome.text == "Let me check."
    for frame in parse_sse(frames):
        ChatCompletionChunk.model_validate(frame)
    whole = ChatCompletion.model_validate(completion_object("chat", summary))
    assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == [
        c["function"]["arguments"] for c in CALLS
    ]
    assert whole.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("parameters", "why"),
    [("a string", "JSON Schema object"), ({"type": "nonsense"}, "not a valid JSON Schema"), ({"required": 5}, "valid")],
)
def test_a_tool_whose_parameters_are_no_json_schema_is_named(parameters: Any, why: str) -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    index, reason = tool_calls.check_tools(tools)
    assert index == len(TOOLS) and why in reason
    assert tool_calls.check_tools(TOOLS) is None


def session(endpoint: str = "chat") -> Session:
    request = {"messages": [], "tools": TOOLS} if endpoint == "chat" else {"prompt": ""}
    return Session("s-1", endpoint, request, StartPolicy(), SessionLimits(), StreamingPrefill(None, "x"))


def test_a_tool_result_chunk_answers_an_open_call_and_nothing_else() -> None:
    s = session()
    s.add_chunk(0, "What is the weather in Paris?", True)
    s.commit_buffer()  # (as the answer's start does)
    s.conversation.add_answer("", tool_calls=CALLS)
    assert s.conversation.open_tool_calls() == [CALL_ID, "call-2"]
    with pytest.raises(SessionError) as e:
        s.add_chunk(1, "{}", False, role="tool", tool_call_id="call-unknown")
    assert e.value.status == 400 and e.value.param == "tool_call_id" and CALL_ID in e.value.message
    with pytest.raises(SessionError) as e:
        s.add_chunk(1, "{}", False, role="tool", tool_call_id=None)
    assert e.value.param == "tool_call_id"
    with pytest.raises(SessionError) as e:
        s.add_chunk(1, "{}", False, mode="replace", role="tool", tool_call_id=CALL_ID)
    assert e.value.param == "mode"
    assert s.next_seq == 1 and len(s.request["messages"]) == 2  # nothing half-applied
    s.add_chunk(1, '{"temperature_c": 21}', False, role="tool", tool_call_id=CALL_ID)
    with pytest.raises(SessionError):  # answered already
        s.add_chunk(2, "{}", False, role="tool", tool_call_id=CALL_ID)
    s.add_chunk(2, '{"time": "12:00"}', True, role="tool", tool_call_id="call-2")
    assert s.conversation.open_tool_calls() == []
    roles = [(m["role"], m.get("tool_call_id")) for m in s.full_request()["messages"]]
    assert roles == [("user", None), ("assistant", None), ("tool", CALL_ID), ("tool", "call-2")]
    assert s.full_request()["messages"][1]["tool_calls"] == CALLS


def test_a_completion_session_takes_no_tool_results() -> None:
    with pytest.raises(SessionError) as e:
        session("completion").add_chunk(0, "x", False, role="tool", tool_call_id="c")
    assert e.value.param == "role"


def test_the_journal_replays_calls_and_their_results() -> None:
    s = session()
    records = [{"op": "create", **_spec(s)}]
    records.append({"op": "chunk", "seq": 0, "payload": "Weather?", "eoi": True, "mode": "append", "offset": None})
    records.append({"op": "answer", "overrides": {}})
    summary = {"status": "completed", "text": "", "finish_reason": "tool_calls", "tool_calls": CALLS}
    records.append({"op": "ended", "turn": 0, "summary": summary})
    records.append(
        {"op": "chunk", "seq": 1, "payload": "21C", "eoi": False, "mode": "append", "offset": None}
        | {"role": "tool", "tool_call_id": CALL_ID}
    )
    records.append({"op": "message", "role": "tool", "content": "noon", "tool_call_id": "call-2"})
    again = replay(records, StreamingPrefill(None, "s-1"))
    assert again.answers[0].tool_calls == CALLS
    assert again.full_request()["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "21C"},
        {"role": "tool", "tool_call_id": "call-2", "content": "noon"},
    ]


def _spec(s: Session) -> dict[str, Any]:
    from prefill.journal import create_record

    return create_record(s)


def test_a_session_renders_calls_as_vllm_does() -> None:
    """A call's arguments as the API's JSON string and as vLLM's object render the same text; tools render with
    vLLM's defaults (a stream rendered otherwise would miss the prefix cache at the hand-off)."""
    from transformers import AutoTokenizer

    from local_models.llm import make_local_model

    tokenizer = AutoTokenizer.from_pretrained(make_local_model())
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": CALLS}]
    as_strings = Conversation._render(tokenizer, {"tools": TOOLS}, messages)
    objects = [
        messages[0],
        {
            **messages[1],
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in CALLS
            ],
        },
    ]
    as_objects = tokenizer.apply_chat_template(objects, tools=template_tools(TOOLS), tokenize=False)
    assert as_strings == as_objects
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in as_strings
    assert '"description": null' not in as_strings or template_tools([{"type": "function", "function": {"name": "f"}}])
    assert template_messages(messages)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # (the input is left as is)


# --- Realtime ------------------------------------------------------------------------------------------------
RT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


class CallingPrefill(FakePrefill):
    """An owner whose answers are over already with tool calls (replayed whole)."""

    async def _answer(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        reply = await super()._answer(method, *args, **kwargs)
        if method == "session_claim" and "answer" in reply:
            reply["answer"].update(text="", finish_reason="tool_calls", tool_calls=CALLS)
        return reply


def test_realtime_tools_reach_the_owner_in_chat_form() -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        choice = {"type": "function", "name": "get_weather"}
        ws.send_json({"type": "session.update", "session": {"tools": RT_TOOLS, "tool_choice": choice}})
        session = ws.receive_json()["session"]
        assert session["tools"][0]["name"] == "get_weather" and session["tool_choice"] == choice
        params = prefill.called("session_update")[-1]["params"]
        assert params["tools"] == TOOLS
        assert params["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        ws.send_json({"type": "session.update", "session": {"tools": []}})  # [] clears them
        assert ws.receive_json()["session"]["tools"] == []
        assert prefill.called("session_update")[-1]["params"] | {} == {
            "temperature": 0.8,
            "tools": None,
            "tool_choice": None,
        }


@pytest.mark.parametrize(
    ("event", "param"),
    [
        (
            {"type": "session.update", "session": {"tools": [{"name": "f", "parameters": {"type": 5}}]}},
            "session.tools[0].parameters",
        ),
        ({"type": "session.update", "session": {"tools": [{"name": "no spaces"}]}}, "session.tools[0].name"),
        ({"type": "session.update", "session": {"tools": [{"type": "mcp", "name": "f"}]}}, "session.tools[0].type"),
        ({"type": "session.update", "session": {"tools": "f"}}, "session.tools"),
        ({"type": "session.update", "session": {"tool_choice": "sometimes"}}, "session.tool_choice"),
        (
            {
                "type": "session.update",
                "session": {"tools": RT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            },
            "session.tool_choice.name",
        ),
        ({"type": "session.update", "session": {"tool_choice": "required"}}, "session.tool_choice"),
        (
            {"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "nope"}}},
            "response.tool_choice.name",
        ),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "output": "x"}}, "item.call_id"),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "c"}}, "item.output"),
        (
            {"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c", "name": "f"}},
            "item.arguments",
        ),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"},
            },
            "item.arguments",
        ),
        (
            {"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": 5, "output": "x"}},
            "item.call_id",
        ),
    ],
)
def test_bad_tools_and_function_items_answer_an_error_naming_the_field(event: dict[str, Any], param: str) -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        ws.send_json({**event, "event_id": "evt_t"})
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["param"] == param, error
        assert error["error"]["event_id"] == "evt_t"
        assert [name for name, _ in prefill.calls] == ["create_session"]  # nothing applied
        ws.send_json({"type": "session.update", "session": {}})
        assert ws.receive_json()["session"]["tools"] == []


def respond_with_tools(ws: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A session with the tools (a call required), a user item, and a response: `response.done` and the events
    before it."""
    ws.send_json({"type": "session.update", "session": {"tools": RT_TOOLS, "tool_choice": "required"}})
    until(ws, "session.updated")
    ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
    until(ws, "conversation.item.done")
    ws.send_json({"type": "response.create"})
    return until(ws, "response.done")


def test_a_response_that_calls_functions_and_the_result_that_answers_it() -> None:
    prefill = CallingPrefill()
    with connect(prefill) as ws:
        done, seen = respond_with_tools(ws)
        types = [e["type"] for e in seen]
        assert "response.output_text.delta" not in types and "response.content_part.added" not in types
        calls = [e for e in seen if e["type"] == "response.output_item.added"]
        assert [c["item"]["type"] for c in calls] == ["function_call", "function_call"]
        assert [c["item"]["call_id"] for c in calls] == [CALL_ID, "call-2"]
        arguments = [e for e in seen if e["type"] == "response.function_call_arguments.done"]
        assert [a["arguments"] for a in arguments] == [c["function"]["arguments"] for c in CALLS]
        deltas = "".join(e["delta"] for e in seen if e["type"] == "response.function_call_arguments.delta")
        assert deltas == "".join(c["function"]["arguments"] for c in CALLS)
        # Each item is done before the next is added.
        order = [e["type"] for e in seen if e["type"].startswith("response.output_item")]
        assert order == ["response.output_item.added", "response.output_item.done"] * 2
        output = done["response"]["output"]
        assert [(o["type"], o["name"], o["status"]) for o in output] == [
            ("function_call", "get_weather", "completed"),
            ("function_call", "get_time", "completed"),
        ]
        ws.send_json(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": CALL_ID, "output": "21C"},
            }
        )
        created, _ = until(ws, "conversation.item.done")
        assert created["item"]["type"] == "function_call_output" and created["item"]["call_id"] == CALL_ID
        sent = prefill.called("session_message")[-1]
        assert (sent["role"], sent["content"], sent["tool_call_id"]) == ("tool", "21C", CALL_ID)


class CutPrefill(FakePrefill):
    """An owner whose answer was cut by max_output_tokens in its second call's arguments."""

    async def _answer(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        reply = await super()._answer(method, *args, **kwargs)
        if method == "session_claim" and "answer" in reply:
            cut = {**CALLS[1], "function": {**CALLS[1]["function"], "arguments": '{"timezone": "U'}}
            reply["answer"].update(text="", finish_reason="length", tool_calls=[CALLS[0], cut])
        return reply


def test_a_call_cut_by_max_output_tokens_is_incomplete_and_its_arguments_never_done() -> None:
    """As OpenAI marks it: the item the cut fell in is `incomplete` (the response too); its arguments are not
    announced `done` (a client that runs calls on that event would run `{"timezone": "U`). The call before it is
    whole."""
    prefill = CutPrefill()
    with connect(prefill) as ws:
        done, seen = respond_with_tools(ws)
    assert done["response"]["status"] == "incomplete"
    assert done["response"]["status_details"]["reason"] == "max_output_tokens"
    output = done["response"]["output"]
    assert [(o["name"], o["status"]) for o in output] == [("get_weather", "completed"), ("get_time", "incomplete")]
    assert output[1]["arguments"] == '{"timezone": "U'  # (what was made, for a client that wants it)
    arguments = [e["arguments"] for e in seen if e["type"] == "response.function_call_arguments.done"]
    assert arguments == [CALLS[0]["function"]["arguments"]]
    items_done = [e["item"] for e in seen if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in items_done] == ["completed", "incomplete"]


def test_a_text_answer_still_has_its_message_item() -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
        until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create"})
        done, seen = until(ws, "response.done")
        assert [o["type"] for o in done["response"]["output"]] == ["message"]
        assert done["response"]["output"][0]["content"][0]["text"] == ANSWER["text"]
        assert "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta") == ANSWER["text"]


def test_the_shipped_config_turns_tool_calls_on_for_both_engines() -> None:
    """The default config's tool parser reaches vLLM's args on both roles (auto tool choice), and its
    structured-outputs settings fill vLLM's own config dataclass (compact JSON for forced calls)."""
    from pathlib import Path

    import yaml

    from core.config import AppConfig
    from engine.llm import build_engine_args
    from local_models.llm import make_local_model

    root = Path(__file__).resolve().parents[3]
    args = yaml.safe_load((root / "configs" / "config.yaml").read_text())["applications"][0]["args"]
    app = AppConfig.model_validate({**args, "model": str(make_local_model())})
    for role in ("prefill", "decode"):
        engine = build_engine_args(app, role)
        assert engine.enable_auto_tool_choice is True and engine.tool_call_parser == "hermes"
        assert engine.structured_outputs_config.disable_any_whitespace is True
        assert engine.structured_outputs_config.backend == "xgrammar"
        assert app.engine_for(role).env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "0"
    assert (
        build_engine_args(AppConfig.model_validate({"model": str(make_local_model())}), "decode").tool_call_parser
        is None
    )
