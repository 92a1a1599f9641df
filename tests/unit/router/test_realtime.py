"""The realtime WebSocket (router/realtime/socket.py) survives any client event: with a fake ingress and prefill
replica,
every malformed, mistyped, binary or oversized frame answers an `error` event naming the field and the client's
`event_id`, applies nothing, and the session keeps working."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketTestSession

from core.config import AppConfig
from core.protocol import error_body
from prefill.client import PrefillClient
from router.keys.auth import APIKeys
from router.realtime import socket as realtime

pytestmark = pytest.mark.timeout(30)

MODEL = "local:tiny-llama"
ANSWER = {
    "status": "completed",
    "text": "Hello there",
    "finish_reason": "stop",
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}


class FakePrefill:
    """The owner prefill replica: records every call (method, kwargs); `fail[method]` answers that method's
    next call with an error; `closed` answers every session call as a closed session does; `claim_delay`
    holds an answer's claim (a response in progress)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: dict[str, dict[str, Any] | Exception] = {}
        self.closed: dict[str, Any] | None = None
        self.claim_delay = 0.0
        self.turns = 0

    def options(self, **options: Any) -> FakePrefill:  # (the prefill client's handle options)
        return self

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return SimpleNamespace(remote=lambda *args, **kwargs: self._answer(method, *args, **kwargs))

    def called(self, method: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == method]

    async def _answer(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((method, args[0] if args else kwargs))
        if method == "create_session":
            return {"session_id": "sess-1"}
        if method == "session_delete":
            return {"session_id": "sess-1", "deleted": True}
        if self.closed is not None:
            return self.closed
        if (failure := self.fail.pop(method, None)) is not None:
            if isinstance(failure, Exception):
                raise failure
            return failure
        if method == "session_respond":
            self.turns += 1
            return {"session_id": "sess-1", "answer": {"turn": self.turns - 1, "status": "preparing"}}
        if method == "session_claim":  # an answer over already: replayed whole (no decode needed)
            await asyncio.sleep(self.claim_delay)
            return {"turn": kwargs["turn"], "answer": dict(ANSWER)}
        return {"session_id": "sess-1"}


def make_client(prefill: FakePrefill, **limits: Any) -> TestClient:
    app = FastAPI()
    app.include_router(realtime.api)
    config = SimpleNamespace(
        model_name=MODEL, limits=AppConfig().limits.model_copy(update=limits), speech=AppConfig().speech
    )
    app.state.ingress = SimpleNamespace(api_keys=APIKeys([]), config=config, prefill=PrefillClient(prefill))
    return TestClient(app)


@contextlib.contextmanager
def connect(prefill: FakePrefill, beta: bool = False, **limits: Any) -> Iterator[WebSocketTestSession]:
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    with make_client(prefill, **limits).websocket_connect("/v1/realtime", headers=headers) as ws:
        assert ws.receive_json()["type"] == "session.created"
        yield ws


def until(ws: WebSocketTestSession, wanted: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    seen = []
    while True:
        event = ws.receive_json()
        seen.append(event)
        if event["type"] == wanted:
            return event, seen


def still_works(ws: WebSocketTestSession) -> dict[str, Any]:
    """A good event after a bad one is applied: the session as the server now has it."""
    ws.send_json({"type": "session.update", "session": {}, "event_id": "evt_good"})
    event = ws.receive_json()
    assert event["type"] == "session.updated", event
    return event["session"]


USER_ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}

BAD_EVENTS = [
    # (the event, the error's code, its param)
    (
        {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": "hi"}},
        "item.content",
    ),
    ({"type": "conversation.item.create", "item": "hi"}, "item"),
    ({"type": "conversation.item.create", "item": []}, "item"),
    ({"type": "conversation.item.create"}, "item"),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "role": "robot"}}, "item.role"),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "role": None}}, "item.role"),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "type": "function_call"}}, "item.call_id"),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "type": "mcp_call"}}, "item.type"),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "content": ["hi"]}}, "item.content[0]"),
    (
        {"type": "conversation.item.create", "item": {**USER_ITEM, "content": [{"type": "input_text", "text": 5}]}},
        "item.content[0].text",
    ),
    ({"type": "session.update", "session": []}, "session"),
    ({"type": "session.update", "session": "text"}, "session"),
    ({"type": "session.update", "session": {"max_output_tokens": "abc"}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": -5}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": 0}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": True}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": "12.5"}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": 12.0}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": "12"}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"temperature": "0.5"}}, "session.temperature"),
    ({"type": "session.update", "session": {"temperature": 2.5}}, "session.temperature"),
    ({"type": "session.update", "session": {"temperature": -0.1}}, "session.temperature"),
    ({"type": "session.update", "session": {"temperature": True}}, "session.temperature"),
    ({"type": "session.update", "session": {"instructions": 5}}, "session.instructions"),
    ({"type": "session.update", "session": {"instructions": ["be brief"]}}, "session.instructions"),
    ({"type": "session.update", "session": {"output_modalities": "text"}}, "session.output_modalities"),
    ({"type": "input_text_buffer.append", "delta": 5}, "delta"),
    ({"type": "input_text_buffer.append", "delta": None}, "delta"),
    ({"type": "input_text_buffer.append"}, "delta"),
    ({"type": "input_text_buffer.append", "text": {"t": "x"}}, "text"),
    ({"type": "input_text_buffer.replace", "text": "x", "offset": -1}, "offset"),
    ({"type": "input_text_buffer.replace", "text": "x", "offset": "0"}, "offset"),
    ({"type": "input_text_buffer.replace", "text": "x", "offset": True}, "offset"),
    ({"type": "input_text_buffer.replace", "text": "x", "offset": 10**6}, "offset"),
    ({"type": "input_text_buffer.replace", "offset": 0}, "text"),
    ({"type": "response.create", "response": "now"}, "response"),
    ({"type": "response.create", "response": ["x"]}, "response"),
    ({"type": "response.create", "response": {"max_output_tokens": "abc"}}, "response.max_output_tokens"),
    ({"type": "response.create", "response": {"temperature": "hot"}}, "response.temperature"),
    ({"type": "response.create", "response": {"instructions": 1}}, "response.instructions"),
    ({"type": "response.cancel", "response_id": 7}, "response_id"),
]


@pytest.mark.parametrize(("bad", "param"), BAD_EVENTS)
def test_an_invalid_event_answers_an_error_naming_the_field_and_applies_nothing(
    bad: dict[str, Any], param: str
) -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        ws.send_json({**bad, "event_id": "evt_bad"})
        error = ws.receive_json()
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == "invalid_event"
        assert error["error"]["param"] == param
        assert error["error"]["event_id"] == "evt_bad"
        assert param.split(".")[-1].split("[")[0] in error["error"]["message"]
        # Nothing reached the owner, and nothing was stored: the next good event works on the old settings.
        assert [name for name, _ in prefill.calls] == ["create_session"]
        session = still_works(ws)
        assert session["max_output_tokens"] == "inf" and session["temperature"] == 0.8
        assert session["instructions"] == ""


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_json"),
        ('"session.update"', "invalid_json"),
        ("{}", "invalid_json"),
        ('{"type": 5}', "invalid_json"),
        ("[" * 100_000, "invalid_json"),
        ('{"type": "no.such.event"}', "unknown_event"),
    ],
)
def test_a_frame_that_is_not_an_event_answers_an_error(frame: str, code: str) -> None:
    with connect(FakePrefill()) as ws:
        ws.send_text(frame)
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["code"] == code
        still_works(ws)


def test_the_error_carries_the_clients_event_id_only_when_it_is_a_string() -> None:
    with connect(FakePrefill()) as ws:
        ws.send_json({"type": "no.such.event", "event_id": "evt_1"})
        assert ws.receive_json()["error"]["event_id"] == "evt_1"
        ws.send_json({"type": "session.update", "session": [], "event_id": {"not": "a string"}})
        error = ws.receive_json()["error"]
        assert error["event_id"] is None and error["code"] == "invalid_event"
        still_works(ws)


def test_a_binary_frame_answers_an_error_and_the_session_goes_on() -> None:
    with connect(FakePrefill()) as ws:
        ws.send_bytes(b'{"type": "session.update"}')
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["code"] == "binary_not_supported"
        still_works(ws)


def test_a_frame_over_max_frame_bytes_is_refused_whole() -> None:
    prefill = FakePrefill()
    with connect(prefill, max_frame_bytes=1024) as ws:
        for text in ("x" * 1100, "é" * 600):  # 1200 bytes in 600 characters: the limit is in UTF-8 bytes
            ws.send_json({"type": "session.update", "session": {"instructions": text}, "event_id": "evt_big"})
            error = ws.receive_json()
            assert error["type"] == "error" and error["error"]["code"] == "frame_too_large"
        assert prefill.called("session_update") == []
        ws.send_json({"type": "session.update", "session": {"instructions": "é" * 400}})  # 800 bytes
        assert ws.receive_json()["session"]["instructions"] == "é" * 400


def test_a_refused_session_update_is_not_stored() -> None:
    prefill = FakePrefill()
    prefill.fail["session_update"] = error_body(400, "max_tokens is too large", "max_tokens")
    with connect(prefill) as ws:
        ws.send_json({"type": "session.update", "session": {"max_output_tokens": 10**9}, "event_id": "evt_u"})
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["event_id"] == "evt_u"
        assert error["error"]["param"] == "max_tokens"
        assert still_works(ws)["max_output_tokens"] == "inf"


def test_after_an_invalid_max_output_tokens_responses_still_work() -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        for bad in ("abc", -5, 0, True, "1.5"):
            ws.send_json({"type": "session.update", "session": {"max_output_tokens": bad}})
            assert ws.receive_json()["type"] == "error"
        ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
        until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create"})
        done, seen = until(ws, "response.done")
        assert "error" not in [e["type"] for e in seen]
        assert done["response"]["status"] == "completed"
        assert done["response"]["output"][0]["content"][0]["text"] == ANSWER["text"]
        assert prefill.called("session_respond")[0]["overrides"] == {"temperature": 0.8}


def test_valid_settings_reach_the_owner_and_inf_lifts_a_token_limit() -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        ws.send_json({"type": "session.update", "session": {"max_output_tokens": 5, "temperature": 0, "voice": "x"}})
        session = ws.receive_json()["session"]
        assert session["max_output_tokens"] == 5 and session["temperature"] == 0
        assert "voice" not in session  # not implemented: ignored, as OpenAI clients send it anyway
        assert prefill.called("session_update")[-1]["params"] == {"max_tokens": 5, "temperature": 0.0}
        ws.send_json({"type": "session.update", "session": {"max_output_tokens": "inf"}})
        assert ws.receive_json()["session"]["max_output_tokens"] == "inf"
        assert prefill.called("session_update")[-1]["params"] == {"max_tokens": None, "temperature": 0.0}


def test_beta_names_for_modalities_and_max_response_output_tokens() -> None:
    prefill = FakePrefill()
    with connect(prefill, beta=True) as ws:
        session = {"modalities": ["text"], "max_response_output_tokens": 7}
        ws.send_json({"type": "session.update", "session": session})
        updated = ws.receive_json()
        assert updated["type"] == "session.updated" and updated["session"]["modalities"] == ["text"]
        assert prefill.called("session_update")[-1]["params"]["max_tokens"] == 7
        ws.send_json({"type": "session.update", "session": {"modalities": ["text", "audio"]}, "event_id": "e"})
        error = ws.receive_json()["error"]  # (no TTS role here: tests/unit/router/test_realtime_speech.py has one)
        assert error["code"] == "audio_output_not_supported" and error["param"] == "session.modalities"


def test_item_text_parts_and_the_buffers_beta_text_field() -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        content = [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "input_audio"}]
        item = {"type": "message", "role": "user", "content": content, "id": "item_1"}
        ws.send_json({"type": "conversation.item.create", "item": item})
        created = ws.receive_json()
        assert created["type"] == "conversation.item.created" and created["item"]["id"] == "item_1"
        assert created["item"]["content"] == content
        assert prefill.called("session_message")[-1]["content"] == "ab"
        until(ws, "conversation.item.done")
        ws.send_json({"type": "input_text_buffer.append", "text": "typed "})  # beta's `text`
        ws.send_json({"type": "input_text_buffer.append", "delta": "more"})
        ws.send_json({"type": "input_text_buffer.commit"})
        created, _ = until(ws, "conversation.item.created")
        assert created["item"]["content"] == [{"type": "input_text", "text": "typed more"}]


def test_relayed_owner_errors_carry_the_event_id() -> None:
    prefill = FakePrefill()
    prefill.fail["session_buffer"] = error_body(413, "one chunk holds at most 10 bytes", "delta")
    with connect(prefill) as ws:
        ws.send_json({"type": "input_text_buffer.append", "delta": "x" * 11, "event_id": "evt_big"})
        error = ws.receive_json()["error"]
        assert error["event_id"] == "evt_big" and error["param"] == "delta"
        assert error["code"] == "PayloadTooLargeError"
        ws.send_json({"type": "input_text_buffer.commit", "event_id": "evt_empty"})
        error = ws.receive_json()["error"]  # the refused text never joined the buffer
        assert error["code"] == "input_text_buffer_empty" and error["event_id"] == "evt_empty"


def test_a_failing_handler_answers_server_error_without_logging_the_text(caplog: pytest.LogCaptureFixture) -> None:
    prefill = FakePrefill()
    prefill.fail["session_message"] = RuntimeError("the replica died")
    secret = "my very secret prompt"
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": secret}]}
    with caplog.at_level(logging.ERROR, logger="router.realtime.socket"), connect(prefill) as ws:
        ws.send_json({"type": "conversation.item.create", "item": item, "event_id": "evt_x"})
        error = ws.receive_json()
        assert error["type"] == "error"
        assert error["error"]["code"] == "server_error" and error["error"]["event_id"] == "evt_x"
        assert secret not in json.dumps(error)
        ws.send_json({"type": "conversation.item.create", "item": item})
        assert ws.receive_json()["type"] == "conversation.item.created"
    logged = [r for r in caplog.records if r.name == "router.realtime.socket"]
    assert logged and all(secret not in r.getMessage() and secret not in (r.exc_text or "") for r in logged)


def test_a_second_response_create_while_one_streams_is_refused_with_its_event_id() -> None:
    prefill = FakePrefill()
    prefill.claim_delay = 0.5
    with connect(prefill) as ws:
        ws.send_json({"type": "response.create"})
        until(ws, "response.created")
        ws.send_json({"type": "response.create", "event_id": "evt_2"})
        error, _ = until(ws, "error")
        assert error["error"]["code"] == "conversation_already_has_active_response"
        assert error["error"]["event_id"] == "evt_2"
        done, _ = until(ws, "response.done")
        assert done["response"]["status"] == "completed"


def test_text_typed_before_an_item_is_committed_first_on_both_sides() -> None:
    """The owner commits typed text before an item; the router's copy of the buffer follows, so a later
    `replace` is checked against the same (empty) buffer on both sides."""
    prefill = FakePrefill()
    with connect(prefill) as ws:
        ws.send_json({"type": "input_text_buffer.append", "delta": "ab"})
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]}
        ws.send_json({"type": "conversation.item.create", "item": item})
        committed, _ = until(ws, "input_text_buffer.committed")
        created, _ = until(ws, "conversation.item.created")
        assert created["item"]["content"] == [{"type": "input_text", "text": "ab"}]
        until(ws, "conversation.item.done")
        created, _ = until(ws, "conversation.item.created")
        assert created["item"]["content"] == [{"type": "input_text", "text": "next"}]
        ops = [k.get("op") for name, k in prefill.calls if name in ("session_buffer", "session_message")]
        assert ops == ["append", "commit", None]
        ws.send_json({"type": "input_text_buffer.replace", "text": "x", "offset": 2, "event_id": "evt_r"})
        error, _ = until(ws, "error")
        assert error["error"]["param"] == "offset" and error["error"]["event_id"] == "evt_r"


@pytest.mark.parametrize("once", [True, False])
def test_a_one_turn_connection_closes_with_1000_after_its_answer(once: bool) -> None:
    """`?close_after_answer=true` reaches the owner with the session's creation, and the socket closes (1000)
    right after `response.done`; without it the connection stays open for the next turn."""
    from starlette.websockets import WebSocketDisconnect

    prefill = FakePrefill()
    url = "/v1/realtime" + ("?close_after_answer=true" if once else "")
    with make_client(prefill).websocket_connect(url) as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "input_text_buffer.append", "delta": "hello"})
        ws.send_json({"type": "response.create"})
        until(ws, "response.done")
        if once:
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
            assert closed.value.code == 1000
        else:
            assert still_works(ws)
    assert prefill.called("create_session")[0]["close_after_answer"] is once
