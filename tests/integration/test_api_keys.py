"""API keys end to end on the real stack: key checks on HTTP and the realtime WebSocket, sessions bound to the
key that made them, the per-key session cap, per-key tokens per minute (streamed answers included), no key
echoed back or logged.

No more engines are started: this module deploys a second Serve application, "keyed" at `/keyed`, holding only
a `Router` with API keys, bound to the handles of the running app's prefill and decode deployments (Serve 2.60
pickles a `DeploymentHandle` bound as an init argument as is, app name included). Its routes are the app's own
under the prefix: `/keyed/v1/...`, `/keyed/health`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from ray import serve

from core.config import AppConfig
from tests.integration.conftest import APP, app_args

pytestmark = pytest.mark.integration

KEYED_APP = "keyed"
PREFIX = "/keyed"
KEY_A, KEY_B = "key-a", "key-b"
TPM = 200  # limits.tokens_per_minute_per_key of the keyed router
SESSIONS = "/v1/streaming_input/sessions"
TIMEOUT = 120
# The per-key session cap is enforced by the prefill replica with its own config (prefill/session_api.py
# `create_session` reads `self.config.limits.max_sessions_per_key`), and the keyed router shares the running
# app's prefill deployment: the cap in force is that app's. The keyed config carries the same value, as one
# application's router and prefill always do.
SESSION_CAP = AppConfig.model_validate(app_args()).limits.max_sessions_per_key or 64
# Tokens each key was charged by earlier tests of this module (read off the usage of their answers): the budget
# tests bound when a key's 429 may come with them.
SPENT = {KEY_A: 0, KEY_B: 0}
LEAK = f"sk-rtpd-leakcheck-{uuid.uuid4().hex}"  # a wrong key no response or log may contain


def keyed_config() -> dict[str, Any]:
    args = copy.deepcopy(app_args())
    args.setdefault("router", {})["api_keys"] = [KEY_A, KEY_B]
    args.setdefault("limits", {}).update(max_sessions_per_key=SESSION_CAP, tokens_per_minute_per_key=TPM)
    return args


@pytest.fixture(scope="module")
def keyed(server: str) -> Iterator[str]:
    """The base URL of the keyed router (`http://.../keyed`); the app is deleted at the module's end."""
    from router.app import Router

    config = AppConfig.model_validate(keyed_config())
    # As serve_app/builder.py passes it: replicas get the config without deployment options.
    payload = config.model_dump(mode="json", exclude={role: {"deployment"} for role in ("router", "prefill", "decode")})
    prefill = serve.get_deployment_handle("prefill", app_name=APP)
    decode = serve.get_deployment_handle("decode", app_name=APP)
    serve.run(
        Router.options(**config.router.deployment).bind(prefill, decode, payload),
        name=KEYED_APP,
        route_prefix=PREFIX,
    )
    base = f"{server}{PREFIX}"
    try:
        deadline = time.time() + TIMEOUT
        while httpx.get(f"{base}/v1/models", headers=auth(KEY_A), timeout=10).status_code != 200:
            assert time.time() < deadline, "the keyed router never answered /v1/models"
            time.sleep(1)
        yield base
    finally:
        serve.delete(KEYED_APP)


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """An OpenAI error JSON with this status."""
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_401(r: httpx.Response) -> None:
    assert_error(r, 401)
    assert r.headers.get("www-authenticate", "").lower() == "bearer", dict(r.headers)


def retry_after(r: httpx.Response) -> int:
    value = r.headers.get("retry-after")
    assert value is not None and value.isdigit(), dict(r.headers)
    return int(value)


def create_session(base: str, key: str, **body: Any) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": "Answer briefly."}], "max_tokens": 2, **body}
    return httpx.post(f"{base}{SESSIONS}", json=body, headers=auth(key), timeout=TIMEOUT)


def delete_session(base: str, key: str, sid: str) -> None:
    httpx.delete(f"{base}{SESSIONS}/{sid}", headers=auth(key), timeout=TIMEOUT)


# --- 1. HTTP: a key is wanted everywhere but /health ----------------------------------------------------------


def test_http_wants_a_valid_key(keyed: str) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    bad = [{}, auth("key-c"), {"Authorization": "Bearer"}, {"Authorization": KEY_A}]
    bad.append({"Authorization": f"Basic {KEY_A}"})
    for headers in bad:
        assert_401(httpx.post(f"{keyed}/v1/chat/completions", json=chat, headers=headers, timeout=TIMEOUT))
        assert_401(httpx.get(f"{keyed}/v1/models", headers=headers, timeout=TIMEOUT))
        assert_401(httpx.post(f"{keyed}{SESSIONS}", json={"messages": []}, headers=headers, timeout=TIMEOUT))
    assert_401(httpx.get(f"{keyed}/openapi.json", timeout=TIMEOUT))

    r = httpx.post(f"{keyed}/v1/chat/completions", json=chat, headers=auth(KEY_B), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["content"] is not None
    SPENT[KEY_B] += r.json()["usage"]["total_tokens"]
    r = httpx.get(f"{keyed}/v1/models", headers={"Authorization": f"bearer {KEY_A}"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["object"] == "list", r.text


def test_health_wants_no_key(keyed: str) -> None:
    r = httpx.get(f"{keyed}/health", timeout=TIMEOUT)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.json() == {"status": "ok"}
    assert httpx.get(f"{keyed}/health", headers=auth("key-c"), timeout=TIMEOUT).status_code == 200


# --- 2. the realtime WebSocket ----------------------------------------------------------------------------------


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/realtime"


async def refused(url: str, **kwargs: Any) -> str:
    """The handshake is refused (HTTP 403, or a close with 1008 before any event); what the client got back."""
    try:
        async with websockets.connect(url, open_timeout=60, close_timeout=2, **kwargs) as ws:
            event = await asyncio.wait_for(ws.recv(), 30)
    except websockets.InvalidStatus as e:
        assert e.response.status_code == 403, e.response.status_code
        return (e.response.body or b"").decode(errors="replace") + str(e.response.headers)
    except websockets.ConnectionClosed as e:
        assert e.rcvd is not None and e.rcvd.code == 1008, e
        return e.rcvd.reason
    raise AssertionError(f"handshake accepted without a valid key: {event}")


async def realtime_session(url: str, **kwargs: Any) -> tuple[str, str | None]:
    """Connect, get `session.created`, add an item; the session id and the subprotocol the server chose."""
    async with websockets.connect(url, open_timeout=60, close_timeout=2, **kwargs) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), 60))
        assert created["type"] == "session.created", created
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] != "conversation.item.created":
            assert event["type"] != "error", event
        return created["session"]["id"], ws.subprotocol


def session_status(base: str, key: str | None, sid: str) -> int:
    return httpx.get(f"{base}{SESSIONS}/{sid}", headers=auth(key), timeout=TIMEOUT).status_code


def wait_gone(base: str, key: str, sid: str) -> None:
    """A realtime session is deleted once its socket closes."""
    deadline = time.time() + 30
    while session_status(base, key, sid) != 404:
        assert time.time() < deadline, f"realtime session {sid} still there 30 s after its socket closed"
        time.sleep(0.25)


def test_realtime_wants_a_valid_key(keyed: str) -> None:
    url = ws_url(keyed)

    async def run() -> None:
        await refused(url)
        await refused(url, additional_headers=auth("key-c"))
        await refused(url, subprotocols=["realtime", "openai-insecure-api-key.key-c"])
        await refused(url, subprotocols=["realtime"])

        # The key in the Authorization header (a server-side client).
        sid, _ = await realtime_session(url, additional_headers=auth(KEY_B))
        assert session_status(keyed, KEY_A, sid) == 404  # the session was key-b's
        wait_gone(keyed, KEY_B, sid)

        # The browser form: the key as a subprotocol beside `realtime`, which the server selects.
        offered = ["realtime", f"openai-insecure-api-key.{KEY_A}"]
        sid, chosen = await realtime_session(url, subprotocols=offered)
        assert chosen == "realtime"
        wait_gone(keyed, KEY_A, sid)

    asyncio.run(run())


def test_realtime_session_belongs_to_its_key(keyed: str) -> None:
    """While the socket is open, its session answers key-a's REST calls and nobody else's."""
    url = ws_url(keyed)

    async def run() -> None:
        async with websockets.connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY_A}"]) as ws:
            created = json.loads(await asyncio.wait_for(ws.recv(), 60))
            sid = created["session"]["id"]
            assert session_status(keyed, KEY_A, sid) == 200
            assert session_status(keyed, KEY_B, sid) == 404
            assert session_status(keyed, None, sid) == 401
        wait_gone(keyed, KEY_A, sid)

    asyncio.run(run())


# --- 3. a session belongs to the key that made it ------------------------------------------------------------


def test_session_is_invisible_to_other_keys(keyed: str) -> None:
    r = create_session(keyed, KEY_A, temperature=0)
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    url = f"{keyed}{SESSIONS}/{sid}"
    try:
        chunk = {"sequence_id": 0, "modality": "text", "payload": "Name a colour."}
        r = httpx.post(f"{url}/chunks", json=chunk, headers=auth(KEY_A), timeout=TIMEOUT)
        assert r.status_code == 202, r.text
        before = httpx.get(url, headers=auth(KEY_A), timeout=TIMEOUT).json()
        assert before["next_sequence_id"] == 1 and before["state"] != "closed", before

        def intrude(key: str | None, status: int) -> None:
            other = {"sequence_id": 1, "modality": "text", "payload": " Intruder text.", "end_of_input": True}
            calls = [
                httpx.post(f"{url}/chunks", json=other, headers=auth(key), timeout=TIMEOUT),
                httpx.get(f"{url}/events", headers=auth(key), timeout=TIMEOUT),
                httpx.get(f"{url}/result", headers=auth(key), timeout=TIMEOUT),
                httpx.get(f"{url}/result?wait=false", headers=auth(key), timeout=TIMEOUT),
                httpx.get(url, headers=auth(key), timeout=TIMEOUT),
                httpx.post(f"{url}/cancel", headers=auth(key), timeout=TIMEOUT),
                httpx.post(f"{url}/finish", headers=auth(key), timeout=TIMEOUT),
                httpx.delete(url, headers=auth(key), timeout=TIMEOUT),
            ]
            for r in calls:
                error = assert_error(r, status)
                if status == 404:
                    assert error["message"].endswith("not found"), error

        intrude(KEY_B, 404)
        intrude(None, 401)
        intrude("key-c", 401)

        after = httpx.get(url, headers=auth(KEY_A), timeout=TIMEOUT).json()
        for field in ("state", "next_sequence_id", "payload_bytes", "input_ended", "turns", "pending"):
            assert after[field] == before[field], (field, before, after)

        # key-a ends its input; the answer waits unclaimed, and the intruder can neither take nor cancel it.
        end = {"sequence_id": 1, "modality": "text", "payload": " One word.", "end_of_input": True}
        r = httpx.post(f"{url}/chunks", json=end, headers=auth(KEY_A), timeout=TIMEOUT)
        assert r.status_code == 202 and r.json()["started"], r.text
        intrude(KEY_B, 404)
        r = httpx.get(f"{url}/result", headers=auth(KEY_A), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        result = r.json()
        SPENT[KEY_A] += result["usage"]["total_tokens"]
        assert result["answer"]["status"] == "completed" and result["turn"] == 0, result
        assert result["usage"]["completion_tokens"] >= 1
        assert httpx.get(url, headers=auth(KEY_A), timeout=TIMEOUT).json()["turns"] == 1
    finally:
        delete_session(keyed, KEY_A, sid)
    assert session_status(keyed, KEY_A, sid) == 404


# --- 4. open sessions per key --------------------------------------------------------------------------------


def test_open_sessions_capped_per_key(keyed: str) -> None:
    made: dict[str, list[str]] = {KEY_A: [], KEY_B: []}

    def make(key: str) -> str:
        r = create_session(keyed, key, start_policy="on_end_only")
        assert r.status_code == 201, (key, len(made[key]), r.text)
        made[key].append(r.json()["session_id"])
        return made[key][-1]

    def capped() -> None:
        r = create_session(keyed, KEY_A, start_policy="on_end_only")
        if r.status_code == 201:
            made[KEY_A].append(r.json()["session_id"])
        error = assert_error(r, 429)
        assert "API key" in error["message"], error  # the key's cap, not the replica's
        assert retry_after(r) >= 0

    try:
        for _ in range(SESSION_CAP):
            make(KEY_A)
        capped()
        make(KEY_B)  # another key is not held back by key-a's sessions
        gone = made[KEY_A].pop(0)
        r = httpx.delete(f"{keyed}{SESSIONS}/{gone}", headers=auth(KEY_A), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        make(KEY_A)  # a slot is free again
        capped()
    finally:
        for key, sids in made.items():
            for sid in sids:
                delete_session(keyed, key, sid)
    for key, sids in made.items():
        assert all(session_status(keyed, key, sid) == 404 for sid in sids)


# --- 6. no key is echoed or logged ---------------------------------------------------------------------------


def test_no_key_is_echoed_or_logged(keyed: str) -> None:
    sent = [
        httpx.get(f"{keyed}/v1/models", headers=auth(LEAK), timeout=TIMEOUT),
        httpx.post(f"{keyed}/v1/chat/completions", json={"messages": []}, headers=auth(LEAK), timeout=TIMEOUT),
        httpx.get(f"{keyed}/v1/models", headers={"Authorization": LEAK}, timeout=TIMEOUT),
    ]
    for r in sent:
        assert_401(r)
        assert LEAK not in r.text and LEAK not in str(r.headers)
        assert LEAK[-16:] not in r.text  # not even a part of it

    async def handshakes() -> list[str]:
        url = ws_url(keyed)
        return [
            await refused(url, additional_headers=auth(LEAK)),
            await refused(url, subprotocols=["realtime", f"openai-insecure-api-key.{LEAK}"]),
        ]

    for answer in asyncio.run(handshakes()):
        assert LEAK not in answer

    # Neither the wrong key nor the valid ones are in any Ray or Serve log of this cluster.
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    time.sleep(1.0)  # log lines are flushed asynchronously
    needles = [LEAK.encode(), f"Bearer {KEY_A}".encode(), f"openai-insecure-api-key.{KEY_A}".encode()]
    scanned = []
    for path in logs.rglob("*"):
        if path.is_file() and path.stat().st_size < 256 << 20:
            data = path.read_bytes()
            for needle in needles:
                assert needle not in data, f"{needle!r} logged in {path}"
            scanned.append(path.name)
    assert any(name.startswith(f"replica_{KEYED_APP}_") for name in scanned), scanned  # its router's log was read


# --- 5. tokens per minute per key (last: it spends both keys' budgets) ---------------------------------------


def test_tokens_per_minute_per_key(keyed: str) -> None:
    body = {"prompt": "Count slowly:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    rate = TPM / 60.0
    spent, usages, started = 0, [], time.monotonic()
    for _ in range(4 * TPM // 40 + 2):
        r = httpx.post(f"{keyed}/v1/completions", json=body, headers=auth(KEY_A), timeout=TIMEOUT)
        if r.status_code == 429:
            break
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"]["total_tokens"])
        spent += usages[-1]
    else:
        raise AssertionError(f"key-a spent {spent} tokens of a {TPM}/min budget and was never refused")
    elapsed = time.monotonic() - started
    error = assert_error(r, 429)
    assert "tokens per minute" in error["message"], error
    wait = retry_after(r)
    # Refused once it had spent its minute (less what earlier tests charged it), and not later than the request
    # after the one that did (the bucket refills meanwhile).
    assert spent >= TPM - SPENT[KEY_A], (spent, usages, SPENT)
    assert spent - usages[-1] < TPM + rate * (elapsed + 1), (spent, usages, elapsed)
    # The bucket is now between TPM - SPENT - spent (nothing refilled) and TPM + refill - spent (it was full).
    deepest, shallowest = spent + SPENT[KEY_A] - TPM, spent - TPM - rate * (elapsed + 1)
    assert 1 <= wait <= 60 and shallowest / rate - 1 <= wait <= math.ceil(deepest / rate) + 1, (wait, spent, SPENT)

    # Every POST of key-a is refused (sessions too); its GETs are not, and key-b is served.
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    r = httpx.post(f"{keyed}/v1/chat/completions", json=chat, headers=auth(KEY_A), timeout=TIMEOUT)
    assert_error(r, 429)
    assert retry_after(r) >= 1
    assert_error(create_session(keyed, KEY_A), 429)
    r = httpx.get(f"{keyed}/v1/models", headers=auth(KEY_A), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{keyed}/v1/chat/completions", json=chat, headers=auth(KEY_B), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    SPENT[KEY_B] += r.json()["usage"]["total_tokens"]

    # After Retry-After, key-a is served again.
    r = httpx.post(f"{keyed}/v1/completions", json=body, headers=auth(KEY_A), timeout=TIMEOUT)
    assert_error(r, 429)
    time.sleep(retry_after(r) + 0.5)
    r = httpx.post(f"{keyed}/v1/completions", json={**body, "max_tokens": 1}, headers=auth(KEY_A), timeout=TIMEOUT)
    assert r.status_code == 200, (r.status_code, r.text)


def read_sse(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.read()
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_streamed_answers_are_charged(keyed: str) -> None:
    """A streamed answer is charged its usage whether or not the client asked to see it; the usage frame the
    router adds to read it is not shown to a client that did not ask for it."""
    url = f"{keyed}/v1/chat/completions"
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    # Asked for: exactly one usage frame, last before [DONE]. Its usage is every later request's.
    asked = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=asked, headers=auth(KEY_B), timeout=TIMEOUT) as r:
        data = read_sse(r)
    assert data[-1] == "[DONE]", data
    frames = [json.loads(d) for d in data[:-1]]
    usage_frames = [f for f in frames if f.get("usage") and not f.get("choices")]
    assert len(usage_frames) == 1 and frames[-1] is usage_frames[0], frames
    usage = usage_frames[0]["usage"]
    assert usage["completion_tokens"] == 30, usage
    each = usage["total_tokens"]
    charged = each

    # Not asked for: no usage anywhere, yet charged, until key-b is refused.
    admitted = 0
    for _ in range(4 * TPM // each + 2):
        with httpx.stream("POST", url, json=body, headers=auth(KEY_B), timeout=TIMEOUT) as r:
            if r.status_code == 429:
                r.read()
                break
            data = read_sse(r)
        assert data[-1] == "[DONE]", data
        frames = [json.loads(d) for d in data[:-1]]
        assert frames and all(f.get("choices") for f in frames), frames  # no usage frame
        assert not any(f.get("usage") for f in frames), frames
        assert sum(1 for f in frames if f["choices"][0]["delta"].get("content") is not None) >= 1
        admitted += 1
        charged += each
    else:
        raise AssertionError(f"key-b streamed {charged} tokens of a {TPM}/min budget and was never refused")
    elapsed = time.monotonic() - started
    error = assert_error(r, 429)
    assert "tokens per minute" in error["message"] and retry_after(r) >= 1, error
    assert admitted >= 1, "no stream without stream_options was admitted"
    assert charged >= TPM - SPENT[KEY_B], (charged, each, SPENT)
    assert charged - each < TPM + TPM / 60.0 * (elapsed + 1), (charged, each, elapsed)
