"""Realtime connections across a router restart and under overload (router/realtime/socket.py, router/restart.py): a
stopping replica closes its connections with an `error` naming the session and 1012, keeps their sessions, and a
client re-attaches with `?session_id=`; a session that is gone gets 4404; an overloaded server 1013."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from core.config import AppConfig
from core.protocol import error_body
from prefill.client import PrefillClient
from router.admission.gate import Refusal
from router.keys.auth import APIKeys
from router.realtime import socket as realtime
from router.restart import RestartWatch, replica_shutting_down
from tests.unit.router.test_realtime import MODEL, FakePrefill, until

pytestmark = pytest.mark.timeout(30)


class Overloaded:
    async def admit(self, kind: str) -> Refusal:
        return Refusal("sessions_full", "the server is overloaded", 4)


@contextlib.contextmanager
def serving(prefill: FakePrefill, admission: Any = None) -> Iterator[tuple[TestClient, threading.Event, RestartWatch]]:
    """An app whose replica 'stops' when the returned flag is set (the probe router/restart.py polls)."""
    stopping = threading.Event()
    watch = RestartWatch(probe=stopping.is_set, period_s=0.01)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watch.start()
        yield

    app = FastAPI(lifespan=lifespan)
    app.include_router(realtime.api)
    config = SimpleNamespace(model_name=MODEL, limits=AppConfig().limits, speech=AppConfig().speech)
    app.state.ingress = SimpleNamespace(
        api_keys=APIKeys([]), config=config, prefill=PrefillClient(prefill), restart=watch, admission=admission
    )
    with TestClient(app) as client:
        yield client, stopping, watch


def closed_with(ws: Any, reason: str | None = None) -> int:
    with pytest.raises(WebSocketDisconnect) as closed:
        ws.receive_json()
    assert reason is None or closed.value.reason == reason
    return closed.value.code


def test_a_stopping_replica_closes_with_1012_and_keeps_the_session() -> None:
    prefill = FakePrefill()
    with serving(prefill) as (client, stopping, _), client.websocket_connect("/v1/realtime") as ws:
        assert ws.receive_json()["session"]["id"] == "sess-1"
        ws.send_json({"type": "input_text_buffer.append", "delta": "hello"})
        stopping.set()
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["code"] == "server_restarting"
        assert error["error"]["session_id"] == "sess-1" and "sess-1" in error["error"]["message"]
        assert closed_with(ws) == realtime.SERVICE_RESTART
    assert prefill.called("session_buffer")  # the append was applied before the close, not cut
    assert prefill.called("session_delete") == []  # the client reconnects to it


def test_a_response_streaming_ends_before_the_restart_close() -> None:
    prefill = FakePrefill()
    prefill.claim_delay = 0.3
    with serving(prefill) as (client, stopping, _), client.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        ws.send_json({"type": "response.create"})
        assert ws.receive_json()["type"] == "response.created"
        stopping.set()
        ws.send_json({"type": "input_text_buffer.append", "delta": "typed meanwhile"})  # still applied
        done, _ = until(ws, "response.done")
        assert done["response"]["status"] == "completed"
        assert ws.receive_json()["error"]["code"] == "server_restarting"
        assert closed_with(ws) == realtime.SERVICE_RESTART
    assert prefill.called("session_buffer")[0]["text"] == "typed meanwhile"


def test_reconnect_with_session_id_reattaches() -> None:
    prefill = FakePrefill()
    with serving(prefill) as (client, _, _), client.websocket_connect("/v1/realtime?session_id=sess-1") as ws:
        assert ws.receive_json()["session"]["id"] == "sess-1"
        ws.send_json({"type": "response.create"})
        done, _ = until(ws, "response.done")
        assert done["response"]["status"] == "completed"
    assert prefill.called("create_session") == []
    assert prefill.called("session_info")[0]["session_id"] == "sess-1"
    assert prefill.called("session_delete")  # this client left: now the session goes


def test_reattaching_to_a_missing_session_closes_4404() -> None:
    prefill = FakePrefill()
    prefill.fail["session_info"] = error_body(404, "session sess-9 not found", "session_id")
    with serving(prefill) as (client, _, _), client.websocket_connect("/v1/realtime?session_id=sess-9") as ws:
        assert ws.receive_json()["error"]["code"] == "session_not_found"
        assert closed_with(ws) == realtime.SESSION_NOT_FOUND
    assert prefill.called("session_delete") == []


def test_session_update_without_instructions_leaves_the_owners() -> None:
    prefill = FakePrefill()
    with serving(prefill) as (client, _, _), client.websocket_connect("/v1/realtime?session_id=sess-1") as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"temperature": 0.1}})
        assert ws.receive_json()["type"] == "session.updated"
    assert prefill.called("session_update")[0]["instructions"] is None


def test_connections_during_a_stop_are_turned_away() -> None:
    prefill = FakePrefill()
    with serving(prefill) as (client, _, watch):
        watch.stop()
        with client.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_json()["error"]["code"] == "server_restarting"
            assert closed_with(ws) == realtime.SERVICE_RESTART
    assert prefill.called("create_session") == []


def test_an_overloaded_server_refuses_new_sessions_with_1013() -> None:
    prefill = FakePrefill()
    with serving(prefill, Overloaded()) as (client, _, _), client.websocket_connect("/v1/realtime") as ws:
        error = ws.receive_json()["error"]
        assert error["code"] == "server_overloaded" and error["retry_after"] == 4
        assert closed_with(ws, "try again in 4 s") == realtime.TRY_AGAIN_LATER  # the wait in the close too
    assert prefill.called("create_session") == []
    # A re-attach is not a new session: admission does not apply to it.
    with serving(prefill, Overloaded()) as (client, _, _), client.websocket_connect("/v1/realtime?session_id=s") as ws:
        assert ws.receive_json()["type"] == "session.created"


def test_a_full_prefill_replica_also_closes_1013() -> None:
    class Full(FakePrefill):
        async def _answer(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
            if method == "create_session":
                body = error_body(429, "prefill capacity exhausted: 96 sessions open")
                body["error"]["retry_after"] = 1
                return body
            return await super()._answer(method, *args, **kwargs)

    with serving(Full()) as (client, _, _), client.websocket_connect("/v1/realtime") as ws:
        assert ws.receive_json()["error"]["code"] == "server_overloaded"
        assert closed_with(ws) == realtime.TRY_AGAIN_LATER


def test_the_probe_is_false_outside_a_replica() -> None:
    assert replica_shutting_down() is False
