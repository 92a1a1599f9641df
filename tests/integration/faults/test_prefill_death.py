"""A prefill replica's process is killed while its sessions are open and answers stream: no session is lost.

The faults app (tests/integration/faults/conftest.py) runs two prefill replicas beside the main app. Sessions are
spread over both; on the victim one is mid-input, one has its answer handed off but not read, and one has its answer
streaming to a client. The victim's process is SIGKILLed. Every session then completes with the answer the same
request gets whole (greedy, compared as text: the same tokens), the app serves new sessions, and no engine holds a
KV block.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest
import websockets

from core.placement import owner_of
from tests.integration.faults.conftest import handle, prefill_stats, replicas, wait_running
from tests.integration.test_streaming_input import TEXT, split_inside_words, whole_chat

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
LONG = {"max_tokens": 300, "ignore_eos": True}  # an answer still streaming when its prefill replica dies


def post_chunk(base: str, sid: str, seq: int, piece: str, end: bool = False) -> None:
    body = {"sequence_id": seq, "payload": piece, "end_of_input": end}
    r = httpx.post(f"{base}/{sid}/chunks", json=body, timeout=120)
    assert r.status_code == 202, r.text


class RealtimeClient(threading.Thread):
    """A Realtime conversation on `victim`: typed before the kill, answered after it."""

    def __init__(self, url: str, victim: str, before: list[str], after: list[str]) -> None:
        super().__init__()
        self.url, self.victim, self.before, self.after = url, victim, before, after
        self.typed, self.killed = threading.Event(), threading.Event()
        self.answer: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self.converse())
        except BaseException as e:
            self.error = e
            self.typed.set()

    async def converse(self) -> None:
        for _ in range(40):  # a connection whose session the victim holds
            ws = await websockets.connect(self.url)
            created = json.loads(await ws.recv())
            if owner_of(created["session"]["id"]) == self.victim:
                break
            await ws.close()
        else:
            raise AssertionError("no realtime session landed on the victim")
        async with ws:
            await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
            for piece in self.before:
                await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": piece}))
            await until(ws, "session.updated")
            self.typed.set()
            await asyncio.to_thread(self.killed.wait, 120)
            for piece in self.after:
                await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": piece}))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": MAX_TOKENS}}))
            seen = await until(ws, "response.done")
            self.answer = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
            errors = [e for e in seen if e["type"] == "error"]
            assert not errors, errors


async def until(ws: Any, kind: str) -> list[dict[str, Any]]:
    seen = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 180))
        seen.append(event)
        if event["type"] == kind:
            return seen


def test_a_killed_prefill_replica_loses_no_session(server: str, faults: str) -> None:
    base = f"{faults}/v1/streaming_input/sessions"
    pieces = split_inside_words(TEXT, 6)
    expected = whole_chat(server, [{"role": "user", "content": TEXT}], MAX_TOKENS)["choices"][0]["message"]["content"]
    body = {"messages": [], "max_tokens": MAX_TOKENS, "temperature": 0}
    by_owner: dict[str, list[str]] = {}
    for _ in range(40):
        sid = httpx.post(base, json=body, timeout=60).json()["session_id"]
        by_owner.setdefault(owner_of(sid), []).append(sid)
        if len(by_owner) == 2 and all(len(v) >= 2 for v in by_owner.values()):
            break
    assert len(by_owner) == 2, "new sessions spread over both prefill replicas"
    victim, survivor = sorted(by_owner)
    mid_input, ready = by_owner[victim][:2]
    others = by_owner[survivor][:1]
    for _ in range(40):
        streaming = httpx.post(base, json={**body, **LONG}, timeout=60).json()["session_id"]
        if owner_of(streaming) == victim:
            break
    assert owner_of(streaming) == victim
    long_expected = httpx.post(
        f"{server}/v1/chat/completions",
        json={**body, **LONG, "messages": [{"role": "user", "content": TEXT}]},
        timeout=300,
    ).json()["choices"][0]["message"]["content"]

    for sid in (mid_input, *others):
        for seq, piece in enumerate(pieces[:3]):
            post_chunk(base, sid, seq, piece)
    for sid in (ready, streaming):
        for seq, piece in enumerate(pieces):
            post_chunk(base, sid, seq, piece, end=seq == len(pieces) - 1)

    url = faults.replace("http://", "ws://") + "/v1/realtime"
    realtime = RealtimeClient(url, victim, pieces[:3], pieces[3:])
    realtime.start()
    assert realtime.typed.wait(120) and realtime.error is None, realtime.error

    # A client streams `streaming`'s answer from decode (through this router) across the kill.
    frames: list[str] = []
    first = threading.Event()

    def read_events() -> None:
        with httpx.stream("GET", f"{base}/{streaming}/events", timeout=120) as r:
            for line in r.iter_lines():
                frames.append(line)
                first.set()

    reader = threading.Thread(target=read_events)
    reader.start()
    assert first.wait(60)

    pid = handle("prefill").pid.remote(route_to=victim).result(timeout_s=30)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    realtime.killed.set()

    # Mid-input: the next chunks land on the adopter (the client sees a delay), the answer is the same.
    for sid in (mid_input, *others):
        for seq, piece in enumerate(pieces[3:], start=3):
            post_chunk(base, sid, seq, piece, end=seq == len(pieces) - 1)
    for sid in (mid_input, ready, *others):
        deadline = time.time() + 90
        while (info := httpx.get(f"{base}/{sid}", timeout=60).json()).get("answers", [{}])[-1].get("status") in (
            None,
            "preparing",
        ):
            assert time.time() < deadline, f"no answer was handed off after the kill: {info}"
            time.sleep(0.5)
        answer = httpx.get(f"{base}/{sid}/result", timeout=120).json()["answer"]
        assert answer["text"] == expected, (sid == ready, answer)
    recovered_in = time.monotonic() - killed_at

    realtime.join(180)
    assert realtime.error is None, realtime.error
    assert realtime.answer == expected

    reader.join(120)
    text = "".join(
        json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
        for f in frames
        if f.startswith("data: {") and '"choices":[{' in f
    )
    assert text == long_expected
    # Its router reported the end to the adopter: the session knows its answer, and goes on.
    info = httpx.get(f"{base}/{streaming}", timeout=60).json()
    assert info["turns"] == 1 and info["state"] in ("open", "prefilling"), info
    post_chunk(base, streaming, len(pieces), "And why?", end=True)
    follow_up = httpx.get(f"{base}/{streaming}/result", timeout=120).json()["answer"]
    assert follow_up["status"] == "completed"

    # The app serves new sessions afterwards.
    new = httpx.post(base, json=body, timeout=60).json()["session_id"]
    post_chunk(base, new, 0, TEXT, end=True)
    assert httpx.get(f"{base}/{new}/result", timeout=120).json()["answer"]["text"] == expected

    for sid in (mid_input, ready, streaming, new, *others):
        assert httpx.delete(f"{base}/{sid}", timeout=60).status_code == 200
    wait_running()  # Serve replaced the victim
    for replica in replicas("prefill"):
        deadline = time.time() + 60
        while (stats := prefill_stats(replica))["kv_blocks_free"] != stats["kv_blocks_total"] or stats["num_requests"]:
            assert time.time() < deadline, f"prefill replica {replica} still holds KV: {stats}"
            time.sleep(0.5)
    print(f"sessions recovered and answered {recovered_in:.1f} s after the kill")
