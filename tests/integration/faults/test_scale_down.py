"""Scale-down with open sessions: the drained prefill replica hands its sessions over, and they go on (the faults
app, tests/integration/faults/conftest.py, from two prefill replicas to one: the package's last test)."""

from __future__ import annotations

import httpx
import pytest

from core.placement import owner_of
from tests.integration.faults.conftest import deploy, handle, wait_running
from tests.integration.test_streaming_input import TEXT, split_inside_words, whole_chat

pytestmark = pytest.mark.integration


def test_scale_down_hands_open_sessions_over(server: str, faults: str) -> None:
    base = f"{faults}/v1/streaming_input/sessions"
    sessions: dict[str, str] = {}  # owner replica -> session id
    for _ in range(30):
        sid = httpx.post(base, json={"messages": [], "max_tokens": 8, "temperature": 0}, timeout=60).json()
        sessions.setdefault(owner_of(sid["session_id"]), sid["session_id"])
        if len(sessions) == 2:
            break
    assert len(sessions) == 2, "new sessions spread over both prefill replicas"
    pieces = split_inside_words(TEXT, 6)
    for sid in sessions.values():
        for seq, piece in enumerate(pieces[:3]):
            assert httpx.post(f"{base}/{sid}/chunks", json={"sequence_id": seq, "payload": piece}).status_code == 202

    deploy(prefill={"num_replicas": 1})  # Serve stops one replica; it drains and hands its sessions over
    wait_running()
    survivor = handle("prefill").stats.remote().result()["replica"]
    assert survivor in sessions

    expected = whole_chat(server, [{"role": "user", "content": TEXT}], 8)["choices"][0]["message"]["content"]
    for owner, sid in sessions.items():
        for seq, piece in enumerate(pieces[3:], start=3):
            body = {"sequence_id": seq, "payload": piece, "end_of_input": seq == len(pieces) - 1}
            r = httpx.post(f"{base}/{sid}/chunks", json=body, timeout=60)
            assert r.status_code == 202, (owner == survivor, r.text)
        answer = httpx.get(f"{base}/{sid}/result", timeout=120).json()["answer"]
        assert answer["text"] == expected, owner == survivor
        info = httpx.get(f"{base}/{sid}", timeout=60).json()
        assert info["next_sequence_id"] == len(pieces)  # the chunk log survived the hand-over
