"""What every HTTP ingress must carry, checked the same way behind HAProxy (the default; test_ingress.py, on the
test session's app) and behind Serve's own proxy (test_engine_exit.py's `make run` with
`RAY_SERVE_ENABLE_HA_PROXY=0`): readiness, an SSE answer, an NDJSON request body, a realtime WebSocket turn, a
client that leaves mid-answer, and the server answering on afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import websockets

from core.protocol import choice_text

CHAT = {"messages": [{"role": "user", "content": "Say something about rivers."}], "temperature": 0}


def sse_texts(lines: list[str]) -> list[str]:
    return [choice_text(json.loads(line[6:]))[0] for line in lines if line.startswith("data: {")]


async def _sse(http: httpx.AsyncClient) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 8, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.status_code
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and "".join(sse_texts(lines)), lines
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 8, usage


async def _ndjson(http: httpx.AsyncClient) -> None:
    first = {**CHAT, "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "Rivers "}]}

    async def body() -> Any:
        yield (json.dumps(first) + "\n").encode()
        await asyncio.sleep(0.05)
        yield (json.dumps({"payload": "run to the sea.", "end_of_input": True}) + "\n").encode()

    headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
    async with http.stream("POST", "/v1/chat/completions", content=body(), headers=headers) as r:
        assert r.status_code == 200 and r.headers.get("x-session-id"), r.status_code
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and "".join(sse_texts(lines)), lines


async def _realtime(base: str) -> None:
    async with websockets.connect(base.replace("http://", "ws://") + "/v1/realtime", max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
        await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": "Rivers run "}))
        await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": "to the sea."}))
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4}}))
        text = ""
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert event["type"] != "error", event
            if event["type"] == "response.output_text.delta":
                text += event["delta"]
            if event["type"] == "response.done":
                assert event["response"]["status"] in ("completed", "incomplete") and text, event
                return


async def _leave_mid_answer(http: httpx.AsyncClient) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 256, "ignore_eos": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and "".join(sse_texts([line])):
                return  # (the connection closes with the block)


async def check_ingress(base: str) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        assert (await http.get("/health")).status_code == 200
        await _sse(http)
        await _ndjson(http)
        await _realtime(base)
        await _leave_mid_answer(http)
        await _sse(http)  # the server answers on
        missing = await http.post("/v1/chat/completions", json={"messages": "not a list"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages", missing.text
