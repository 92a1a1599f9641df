"""Server-side limits at the router (issue #9): body size, NDJSON line size, max_tokens, token budgets."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from core.config import AppConfig
from prefill.client import PrefillClient
from router.app import APIError, read_json_object, take_usage
from router.keys import quota
from router.openai.ndjson import InputError, ndjson_lines, streaming_input_chat


def request(body: bytes, declared: bool = True) -> Request:
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)] or [b""]

    async def receive() -> dict[str, Any]:
        part = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": part, "more_body": bool(chunks)}

    headers = [(b"content-length", str(len(body)).encode())] if declared else []
    return Request({"type": "http", "method": "POST", "headers": headers, "path": "/"}, receive)


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_is_refused_with_413(declared: bool) -> None:
    assert await read_json_object(request(b'{"a": 1}', declared), 1024) == {"a": 1}
    with pytest.raises(APIError) as e:
        await read_json_object(request(b'{"a": "' + b"x" * 5000 + b'"}', declared), 1024)
    assert e.value.status == 413


async def test_an_ndjson_line_over_the_limit_is_refused_before_it_is_read_whole() -> None:
    ok = b'{"messages": []}\n{"payload": "hi"}\n'
    assert [line async for line in ndjson_lines(request(ok, False), 1024)] == [{"messages": []}, {"payload": "hi"}]
    endless = b'{"payload": "' + b"x" * 10_000  # no newline, ever
    with pytest.raises(InputError) as e:
        _ = [line async for line in ndjson_lines(request(endless, False), 1024)]
    assert e.value.payload["error"]["code"] == 413


def test_the_usage_frame_is_read_and_dropped_unless_asked_for() -> None:
    text = (
        'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        'data: {"choices": [], "usage": {"total_tokens": 7}}\n\ndata: [DONE]\n\n'
    )
    kept, usage = take_usage(text, keep=True)
    assert kept == text and usage == {"total_tokens": 7}
    dropped, usage = take_usage(text, keep=False)
    assert '"usage"' not in dropped and dropped.endswith("data: [DONE]\n\n") and usage == {"total_tokens": 7}


def test_token_budgets_refill_over_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(quota.time, "monotonic", lambda: now[0])
    budgets = quota.TokenBudgets(60)  # one token a second
    assert budgets.retry_after("k") is None
    budgets.charge("k", {"prompt_tokens": 50, "completion_tokens": 20})  # 10 tokens of debt
    assert budgets.retry_after("k") == 11
    now[0] += 10.5
    assert budgets.retry_after("k") is None  # refilled past zero
    assert quota.TokenBudgets(None).retry_after("k") is None and budgets.retry_after("") is None
    budgets.charge("k", None)  # an answer without usage costs nothing
    assert time.monotonic() == now[0]


class _Calls:
    """A fake prefill handle: every session call succeeds and is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def options(self, **options: Any) -> _Calls:  # (the prefill client's handle options)
        return self

    def __getattr__(self, method: str) -> Any:
        calls = self.calls

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                calls.append((method, args[0] if args else kwargs))

                async def reply() -> dict[str, Any]:
                    return {"session_id": "sess_r1_abc"} if method == "create_session" else {}

                return reply()

        return Method()


async def test_an_ndjson_body_that_stops_sending_is_refused_and_its_session_deleted() -> None:
    config = AppConfig(limits={"idle_timeout_s": 0.3})
    prefill = _Calls()
    ingress = SimpleNamespace(
        config=SimpleNamespace(limits=config.limits, model_name=config.model_name),
        prefill=PrefillClient(prefill),
        check_model=lambda body: None,
        check_max_tokens=lambda body: None,
    )
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await streaming_input_chat(ingress, request)

    async def stalls() -> Any:
        yield b'{"messages": [{"role": "user", "content": "Hello"}]}\n{"payload": " there"}\n'
        await asyncio.sleep(5)  # ...and nothing more
        yield b""

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await asyncio.wait_for(client.post("/v1/chat/completions", content=stalls()), 4)
    assert r.status_code == 408 and r.json()["error"]["code"] == 408
    methods = [m for m, _ in prefill.calls]
    assert methods[0] == "create_session" and methods[-1] == "session_delete"
    assert methods.count("session_chunk") == 2  # the partial user turn, then " there"


async def test_json_nested_past_the_parsers_depth_is_a_400_not_a_500() -> None:
    with pytest.raises(APIError) as e:
        await read_json_object(request(b"[" * 100_000 + b"]" * 100_000), 1 << 20)
    assert e.value.status == 400
    with pytest.raises(ValueError):
        _ = [line async for line in ndjson_lines(request(b"[" * 100_000 + b"\n", False), 1 << 20)]


def test_fastapis_own_refusals_are_openai_error_json() -> None:
    from fastapi.testclient import TestClient

    from router.app import app

    client = TestClient(app)
    for method, path, status in [
        ("GET", "/v1/nope", 404),
        ("DELETE", "/v1/models", 405),
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/v1/streaming_input/sessions/sess_a_b/result?wait=maybe", 400),
        ("GET", "/v1/streaming_input/sessions/sess_a_b/events?turn=-7", 400),
    ]:
        r = client.request(method, path)
        assert r.status_code == status, (method, path, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]["code"] == status


async def test_unpaired_surrogates_are_a_400_and_emoji_are_fine() -> None:
    with pytest.raises(APIError) as e:
        await read_json_object(request(b'{"payload": "\\ud800", "sequence_id": 0}'), 1024)
    assert e.value.status == 400
    assert await read_json_object(request(b'{"payload": "\\ud83d\\ude00"}'), 1024) == {"payload": "\U0001f600"}


def test_objects_vllm_reads_unchecked_must_be_objects() -> None:
    from pydantic import ValidationError

    from router.openai.schemas import ChatBody

    for field in ("structured_outputs", "response_format", "stream_options", "chat_template_kwargs"):
        with pytest.raises(ValidationError):
            ChatBody.model_validate({"messages": [], field: 1.9})


@pytest.mark.parametrize(
    "value", [{"do_remote_prefill": True, "remote_host": "10.0.0.9"}, {"prompt_token_ids": [1]}, {}]
)
def test_kv_transfer_params_from_a_client_are_a_400(value: dict[str, Any]) -> None:
    """The server's replicas set `kv_transfer_params` among themselves; a client's would have decode read KV from
    wherever it names, or answer token ids the chat template did not render."""
    from pydantic import ValidationError

    from router.openai.schemas import ChatBody, CompletionBody, validation_error

    for model, body in ((ChatBody, {"messages": []}), (CompletionBody, {"prompt": "x"})):
        assert model.model_validate({**body, "kv_transfer_params": None}).kv_transfer_params is None
        with pytest.raises(ValidationError) as e:
            model.model_validate({**body, "kv_transfer_params": value})
        error = validation_error(e.value)["error"]
        assert error["code"] == 400 and error["param"] == "kv_transfer_params", error
