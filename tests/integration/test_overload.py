"""Overload on the real stack: past the prefill replica's session capacity, a new realtime session waits in the
router's queue while a session ending can be expected, and is admitted when one ends; otherwise it gets
`server_overloaded` and close 1013 (new REST and NDJSON sessions 429 with Retry-After), while admitted sessions go
on answering; and a short realtime load run under capacity has no errors (bench/load_realtime.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.integration.conftest import TEST_MAX_WAIT_S
from tests.integration.faults.test_router_restart import turn

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench"
MAX_OPEN = 200  # more than any replica's session capacity here (96 on the CPU config)


def ws_url(server: str) -> str:
    return server.replace("http://", "ws://") + "/v1/realtime"


async def open_until_refused(url: str) -> tuple[list[Any], dict[str, Any], int]:
    """Sessions until one is refused: the admitted sockets, the refusal's error, its close code."""
    admitted: list[Any] = []
    while len(admitted) < MAX_OPEN:
        ws = await websockets.connect(url, open_timeout=60)
        event = json.loads(await ws.recv())
        if event["type"] == "session.created":
            admitted.append(ws)
            continue
        try:
            await ws.recv()
        except websockets.ConnectionClosed as e:
            return admitted, event["error"], e.rcvd.code if e.rcvd else 1006
    raise AssertionError(f"{MAX_OPEN} sessions open and none refused")


def test_past_capacity_new_sessions_are_refused_and_admitted_ones_go_on(server: str) -> None:
    async def scenario() -> None:
        admitted, error, code = await open_until_refused(ws_url(server))
        try:
            assert code == 1013 and error["code"] == "server_overloaded", (code, error)
            assert error.get("retry_after", 0) >= 1
            await asyncio.sleep(2.5)  # the replica's routing stats now count every open session
            started = time.monotonic()
            ws = await websockets.connect(ws_url(server), open_timeout=60)
            event = json.loads(await ws.recv())
            assert event["type"] == "error" and event["error"]["code"] == "server_overloaded"
            # At once when no session ended here lately (no wait can be promised), else after the longest wait.
            assert time.monotonic() - started < TEST_MAX_WAIT_S + 2.0, event
            await ws.close()
            # One session ends: its room goes to a newcomer; full again, the next newcomer waits in the router's
            # queue (a session ended lately: a wait can be promised) and is admitted when another one ends.
            await admitted.pop(0).close()
            filler = await websockets.connect(ws_url(server), open_timeout=60)
            event = json.loads(await filler.recv())
            assert event["type"] == "session.created", event
            admitted.append(filler)
            await asyncio.sleep(2.5)  # (the stats count it)

            async def first_event() -> tuple[Any, dict[str, Any]]:
                ws = await websockets.connect(ws_url(server), open_timeout=60)
                return ws, json.loads(await ws.recv())

            waiting = asyncio.ensure_future(first_event())
            await asyncio.sleep(1.0)
            assert not waiting.done()  # (waiting: its handshake done, no `session.created` yet)
            await admitted.pop(0).close()
            ws, event = await asyncio.wait_for(waiting, TEST_MAX_WAIT_S + 5.0)
            assert event["type"] == "session.created", event
            admitted.append(ws)
            async with httpx.AsyncClient(timeout=60) as http:
                made = await http.post(f"{server}/v1/streaming_input/sessions", json={"messages": []})
                assert made.status_code == 429 and int(made.headers["retry-after"]) >= 1, made.text
                assert made.json()["error"]["type"] == "RateLimitError"
                line = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) + "\n"
                headers = {"X-Streaming-Input": "true", "content-type": "application/x-ndjson"}
                body = await http.post(f"{server}/v1/chat/completions", content=line, headers=headers)
                assert body.status_code == 429, body.text
            # Already admitted sessions keep working.
            for ws in (admitted[0], admitted[-1]):
                done = await turn(ws, "Still here?")
                assert done["response"]["status"] in ("completed", "incomplete")
        finally:
            await asyncio.gather(*(ws.close() for ws in admitted))
        await asyncio.sleep(2.5)  # the sessions are deleted, and the stats say so
        async with httpx.AsyncClient(timeout=60) as http:
            made = await http.post(f"{server}/v1/streaming_input/sessions", json={"messages": []})
            assert made.status_code == 201, made.text
            await http.delete(f"{server}/v1/streaming_input/sessions/{made.json()['session_id']}")

    asyncio.run(scenario())


def test_a_short_load_run_under_capacity_has_no_errors(server: str) -> None:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import load_realtime

    args = argparse.Namespace(
        turns=2, chunks=4, chunk_gap_s=0.2, think_s=0.5, max_tokens=8, ramp_s=5.0, answer_timeout_s=60.0,
        seed=0, start=None, app="realtime-pd",
    )  # fmt: skip
    report = asyncio.run(load_realtime.run(ws_url(server), [("under", 40, 30.0)], args))
    (phase,) = report["phases"]
    assert phase["errors"] == {}, phase
    assert phase["sessions"] >= 40 and phase["turns"] >= 40
    assert phase["first_delta_ms"]["p99"] is not None
