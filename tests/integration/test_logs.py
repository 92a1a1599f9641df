"""No prompt and no key in the logs by default: after a chat completion (plain and streamed), a completion, a REST
streaming-input session, a realtime exchange and a few refused requests, all carrying a unique marker in their
text and a unique bearer key, no file under the Ray session's logs directory (Serve's access and replica logs,
every worker's stdout/stderr, hence vLLM's own request logging and the engine processes' output) contains
either marker."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
import websockets

from tests.integration.test_streaming_input import SESSIONS, Realtime, read_events, ws_url

pytestmark = pytest.mark.integration

PROMPT = f"zebra{uuid.uuid4().hex[:16]}quokka"  # one word no log has a reason to hold
KEY = f"sk-rtpd-logcheck-{uuid.uuid4().hex}"
HEADERS = {"Authorization": f"Bearer {KEY}"}  # the fixture's app wants no key: sent anyway, it must not be logged
TEXT = f"Please remember the code word {PROMPT} and tell me a short story about it. "
REQUEST_ID = f"logcheck-{uuid.uuid4().hex}"  # not secret: Serve's access log has it, which shows the scan reads it
TIMEOUT = 120


def logs_dir() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def grep_logs(needles: list[str]) -> tuple[dict[str, list[str]], int]:
    """For each needle, the log files that hold it; and how many files were read."""
    found: dict[str, list[str]] = {n: [] for n in needles}
    read = 0
    for path in logs_dir().rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        read += 1
        for needle in needles:
            if needle.encode() in data:
                found[needle].append(str(path.relative_to(logs_dir())))
    return found, read


def chat_requests(server: str, model: str) -> None:
    messages = [{"role": "system", "content": f"System note {PROMPT}."}, {"role": "user", "content": TEXT}]
    r = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={**HEADERS, "X-Request-Id": REQUEST_ID},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    body = {"model": model, "messages": messages, "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=HEADERS, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert "[DONE]" in r.read().decode()
    # A long prompt: past the router's disaggregation threshold, so prefill, the KV hand-off and decode all see it.
    body = {"model": model, "prompt": TEXT * 20, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def refused_requests(server: str, model: str) -> None:
    """Requests the server refuses: error paths must not log what they were sent either."""
    bad = [
        {"model": model, "messages": [{"role": "user", "content": TEXT}], "temperature": "hot"},
        {"model": model, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 10**9},
        {"model": model, "messages": [{"role": "user", "content": TEXT * 200}], "max_tokens": 4},  # too long
        {"model": f"no-such-model-{PROMPT}", "messages": [{"role": "user", "content": TEXT}]},
    ]
    for body in bad:
        r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=HEADERS, timeout=TIMEOUT)
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


def rest_session(server: str) -> None:
    r = httpx.post(
        f"{server}{SESSIONS}",
        json={"messages": [{"role": "system", "content": f"Context {PROMPT}."}], "max_tokens": 8, "temperature": 0},
        headers=HEADERS,
        timeout=TIMEOUT,
    )
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    pieces = [TEXT[:20], TEXT[20:], f" Once more: {PROMPT}."]
    for seq, piece in enumerate(pieces):
        body = {"sequence_id": seq, "modality": "text", "payload": piece, "end_of_input": seq == len(pieces) - 1}
        r = httpx.post(f"{server}{SESSIONS}/{sid}/chunks", json=body, headers=HEADERS, timeout=TIMEOUT)
        assert r.status_code == 202, r.text
    read_events(server, sid)
    httpx.delete(f"{server}{SESSIONS}/{sid}", headers=HEADERS, timeout=TIMEOUT)


def realtime(server: str, model: str) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(server) + f"?model={model}", additional_headers=HEADERS) as ws:
            rt = Realtime(ws)
            await rt.until("session.created")
            await rt.send(type="session.update", session={"instructions": f"Mind {PROMPT}.", "temperature": 0})
            await rt.until("session.updated")
            for piece in (TEXT[:30], TEXT[30:]):
                await rt.send(type="input_text_buffer.append", delta=piece)
            await rt.send(type="input_text_buffer.commit")
            await rt.until("conversation.item.created")
            await rt.send(type="response.create", response={"max_output_tokens": 6})
            await rt.until("response.done")
            await rt.send(type="no.such.event", delta=PROMPT)  # an error answered in-band
            error, _ = await rt.until("error")
            assert PROMPT not in json.dumps(error)

    asyncio.run(run())


def test_no_prompt_or_key_in_logs(server: str, model_name: str) -> None:
    chat_requests(server, model_name)
    refused_requests(server, model_name)
    rest_session(server)
    realtime(server, model_name)

    time.sleep(2.0)  # log lines reach their files asynchronously (the log monitor, buffered handlers)
    found, read = grep_logs([PROMPT, KEY, REQUEST_ID])
    assert found[PROMPT] == [], f"the prompt is logged in {found[PROMPT]}"
    assert found[KEY] == [], f"the key is logged in {found[KEY]}"
    # The scan reads the logs these requests went through: the router's access log line has the request id.
    assert found[REQUEST_ID], f"request id {REQUEST_ID} in none of the {read} log files read"
