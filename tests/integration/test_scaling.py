"""Scale-down with open sessions: the drained prefill replica hands its sessions over, and they go on."""

from __future__ import annotations

import copy
import time

import httpx
import pytest
from ray import serve

from prefill.session import owner_of
from tests.integration.conftest import app_args, deploy_app
from tests.integration.test_streaming_input import TEXT, split_inside_words, whole_chat

pytestmark = pytest.mark.integration

APP, PREFIX = "drain", "/drain"


def deploy(prefill_replicas: int) -> None:
    """Deploy (or rescale) the second app and wait until it runs `prefill_replicas` prefill replicas."""
    deploy_app(APP, PREFIX, copy.deepcopy(app_args()), [{"name": "prefill", "num_replicas": prefill_replicas}])
    deadline = time.time() + 300
    while time.time() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            replicas = status.deployments["prefill"].replica_states.get("RUNNING", 0)
            if replicas == prefill_replicas:
                return
        time.sleep(1)
    raise AssertionError(f"{APP} did not reach {prefill_replicas} prefill replicas: {serve.status()}")


def test_scale_down_hands_open_sessions_over(server):
    deploy(prefill_replicas=2)
    base = f"{server}{PREFIX}/v1/streaming_input/sessions"
    try:
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
                assert (
                    httpx.post(f"{base}/{sid}/chunks", json={"sequence_id": seq, "payload": piece}).status_code == 202
                )

        deploy(prefill_replicas=1)  # Serve stops one replica; it drains and hands its sessions over
        survivor = serve.get_deployment_handle("prefill", APP).stats.remote().result()["replica"]
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
    finally:
        serve.delete(APP)
