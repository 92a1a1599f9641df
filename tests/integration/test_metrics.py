"""After a scripted session, each Prometheus metric moved as expected (read from Ray's metrics port)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from core import metrics
from tests.integration.conftest import METRICS_PORT
from tests.integration.test_streaming_input import SESSIONS, TEXT, create, send_chunk

pytestmark = pytest.mark.integration


def scrape() -> dict[str, float]:
    """Sum of every sample per metric name (histograms: their _count), over all labels."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^ray_(rtpd_[a-z_]+?)(_count)?(\{.*\})? ([0-9.eE+-]+)$", line)
        if m and not line.split("{")[0].endswith(("_bucket", "_sum")):
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(4))
    return totals


def wait_for(condition, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        seen = scrape()
        if condition(seen) or time.time() > deadline:
            return seen
        time.sleep(1)


def test_metrics_move_after_a_scripted_session(server, model_name):
    before = scrape()

    sid = create(server, messages=[], max_tokens=6, temperature=0)["session_id"]
    pieces = [TEXT[:150], TEXT[150:300], TEXT[300:]]
    for seq, piece in enumerate(pieces):
        assert send_chunk(server, sid, seq, piece, end=seq == 2).status_code == 202
    assert httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=120).json()["answer"]["status"] == "completed"
    open_now = wait_for(lambda m: m.get("rtpd_sessions_open", 0) >= 1)  # the session is open (state "open")
    assert open_now.get("rtpd_sessions_open", 0) >= 1
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)
    body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and list(r.iter_text())
    assert httpx.post(f"{server}/v1/chat/completions", json={"model": "nope", "messages": []}).status_code == 404

    def moved(m: dict[str, float], name: str, by: float = 1) -> bool:
        return m.get(name, 0) - before.get(name, 0) >= by

    expected = {
        metrics.SESSION_CHUNKS: 3,
        metrics.SESSION_INPUT_BYTES: len(TEXT.encode()),
        metrics.TTFT: 1,  # the chat request
        metrics.ITL: 7,  # decode steps of the chat request at least
        metrics.LAST_CHUNK_TO_FIRST_TOKEN: 1,
        metrics.KV_TRANSFERS: 2,  # the session's hand-off and the chat request
        metrics.KV_TRANSFER_BYTES: 1,
        metrics.KV_TRANSFER_SECONDS: 2,
        metrics.SCHEDULER_ADMISSIONS: 4,
        metrics.ERRORS: 1,  # the unknown model
    }
    after = wait_for(lambda m: all(moved(m, name, by) for name, by in expected.items()))
    for name, by in expected.items():
        assert moved(after, name, by), (name, before.get(name), after.get(name))
    assert after.get(metrics.KV_CACHE_USAGE) is not None  # a gauge per engine replica
    # Nothing was under KV pressure: no evictions.
    assert after.get(metrics.SCHEDULER_EVICTIONS, 0) == before.get(metrics.SCHEDULER_EVICTIONS, 0)
