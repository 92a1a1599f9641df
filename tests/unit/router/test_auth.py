"""API keys (router/keys/auth.py) through the router's own middleware and realtime handshake, with a fake ingress."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from core.config import AppConfig
from prefill.client import PrefillClient
from router.app import Authenticate
from router.keys.auth import API_KEYS_ENV, APIKeys
from router.keys.quota import TokenBudgets
from router.realtime import socket as realtime
from router.sessions.owner import current_tenant


class FakePrefill:
    """The realtime handshake's first call: the session is refused, so the socket says why and closes."""

    specs: list[dict[str, Any]] = []

    class _CreateSession:
        def remote(self, spec: dict[str, Any]) -> Any:
            FakePrefill.specs.append(spec)

            async def refused() -> dict[str, Any]:
                return {"error": {"message": "no capacity", "type": "RateLimitError", "param": None, "code": 429}}

            return refused()

    create_session = _CreateSession()

    def options(self, **options: Any) -> FakePrefill:  # (the prefill client's handle options)
        return self


def client(keys: list[str], tokens_per_minute: int | None = None) -> TestClient:
    app = FastAPI()
    app.add_middleware(Authenticate)
    app.include_router(realtime.api)

    @app.post("/v1/spend")
    async def spend(tokens: int) -> dict[str, str]:
        budgets.charge(current_tenant.get(), {"total_tokens": tokens})
        return {"charged": current_tenant.get()}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"object": "list"}

    config = SimpleNamespace(model_name="local:tiny-llama", limits=AppConfig().limits, speech=AppConfig().speech)
    budgets = TokenBudgets(tokens_per_minute)
    app.state.ingress = SimpleNamespace(
        api_keys=APIKeys(keys), config=config, prefill=PrefillClient(FakePrefill()), budgets=budgets
    )
    return TestClient(app)


def test_no_keys_configured_means_no_authentication() -> None:
    assert client([]).get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": "Basic k1"}, 401),
        ({"Authorization": "Bearer k1"}, 200),
        ({"Authorization": "bearer  k2 "}, 200),
    ],
)
def test_every_endpoint_but_health_wants_a_bearer_key(headers: dict[str, str], status: int) -> None:
    c = client(["k1", "k2"])
    r = c.get("/v1/models", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "AuthenticationError" and r.json()["error"]["code"] == 401
        assert "k1" not in r.text
    assert c.get("/health").status_code == 200  # probes need no key


def test_keys_from_the_environment_add_to_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, " env-key , other,")
    keys = APIKeys(["cfg"])
    assert keys.valid("env-key") and keys.valid("other") and keys.valid("cfg")
    assert not keys.valid("") and not keys.valid(None) and not keys.valid("env")


def test_realtime_without_a_key_is_refused_in_the_handshake() -> None:
    with pytest.raises(WebSocketDisconnect) as refused, client(["k1"]).websocket_connect("/v1/realtime"):
        pass
    assert refused.value.code == 1008


@pytest.mark.parametrize(
    ("headers", "subprotocols"),
    [
        ({"Authorization": "Bearer k1"}, []),
        ({}, ["realtime", "openai-insecure-api-key.k1", "openai-beta.realtime-v1"]),  # as browsers send it
    ],
)
def test_realtime_accepts_the_header_or_the_browser_subprotocol(
    headers: dict[str, str], subprotocols: list[str]
) -> None:
    c = client(["k1"])
    with c.websocket_connect("/v1/realtime", headers=headers, subprotocols=subprotocols) as ws:
        # Past authentication: the (fake) prefill refuses the session, and the socket says so.
        event = ws.receive_json()
        assert event["type"] == "error" and "no capacity" in event["error"]["message"]
        if subprotocols:
            assert ws.accepted_subprotocol == "realtime"
    # The session is created as the key's (its id, never the key itself).
    assert FakePrefill.specs[-1]["tenant"] == APIKeys.key_id("k1") != "k1"


def test_realtime_with_a_wrong_subprotocol_key_is_refused() -> None:
    c = client(["k1"])
    with (
        pytest.raises(WebSocketDisconnect) as refused,
        c.websocket_connect("/v1/realtime", subprotocols=["realtime", "openai-insecure-api-key.nope"]),
    ):
        pass
    assert refused.value.code == 1008


def test_each_key_has_its_own_tokens_per_minute() -> None:
    c = client(["key-a", "key-b"], tokens_per_minute=600)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    first = c.post("/v1/spend", params={"tokens": 700}, headers=a)  # admitted with budget left; overspends
    assert first.status_code == 200 and first.json()["charged"] == APIKeys.key_id("key-a")  # an id, not the key
    refused = c.post("/v1/spend", params={"tokens": 1}, headers=a)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "RateLimitError"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60  # 100 tokens of debt at 10 tokens/s: ~11 s
    assert c.post("/v1/spend", params={"tokens": 1}, headers=b).status_code == 200  # another key is untouched
    assert c.get("/v1/models", headers=a).status_code == 200  # reads are not refused
