"""Server-side limits at the router (issue #9): body size, NDJSON line size, max_tokens, token budgets."""

from __future__ import annotations

import time
from typing import Any

import pytest
from starlette.requests import Request

from router import quota
from router.app import APIError, read_json_object, take_usage
from router.ndjson import InputError, ndjson_lines


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
