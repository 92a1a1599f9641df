"""Hardening on the real stack (issue #9): cancel, limits, refusals that leave nothing behind."""

from __future__ import annotations

import json
import threading

import httpx

from tests.integration.conftest import engine_stats, wait_idle
from tests.integration.test_streaming_input import SESSIONS, TEXT, create, info, send_chunk


def test_rest_cancel_stops_a_streamed_answer_on_decode_and_the_session_goes_on(server):
    wait_idle("decode")
    before = engine_stats("decode")["generation_tokens"]
    sid = create(server, messages=[], max_tokens=1500, ignore_eos=True, temperature=0)["session_id"]
    assert send_chunk(server, sid, 0, TEXT, end=True).status_code == 202
    frames: list[str] = []
    done: list[dict] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("GET", f"{server}{SESSIONS}/{sid}/events", timeout=120) as r:
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    frames.append(line[6:])
                    started.set()
                    if event == "session.done":
                        done.append(json.loads(line[6:]))

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    r = httpx.post(f"{server}{SESSIONS}/{sid}/cancel", timeout=60)  # another connection (any router)
    assert r.status_code == 202, r.text
    reader.join(60)
    assert not reader.is_alive() and "[DONE]" in frames
    assert done and done[0]["status"] == "cancelled"
    generated = engine_stats("decode")["generation_tokens"] - before
    assert 0 < generated < 1500  # stopped on decode, not run to its end
    wait_idle("decode")
    # The conversation keeps the partial answer, and goes on.
    assert info(server, sid)["answers"][0]["status"] == "cancelled"
    assert httpx.post(f"{server}{SESSIONS}/{sid}/cancel", timeout=60).status_code == 409  # nothing in progress
    assert send_chunk(server, sid, 1, "And then?").status_code == 202
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)
    wait_idle("prefill")


def test_bodies_over_the_limit_get_413_and_bad_ones_400_naming_the_field(server):
    big = {"messages": [{"role": "user", "content": "x" * (5 << 20)}], "max_tokens": 1}
    r = httpx.post(f"{server}/v1/chat/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server}{SESSIONS}", json={"messages": [], "limits": {"idle_timeout_s": 10**7}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limits.idle_timeout_s"
    r = httpx.post(f"{server}{SESSIONS}", json={"prompt": ["a", "b"]}, timeout=60)
    assert r.status_code == 400
    sid = create(server, messages=[])["session_id"]
    r = send_chunk(server, sid, 10**6, "far ahead")
    assert r.status_code == 400 and r.json()["error"]["param"] == "sequence_id"
    r = send_chunk(server, sid, 0, "y" * (300 << 10))  # over max_chunk_bytes: refused whole
    assert r.status_code == 413
    assert info(server, sid)["next_sequence_id"] == 0 and send_chunk(server, sid, 0, "fine").status_code == 202
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)


def test_ndjson_whose_answer_cannot_be_made_gets_an_error_not_an_empty_200(server):
    lines = [
        {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 10**6},
        {"payload": " there", "end_of_input": True},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
    r = httpx.post(f"{server}/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    wait_idle("prefill")


def test_a_client_leaving_ends_only_its_own_stream(server, model_name):
    """The decode feed carries every stream between this router and its decode replica. It used to be a child
    of whichever client's request opened it, so Ray's recursive cancellation of that request (its client left)
    cut every other client's answer short: the storm's "decode stream ended before its first frame"."""
    import time

    time.sleep(7)  # every feed idles out (decode/server.py FEED_IDLE_S): the next request opens a new one
    body = {"model": model_name, "prompt": "Once upon a time", "stream": True, "ignore_eos": True}
    long = {**body, "max_tokens": 1500}
    other = {**body, "max_tokens": 150, "stream_options": {"include_usage": True}}
    leaving, staying = httpx.Client(base_url=server, timeout=120), httpx.Client(base_url=server, timeout=120)
    with leaving.stream("POST", "/v1/completions", json=long) as first:  # it opens the feed
        assert next(line for line in first.iter_lines() if line.startswith("data: {"))
        with staying.stream("POST", "/v1/completions", json=other) as second:
            frames = second.iter_lines()
            assert next(line for line in frames if line.startswith("data: {"))
            first.close()  # the first client leaves: its request is cancelled
            leaving.close()
            rest = [line for line in frames if line.startswith("data: ")]
    staying.close()
    assert rest and rest[-1] == "data: [DONE]", rest[-3:]
    usage = [json.loads(line[6:])["usage"] for line in rest[:-1] if json.loads(line[6:]).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 150, (usage, rest[-3:])
    wait_idle("decode")
