"""Decode faults on the real stack: a decode replica killed mid-answer, and a KV transfer that fails.

The faults app (tests/integration/faults/conftest.py: two decode replicas, a short NIXL lease) runs beside the main
one. Long greedy answers of every kind (chat and completion streams, a REST session's events, a realtime response)
are started, their decode replica's process is SIGKILLed once they have tokens, and each must end with exactly the
text of the uninterrupted answer (README "Fault tolerance"). A KV hand-off whose prefill side cannot be reached is
recomputed by decode, counted, and its blocks on prefill are freed by the lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import websockets

from tests.integration.faults.conftest import LEASE_S, handle, prefill_stats, replicas
from tests.integration.test_streaming_input import SESSIONS, TEXT, Realtime

pytestmark = pytest.mark.integration

TOKENS = 1200  # long enough to be mid-answer when its replica is killed
PROMPT = TEXT[:300]  # (short: decode prefills chat and completions itself; sessions hand KV over)


def replica_stats(replica: str, request_id_prefix: str | None = None) -> dict[str, Any]:
    """One decode replica's engine figures (empty if the call reached another: that one is not running)."""
    stats = handle("decode").stats.remote(request_id_prefix, replica=replica).result(timeout_s=60)
    return stats if stats.get("replica") == replica else {}


# --- the clients: each runs in a thread, reads to the end, and says when it has some text ----------------------
class Reader(threading.Thread):
    def __init__(self, name: str, run: Callable[[Reader], None]) -> None:
        super().__init__(name=name, daemon=True)
        self.key = f"{name}-{uuid.uuid4().hex[:8]}"  # in the decode request's id: which replica has it
        self.text, self.frames, self.errors = "", 0, []  # type: ignore[var-annotated]
        self.started = threading.Event()
        self._run = run
        self.failure: BaseException | None = None

    def got(self, piece: str) -> None:
        self.text += piece
        self.frames += 1
        if self.frames >= 5:
            self.started.set()

    def run(self) -> None:
        try:
            self._run(self)
        except BaseException as e:
            self.failure = e
        finally:
            self.started.set()


def sse_lines(r: httpx.Response, reader: Reader, piece: Callable[[dict[str, Any]], str]) -> None:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
        if line.startswith("data: {"):
            data = json.loads(line[6:])
            if data.get("error"):  # (`session.done`'s summary has `"error": null`)
                reader.errors.append(data["error"])
            elif data.get("choices"):
                reader.got(piece(data["choices"][0]))


def chat_body(stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPT}]
    return {"messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}


def completion_body(stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}


def chat(base: str) -> Callable[[Reader], None]:
    def run(reader: Reader) -> None:
        headers = {"x-request-id": reader.key}
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=chat_body(True), headers=headers, timeout=300
        ) as r:
            sse_lines(r, reader, lambda c: c["delta"].get("content") or "")

    return run


def completion(base: str) -> Callable[[Reader], None]:
    def run(reader: Reader) -> None:
        headers = {"x-request-id": reader.key}
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=completion_body(True), headers=headers, timeout=300
        ) as r:
            sse_lines(r, reader, lambda c: c.get("text") or "")

    return run


def session(base: str) -> Callable[[Reader], None]:
    def run(reader: Reader) -> None:
        body = {"messages": [], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        created = httpx.post(f"{base}{SESSIONS}", json=body, timeout=60)
        assert created.status_code == 201, created.text
        sid = reader.key = created.json()["session_id"]
        chunk = {"sequence_id": 0, "payload": PROMPT, "end_of_input": True}
        assert httpx.post(f"{base}{SESSIONS}/{sid}/chunks", json=chunk, timeout=60).status_code == 202
        with httpx.stream("GET", f"{base}{SESSIONS}/{sid}/events", timeout=300) as r:
            sse_lines(r, reader, lambda c: c["delta"].get("content") or "")

    return run


def realtime(base: str, model: str) -> Callable[[Reader], None]:
    async def talk(reader: Reader) -> None:
        url = base.replace("http://", "ws://") + f"/v1/realtime?model={model}"
        async with websockets.connect(url, max_size=None) as ws:
            rt = Realtime(ws)
            created, _ = await rt.until("session.created")
            reader.key = created["session"]["id"]
            await rt.send(type="session.update", session={"instructions": "", "temperature": 0})
            await rt.until("session.updated")
            await rt.send(type="conversation.item.create", item=user_item())
            await rt.send(type="response.create", response={"max_output_tokens": TOKENS})
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 300))
                if event["type"] == "response.output_text.delta":
                    reader.got(event["delta"])
                elif event["type"] == "error":
                    reader.errors.append(event["error"])
                elif event["type"] == "response.done":
                    assert event["response"]["status"] in ("completed", "incomplete"), event
                    return

    return lambda reader: asyncio.run(talk(reader))


def user_item() -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}


def whole(base: str, path: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{base}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def metric(name: str) -> float:
    """A metric's total over every process and label (Ray's metrics port)."""
    from tests.integration.test_metrics import scrape

    return scrape().get(name, 0.0)


def wait_metric(name: str, at_least: float, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while metric(name) < at_least:
        if time.time() > deadline:
            return False
        time.sleep(1)
    return True


# --- a KV transfer that fails -----------------------------------------------------------------------------
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill_totals() -> dict[str, int]:
    """Both prefill replicas' figures, summed (the transfer's blocks are on whichever prefilled it)."""
    total = {"kv_blocks_free": 0, "kv_blocks_total": 0, "num_requests": 0}
    for replica in replicas("prefill"):
        stats = prefill_stats(replica)
        for key in total:
            total[key] += stats[key]
    return total


def test_a_kv_transfer_that_fails_is_recomputed_and_its_prefill_blocks_freed_at_the_lease(
    faults: str, model_name: str
) -> None:
    body = {"model": model_name, "prompt": TEXT, "max_tokens": 16, "temperature": 0}
    expected = whole(faults, "/v1/completions", body)
    failures = {rid: replica_stats(rid).get("kv_load_failed_requests", 0) for rid in replicas("decode")}

    prefilled = handle("prefill").prefill.remote("completion", body).result(timeout_s=120)
    params = dict(prefilled["kv_transfer_params"])
    assert params.get("remote_block_ids"), params
    held = prefill_totals()
    assert held["kv_blocks_free"] < held["kv_blocks_total"]  # the prefill's blocks wait for decode's read
    params.update(remote_port=closed_port(), remote_engine_id=f"gone-{uuid.uuid4().hex}")  # never reachable
    start = handle("decode").start.remote(
        consumer="test", stream_id=uuid.uuid4().hex, endpoint="completion", body={**body, "kv_transfer_params": params}
    )
    answer = start.result(timeout_s=180)
    assert answer["response"]["choices"][0]["text"] == expected  # recomputed: the same answer

    def failed_now() -> int:
        return sum(replica_stats(rid).get("kv_load_failed_requests", 0) - n for rid, n in failures.items())

    assert failed_now() >= 1
    # Nobody reads the prefill's blocks: they are freed when the NIXL lease ends.
    deadline = time.time() + LEASE_S + 30
    while (stats := prefill_totals())["kv_blocks_free"] != stats["kv_blocks_total"] or stats["num_requests"]:
        assert time.time() < deadline, f"prefill still holds the failed transfer's KV after the lease: {stats}"
        time.sleep(0.5)
    # The counter reaches Prometheus too (decode exports it every few seconds).
    assert wait_metric("rtpd_decode_kv_load_failures_total", 1), "no KV load failure exported"


# --- a decode replica killed mid-answer -------------------------------------------------------------------
def test_answers_go_on_when_their_decode_replica_is_killed(faults: str, model_name: str) -> None:
    before = metric("rtpd_decode_resumes_total")
    readers = [
        Reader("chat", chat(faults)),
        Reader("completion", completion(faults)),
        Reader("session", session(faults)),
        Reader("realtime", realtime(faults, model_name)),
    ]
    for reader in readers:
        reader.start()
    try:
        for reader in readers:
            assert reader.started.wait(120), f"{reader.name} produced no text"
            assert reader.failure is None, (reader.name, reader.failure)

        # Kill the replica that serves the most of them.
        pids = replicas("decode")
        where = {
            r.name: [rid for rid in pids if replica_stats(rid, r.key).get("prompt_tokens_computed")] for r in readers
        }
        victim = max(pids, key=lambda rid: sum(rid in found for found in where.values()))
        moved = [name for name, found in where.items() if victim in found]
        assert handle("decode").pid.remote(replica=victim).result(timeout_s=30)["pid"] == pids[victim]
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = {r.name: r.frames for r in readers}
        cut = [r.name for r in readers if r.name in moved and r.is_alive()]  # mid-answer on the killed replica

        for reader in readers:
            reader.join(300)
            assert not reader.is_alive(), f"{reader.name} never ended"
            assert reader.failure is None, (reader.name, reader.failure)
            assert reader.errors == [], (reader.name, reader.errors)

        # The uninterrupted answers, from the app as it is now (one decode replica until Serve replaces the other).
        expected = {
            "chat": whole(faults, "/v1/chat/completions", chat_body(False)),
            "completion": whole(faults, "/v1/completions", completion_body(False)),
        }
        expected["session"] = expected["chat"]
        messages = [{"role": "user", "content": PROMPT}]
        expected["realtime"] = whole(
            faults, "/v1/chat/completions", {"messages": messages, "max_tokens": TOKENS, "temperature": 0}
        )
        for reader in readers:
            assert reader.text == expected[reader.name], (reader.name, reader.name in moved, killed_at[reader.name])
        assert cut, f"no answer was mid-stream on the killed replica: {where}, {killed_at}"
        assert wait_metric("rtpd_decode_resumes_total", before + len(cut)), "the resumes were not counted"
        assert whole(faults, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}) is not None  # still serving

        # The REST session stays open, its conversation resident for a next turn, until its client deletes it; a
        # session left behind would hold KV into the next test (test_prefill_death checks that no engine holds any).
        sid = next(r.key for r in readers if r.name == "session")
        deadline = time.time() + 30  # (its conversation is prefilled again after the answer: idle once that is done)
        while (
            len(idle := [r for r in replicas("prefill") if sid in prefill_stats(r)["scheduler"]["idle_session_ids"]])
            != 1
        ):
            assert time.time() < deadline, f"session {sid} is not resident on its prefill replica"
            time.sleep(0.5)
        assert httpx.delete(f"{faults}{SESSIONS}/{sid}", timeout=60).status_code == 200
        deadline = time.time() + 30
        while sid in (stats := prefill_stats(idle[0]))["scheduler"]["idle_session_ids"]:
            assert time.time() < deadline, f"a deleted session's KV is still resident: {stats}"
            time.sleep(0.5)
    finally:  # a failure above must not leave the session's KV resident into the next test
        sid = next(r.key for r in readers if r.name == "session")
        if not sid.startswith("session-"):  # (its reader created it: the key is now its id)
            httpx.delete(f"{faults}{SESSIONS}/{sid}", timeout=60)
