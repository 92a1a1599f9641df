"""An expired realtime session ends its connection (router/realtime/socket.py): an `error` event, then close code 4408,
whether the owner prefill replica closed the session or the connection itself sat idle or outlived
`limits.max_session_s`; never while a response streams."""

from __future__ import annotations

import time

import pytest
from starlette.websockets import WebSocketDisconnect

from core.protocol import error_body
from router.realtime.socket import SESSION_EXPIRED
from tests.unit.router.test_realtime import USER_ITEM, FakePrefill, connect, still_works, until

pytestmark = pytest.mark.timeout(30)


def assert_closed_expired(ws: object) -> None:
    with pytest.raises(WebSocketDisconnect) as closed:
        ws.receive_json()  # type: ignore[attr-defined]
    assert closed.value.code == SESSION_EXPIRED == 4408
    assert closed.value.reason == "session expired"


@pytest.mark.parametrize(
    "gone",
    [
        error_body(409, "session sess-1 is closed (idle for 300 s)"),
        error_body(404, "session sess-1 not found", "session_id"),
    ],
)
def test_a_session_the_owner_closed_ends_the_connection(gone: dict) -> None:
    prefill = FakePrefill()
    with connect(prefill) as ws:
        prefill.closed = gone
        ws.send_json({"type": "input_text_buffer.append", "delta": "hello", "event_id": "evt_late"})
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["event_id"] == "evt_late"
        assert gone["error"]["message"] in error["error"]["message"]
        assert_closed_expired(ws)
    assert prefill.called("session_delete")  # and whatever is left of it is freed


def test_other_conflicts_leave_the_connection_open() -> None:
    prefill = FakePrefill()
    prefill.fail["session_message"] = error_body(409, "input arrived while the answer is being generated")
    with connect(prefill) as ws:
        ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
        assert ws.receive_json()["type"] == "error"
        still_works(ws)
        prefill.fail["session_claim"] = error_body(404, "session sess-1 has no answer 0", "turn")
        ws.send_json({"type": "response.create"})
        done, _ = until(ws, "response.done")
        assert done["response"]["status"] == "failed"
        still_works(ws)


def test_an_idle_connection_expires() -> None:
    prefill = FakePrefill()
    with connect(prefill, idle_timeout_s=0.3) as ws:
        started = time.monotonic()
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["code"] == "session_expired"
        assert error["error"]["event_id"] is None
        assert time.monotonic() - started >= 0.25
        assert_closed_expired(ws)
    assert prefill.called("session_delete")


def test_client_events_keep_the_connection_alive() -> None:
    with connect(FakePrefill(), idle_timeout_s=1.5) as ws:
        started = time.monotonic()
        for _ in range(4):  # over 2 s in all, never 1.5 s without an event
            time.sleep(0.5)
            still_works(ws)
        assert time.monotonic() - started > 2.0
        error = ws.receive_json()
        assert error["error"]["code"] == "session_expired"
        assert_closed_expired(ws)


def test_a_connection_expires_after_max_session_s_however_busy() -> None:
    with connect(FakePrefill(), idle_timeout_s=10, max_session_s=1.0) as ws:
        started = time.monotonic()
        while True:
            ws.send_json({"type": "session.update", "session": {}})
            if (event := ws.receive_json())["type"] == "error":
                break
            assert event["type"] == "session.updated" and time.monotonic() - started < 5
            time.sleep(0.1)
        assert event["error"]["code"] == "session_expired" and time.monotonic() - started >= 0.9
        assert_closed_expired(ws)


def test_the_max_session_error_says_why() -> None:
    with connect(FakePrefill(), idle_timeout_s=10, max_session_s=0.3) as ws:
        error = ws.receive_json()
        assert error["error"]["code"] == "session_expired" and "maximum duration" in error["error"]["message"]
        assert_closed_expired(ws)


def test_a_streaming_response_is_activity() -> None:
    prefill = FakePrefill()
    prefill.claim_delay = 1.2  # the response is in progress four idle timeouts long
    with connect(prefill, idle_timeout_s=0.3) as ws:
        ws.send_json({"type": "response.create"})
        done, seen = until(ws, "response.done")
        assert "error" not in [e["type"] for e in seen]
        assert done["response"]["status"] == "completed"
        ended = time.monotonic()
        error = ws.receive_json()  # idle from the response's end
        assert error["error"]["code"] == "session_expired"
        assert time.monotonic() - ended >= 0.2
        assert_closed_expired(ws)
