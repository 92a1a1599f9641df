"""A router redeploy on the real stack: realtime clients get an `error` naming their session and close code 1012,
reconnect with `?session_id=`, and go on with the same conversation; a REST session made before it still works."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import websockets

from tests.integration.conftest import PORT
from tests.integration.faults.conftest import PREFIX, deploy, wait_running

pytestmark = pytest.mark.integration

CLIENTS = 3


def redeploy_router(cpus: float) -> None:
    """As `serve deploy` of a config whose router asks for other CPUs: a new version of the router alone, so Serve
    stops its replica (gracefully) and starts another, while prefill and decode keep theirs (and the sessions)."""
    deploy(router={"num_replicas": 1, "ray_actor_options": {"num_cpus": cpus}})


URL = f"ws://127.0.0.1:{PORT}{PREFIX}/v1/realtime"


async def turn(ws: Any, text: str) -> dict[str, Any]:
    """One user turn and its answer: the `response.done` event."""
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 8, "temperature": 0}}))
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        assert event["type"] != "error", event
        if event["type"] == "response.done":
            return event


async def until_restart(ws: Any) -> tuple[dict[str, Any], int]:
    """The `error` before the close, and the close code."""
    error: dict[str, Any] = {}
    try:
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "error":
                error = event["error"]
    except websockets.ConnectionClosed as e:
        return error, e.rcvd.code if e.rcvd else 1006


async def reconnect(session_id: str, timeout: float = 120) -> Any:
    """The session again, through whichever router replica is up (retried while none is)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ws = await websockets.connect(f"{URL}?session_id={session_id}", open_timeout=30)
            event = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if event["type"] == "session.created":
                return ws
            await ws.close()
            assert event["error"]["code"] == "server_restarting", event  # (an old replica still routed to)
        except (OSError, websockets.InvalidStatus, websockets.ConnectionClosed, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"could not reconnect to {session_id}")
        await asyncio.sleep(1)


def test_router_redeploy_closes_1012_and_sessions_go_on(faults: str) -> None:
    rest = f"http://127.0.0.1:{PORT}{PREFIX}/v1/streaming_input/sessions"
    made = httpx.post(rest, json={"messages": [], "max_tokens": 8, "temperature": 0}, timeout=60)
    assert made.status_code == 201, made.text
    rest_id = made.json()["session_id"]
    chunk = {"sequence_id": 0, "payload": "Before the restart, "}
    assert httpx.post(f"{rest}/{rest_id}/chunks", json=chunk, timeout=60).status_code == 202

    async def scenario() -> None:
        sockets = [await websockets.connect(URL, open_timeout=60) for _ in range(CLIENTS)]
        ids, first = [], {}
        for ws in sockets:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            ids.append(created["session"]["id"])
            first[ids[-1]] = (await turn(ws, "Hello there, first turn."))["response"]["usage"]
        watching = [asyncio.ensure_future(until_restart(ws)) for ws in sockets]
        await asyncio.to_thread(redeploy_router, 0.11)  # a new router version: the old replica stops
        for sid, (error, code) in zip(ids, await asyncio.gather(*watching), strict=True):
            assert code == 1012, (code, error)
            assert error.get("code") == "server_restarting" and error.get("session_id") == sid, error
        for sid in ids:
            ws = await reconnect(sid)
            try:
                done = await turn(ws, "And after the restart, a second turn.")
                assert done["response"]["status"] in ("completed", "incomplete")
                # The same conversation: its input holds the first turn and its answer.
                before = first[sid]["input_tokens"] + first[sid]["output_tokens"]
                assert done["response"]["usage"]["input_tokens"] > before
            finally:
                await ws.close()

    asyncio.run(scenario())
    wait_running()
    chunk = {"sequence_id": 1, "payload": "and after it.", "end_of_input": True}
    assert httpx.post(f"{rest}/{rest_id}/chunks", json=chunk, timeout=60).status_code == 202
    result = httpx.get(f"{rest}/{rest_id}/result", timeout=120)
    assert result.status_code == 200 and result.json()["answer"]["status"] == "completed", result.text
    assert httpx.delete(f"{rest}/{rest_id}", timeout=60).status_code == 200
