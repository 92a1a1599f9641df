"""Tool calls end to end, on the real stack: chat completions through prefill → NIXL → decode and through
decode-local prefill, REST sessions, and the Realtime function-calling flow with the official client.

Forced calls (a named `tool_choice`, `required`) run on the main app's random model: vLLM's structured outputs
make the call whatever the weights. `tool_choice: "auto"` needs a model that decides to call: a second app serves
`local:tiny-llama-tools`, the tiny model fitted at build time to answer a few conversations (local_models/tools_fit.py)
with Hermes `<tool_call>` text, which vLLM's `hermes` parser (configs/config.yaml) turns into `tool_calls`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import jsonschema
import pytest
from ray import serve

from core.protocol import parse_sse
from local_models.tools_fit import PARIS, TOOLS, WEATHER_RESULT
from router.openai.tool_calls import merge_deltas
from tests.integration.conftest import TOOLS_APP as APP
from tests.integration.test_metrics import scrape
from tests.integration.test_streaming_input import SESSIONS, TEXT

pytestmark = pytest.mark.integration

# Bounded arguments: a random model fills a free string until max_tokens; an enum makes the call end.
FORCED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
PARIS_ANSWER = "It is 21 degrees and clear in Paris."


def chat(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], httpx.Headers]:
    """A chat completion, streamed or not, as (the message, finish_reason, usage) and the response headers; a
    streamed answer is put together from its frames as a client does."""
    body = {"temperature": 0, "max_tokens": 120, **body}
    if not body.get("stream"):
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {**choice["message"], "finish_reason": choice["finish_reason"]}, r.headers
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = "".join(r.iter_text())
        headers = r.headers
    message: dict[str, Any] = {"content": "", "tool_calls": [], "finish_reason": None}
    for frame in parse_sse(text):
        for choice in frame.get("choices") or []:
            delta = choice.get("delta") or {}
            message["content"] += delta.get("content") or ""
            merge_deltas(message["tool_calls"], delta.get("tool_calls"))
            message["finish_reason"] = choice.get("finish_reason") or message["finish_reason"]
    return message, headers


def calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, every call with an id and JSON arguments."""
    out = []
    for call in message.get("tool_calls") or []:
        assert call["id"] and call["type"] == "function", call
        out.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return out


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_a_forced_call_through_prefill_and_decode_and_through_decode_alone(server, tools_app, tool_choice) -> None:
    """The call validates against its schema and is the same streamed or not, on the main app (prefilled on the
    prefill replica, its KV pulled over NIXL) and on the tools app (whose router has decode compute every
    prompt itself)."""
    for base, where in ((server, "prefill"), (tools_app, "decode")):
        seen = []
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": TEXT}], "tools": FORCED_TOOLS}
            body.update(tool_choice=tool_choice, stream=stream, parallel_tool_calls=False)
            message, headers = chat(base, body)
            assert headers["x-prefilled-by"] == where
            made = calls(message)
            assert len(made) == 1, message
            name, arguments = made[0]
            if isinstance(tool_choice, dict):
                assert name == "get_weather"
            jsonschema.validate(arguments, SCHEMAS[name])
            assert message["finish_reason"] in ("tool_calls", "stop")
            seen.append(made)
        assert seen[0] == seen[1], where


def test_bad_tools_are_refused_naming_the_field(server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    cases = [
        ({"tools": bad_schema}, "tools.0.function.parameters"),
        ({"tools": FORCED_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ]
    for extra, param in cases:
        for path in ("/v1/chat/completions", SESSIONS):
            r = httpx.post(f"{server}{path}", json={"messages": messages, **extra}, timeout=60)
            assert r.status_code == 400, (path, extra, r.text)
            assert (r.json()["error"]["param"] or "").startswith(param), (path, r.json())
    assert httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).status_code == 200


# --- the fitted model: tool_choice "auto" ----------------------------------------------------------------------
def tools_stats(role: str, prefix: str | None = None) -> dict[str, Any]:
    return serve.get_deployment_handle(role, app_name=APP).stats.remote(prefix).result(timeout_s=60)


PARIS_CALL = [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_turns_the_models_call_into_tool_calls_and_the_result_into_an_answer(tools_app, stream) -> None:
    message, headers = chat(tools_app, {"messages": PARIS, "tools": TOOLS, "stream": stream})
    assert headers["x-prefilled-by"] == "decode"
    assert calls(message) == PARIS_CALL and message["finish_reason"] == "tool_calls"
    assert not message.get("content")  # the call's text is not content
    both = [{"role": "user", "content": "Compare the weather in Paris and Rome."}]
    parallel, _ = chat(tools_app, {"messages": both, "tools": TOOLS, "stream": stream})
    assert calls(parallel) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len({c["id"] for c in parallel["tool_calls"]}) == 2
    # The tool's result continues the conversation: the model answers in text, and decode finds the first
    # request's KV in its prefix cache (it computes the call and the result, not the conversation again).
    call = message["tool_calls"][0]
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_RESULT}
    rid = uuid.uuid4().hex
    body = {"messages": [*PARIS, assistant, result], "tools": TOOLS, "stream": stream}
    r = httpx.post(
        f"{tools_app}/v1/chat/completions",
        json={**body, "temperature": 0, "max_tokens": 40, "stream": False},
        headers={"x-request-id": rid},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == PARIS_ANSWER
    assert not answer["choices"][0]["message"].get("tool_calls")
    first = httpx.post(
        f"{tools_app}/v1/chat/completions",
        json={"messages": PARIS, "tools": TOOLS, "max_tokens": 1, "temperature": 0},
        timeout=120,
    ).json()
    computed = tools_stats("decode", rid)["prompt_tokens_computed"]
    block = tools_stats("prefill")["block_size"]  # (the same for both engines)
    new = answer["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    assert 0 < computed <= new + block, (computed, new, block)


def test_a_rest_session_whose_answer_is_a_call_takes_the_result_as_its_next_input(tools_app) -> None:
    r = httpx.post(
        f"{tools_app}{SESSIONS}", json={"messages": [], "tools": TOOLS, "max_tokens": 60, "temperature": 0}, timeout=60
    )
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    try:
        question = PARIS[0]["content"]
        for seq, piece in enumerate((question[:12], question[12:])):
            body = {"sequence_id": seq, "payload": piece, "end_of_input": seq == 1}
            assert httpx.post(f"{tools_app}{SESSIONS}/{sid}/chunks", json=body, timeout=60).status_code == 202
        with httpx.stream("GET", f"{tools_app}{SESSIONS}/{sid}/events", timeout=120) as events:
            frames = parse_sse("".join(events.iter_text()))
        streamed: list[dict[str, Any]] = []
        for frame in frames:
            for choice in frame.get("choices") or []:
                merge_deltas(streamed, (choice.get("delta") or {}).get("tool_calls"))
        assert calls({"tool_calls": streamed}) == PARIS_CALL
        whole = httpx.get(f"{tools_app}{SESSIONS}/{sid}/result", timeout=120).json()
        message = whole["choices"][0]["message"]
        assert calls(message) == PARIS_CALL and whole["choices"][0]["finish_reason"] == "tool_calls"
        call_id = message["tool_calls"][0]["id"]
        assert call_id == streamed[0]["id"]
        first_prompt = whole["usage"]["prompt_tokens"]
        # A result for a call that was never made is refused, and changes nothing.
        bad = {"sequence_id": 2, "payload": "{}", "role": "tool", "tool_call_id": "call_nope", "end_of_input": True}
        r = httpx.post(f"{tools_app}{SESSIONS}/{sid}/chunks", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_call_id", r.text
        chunk = {**bad, "payload": WEATHER_RESULT, "tool_call_id": call_id}
        assert httpx.post(f"{tools_app}{SESSIONS}/{sid}/chunks", json=chunk, timeout=60).status_code == 202
        second = httpx.get(f"{tools_app}{SESSIONS}/{sid}/result", timeout=120).json()
        assert second["choices"][0]["message"]["content"] == PARIS_ANSWER
        # The second turn reused the conversation's KV: over both turns prefill computed the final prompt once,
        # with at most a block more per hand-off (vLLM's prefix cache holds whole blocks: each turn's end computes
        # its last partial block again). Without the reuse it would compute the first turn's prompt twice.
        session = httpx.get(f"{tools_app}{SESSIONS}/{sid}", timeout=60).json()
        block = session["block_size"]
        assert session["prompt_tokens_computed"] <= second["usage"]["prompt_tokens"] + 2 * block, session
        assert session["prompt_tokens_computed"] < second["usage"]["prompt_tokens"] + first_prompt, session
        assert tools_stats("decode", sid)["prompt_tokens_computed"] <= 2 * block
    finally:
        httpx.delete(f"{tools_app}{SESSIONS}/{sid}", timeout=60)


def test_an_ndjson_body_with_tools_streams_the_call(tools_app) -> None:
    question = PARIS[0]["content"]

    async def body() -> Any:
        first = {"messages": [{"role": "user", "content": question[:10]}], "tools": TOOLS, "stream": True}
        yield (json.dumps({**first, "temperature": 0, "max_tokens": 60}) + "\n").encode()
        yield (json.dumps({"payload": question[10:]}) + "\n").encode()
        yield b'{"end_of_input": true}\n'

    async def run() -> str:
        headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{tools_app}/v1/chat/completions", content=body(), headers=headers) as r,
        ):
            assert r.status_code == 200
            return "".join([text async for text in r.aiter_text()])

    streamed: list[dict[str, Any]] = []
    finish = None
    for frame in parse_sse(asyncio.run(run())):
        for choice in frame.get("choices") or []:
            merge_deltas(streamed, (choice.get("delta") or {}).get("tool_calls"))
            finish = choice.get("finish_reason") or finish
    assert calls({"tool_calls": streamed}) == PARIS_CALL and finish == "tool_calls"
    bad = {"messages": PARIS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}
    r = httpx.post(
        f"{tools_app}/v1/chat/completions",
        content=json.dumps(bad) + "\n",
        headers={"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.parameters"


def test_the_official_realtime_client_calls_a_function_and_answers_from_its_output(tools_app) -> None:
    from openai import AsyncOpenAI

    realtime_tools = [{"type": "function", **t["function"]} for t in TOOLS]

    async def response(conn: Any) -> tuple[list[Any], Any]:
        seen = []
        async for event in conn:
            seen.append(event)
            if event.type == "response.done":
                return seen, event
        raise AssertionError("the connection closed")

    async def run() -> tuple[list[Any], Any, list[Any], Any]:
        client = AsyncOpenAI(base_url=f"{tools_app}/v1", api_key="unused")
        async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
            session = {"type": "realtime", "output_modalities": ["text"], "tools": realtime_tools}
            await conn.session.update(session={**session, "tool_choice": "auto", "temperature": 0})
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": PARIS[0]["content"]}],
                }
            )
            await conn.response.create()
            first, first_done = await response(conn)
            call = next(e for e in first if e.type == "response.function_call_arguments.done")
            await conn.conversation.item.create(
                item={"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}
            )
            await conn.response.create()
            second, second_done = await response(conn)
            return first, first_done, second, second_done

    before = scrape()
    first, first_done, second, second_done = asyncio.run(run())
    output = first_done.response.output
    assert [(o.type, o.name, json.loads(o.arguments)) for o in output] == [
        ("function_call", "get_weather", {"city": "Paris"})
    ]
    assert output[0].call_id and first_done.response.status == "completed"
    deltas = "".join(e.delta for e in first if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == {"city": "Paris"}
    assert not [e for e in first if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in second if e.type == "response.output_text.delta")
    assert text == PARIS_ANSWER and second_done.response.output[0].type == "message"
    deadline = time.time() + 30  # the router's counter, through Ray's metrics agent
    while (moved := scrape().get("rtpd_tool_calls_total", 0) - before.get("rtpd_tool_calls_total", 0)) < 1:
        assert time.time() < deadline, "rtpd_tool_calls_total did not move"
        time.sleep(1)
    assert moved >= 1


def test_a_call_cut_by_max_tokens_is_incomplete_on_every_surface(tools_app) -> None:
    """A call the token limit cut short is not a call to run: chat says `length` (streamed and whole), the
    realtime item is `incomplete` with no `function_call_arguments.done` (its JSON is half made)."""
    full = httpx.post(
        f"{tools_app}/v1/chat/completions",
        json={"messages": PARIS, "tools": TOOLS, "max_tokens": 120, "temperature": 0},
        timeout=120,
    ).json()
    assert calls(full["choices"][0]["message"]) == PARIS_CALL
    cut_at = full["usage"]["completion_tokens"] - 4  # (inside the call, past its name)
    for stream in (False, True):
        message, _ = chat(tools_app, {"messages": PARIS, "tools": TOOLS, "stream": stream, "max_tokens": cut_at})
        assert message["finish_reason"] == "length", message

    async def realtime() -> list[dict[str, Any]]:
        import websockets

        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        session = {"output_modalities": ["text"], "tools": tools, "temperature": 0, "max_output_tokens": cut_at}
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PARIS[0]["content"]}]}
        seen: list[dict[str, Any]] = []
        async with websockets.connect(tools_app.replace("http://", "ws://") + "/v1/realtime") as ws:
            for event in (
                {"type": "session.update", "session": session},
                {"type": "conversation.item.create", "item": item},
                {"type": "response.create"},
            ):
                await ws.send(json.dumps(event))
            async with asyncio.timeout(120):
                async for raw in ws:
                    seen.append(json.loads(raw))
                    assert seen[-1]["type"] != "error", seen[-1]
                    if seen[-1]["type"] == "response.done":
                        return seen
        raise AssertionError("the connection closed")

    seen = asyncio.run(realtime())
    response = seen[-1]["response"]
    assert response["status"] == "incomplete" and response["status_details"]["reason"] == "max_output_tokens"
    (call,) = [o for o in response["output"] if o["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["status"] == "incomplete"
    assert not [e for e in seen if e["type"] == "response.function_call_arguments.done"]
