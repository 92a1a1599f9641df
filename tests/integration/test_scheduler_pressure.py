"""The prefill streaming scheduler under KV memory pressure, on the real stack.

A second application with a prefill KV cache of about 40 blocks (5,000 tokens) serves more concurrent
streaming sessions of about 1,000 tokens than it holds. Under each policy and each eviction mode every answer
must complete and equal the one-shot request over the final input (greedy), including sessions whose input
is rewritten with replace chunks; a plain chat completion sent in the middle is answered; afterwards neither
engine holds a block. On the code before the scheduler this wedged: no answer, and no plain request, ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray import serve

from tests.integration.conftest import app_args, wait_healthy

pytestmark = pytest.mark.integration

APP = "pressure"
PREFIX = "/pressure"
SESSIONS = "/v1/streaming_input/sessions"
SESSION_COUNT = 12
MAX_TOKENS = 8
WORDS = ["crawler", "page", "vector", "search", "document", "result", "answer", "stream", "token", "context"]


def pressure_args() -> dict[str, Any]:
    args = copy.deepcopy(app_args())
    args["prefill"]["engine"]["kv_cache_gb"] = 0.01  # about 40 blocks of 128 tokens on the local model
    args["kv_transfer"]["lease_s"] = 6
    return args


HEALTH_SEEN: list[int] = []  # /health statuses while the app started, in order


@pytest.fixture(scope="module")
def pressure(server: str) -> Iterator[str]:
    from ray.serve.api import _run

    from serve_app.builder import build_app

    _run(build_app(pressure_args()), name=APP, route_prefix=PREFIX, _blocking=False)
    base = f"{server}{PREFIX}"
    deadline = time.time() + 240
    while time.time() < deadline and HEALTH_SEEN[-1:] != [200]:
        with contextlib.suppress(httpx.HTTPError):
            HEALTH_SEEN.append(httpx.get(f"{base}/health", timeout=10).status_code)
        time.sleep(0.5)
    wait_healthy(base, 60)
    yield base
    serve.delete(APP, _blocking=False)  # (its replicas finish stopping beside the next tests)


def test_health_is_503_until_both_engines_answer(pressure: str) -> None:
    """The router comes up seconds before the engines have loaded: until they answer, /health says 503."""
    assert 503 in HEALTH_SEEN and HEALTH_SEEN[-1] == 200, HEALTH_SEEN
    assert set(HEALTH_SEEN[HEALTH_SEEN.index(503) :]) <= {503, 200}
    assert httpx.get(f"{pressure}/v1/models", timeout=10).status_code == 200


def handle(role: str) -> Any:
    return serve.get_deployment_handle(role, app_name=APP)


async def stats(role: str) -> dict[str, Any]:
    return await handle(role).stats.remote()


async def wait_idle(role: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.time() + timeout
    while True:
        s = await stats(role)
        if s["num_requests"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            return s
        if time.time() > deadline:
            raise AssertionError(f"{role} engine of {APP} still holds blocks after {timeout}s: {s}")
        await asyncio.sleep(0.5)


def text_of(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(words))


async def run_session(client: httpx.AsyncClient, base: str, i: int, round_seed: int) -> dict[str, Any]:
    """One session: ~1,000 tokens in 8 chunks at random gaps; every third session rewrites its input
    midway with a replace chunk. Returns the final input and the answer."""
    rng = random.Random(round_seed * 100 + i)
    r = await client.post(f"{base}{SESSIONS}", json={"messages": [], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    text = text_of(round_seed * 1000 + i, 260)
    pieces = [text[k * len(text) // 8 : (k + 1) * len(text) // 8] for k in range(8)]
    buffer = ""
    for seq, piece in enumerate(pieces):
        await asyncio.sleep(rng.uniform(0.0, 0.25))
        body: dict[str, Any] = {"sequence_id": seq, "payload": piece, "end_of_input": seq == len(pieces) - 1}
        if i % 3 == 0 and seq == 4:  # update mode: the second half of what came so far is replaced
            offset = len(buffer) // 2
            body.update(mode="replace", offset=offset, payload=text_of(round_seed * 7 + i, 40) + " " + piece)
            buffer = buffer[:offset] + body["payload"]
        else:
            buffer += piece
        r = await client.post(f"{base}{SESSIONS}/{sid}/chunks", json=body)
        assert r.status_code == 202, r.text
    r = await client.get(f"{base}{SESSIONS}/{sid}/result")
    assert r.status_code == 200, r.text
    answer = r.json()["answer"]
    info = (await client.get(f"{base}{SESSIONS}/{sid}")).json()
    await client.delete(f"{base}{SESSIONS}/{sid}")
    return {"input": buffer, "answer": answer, "info": info}


async def one_shot(client: httpx.AsyncClient, server: str, text: str) -> str:
    """The same input as one request, on the main app (ample KV; token-identical to one engine)."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = await client.post(f"{server}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


COMBOS = [(p, e) for p in ("fcfs", "lcas", "mcps") for e in ("recompute", "swap", "cost")] + [("vllm", "recompute")]


@pytest.mark.parametrize(("policy", "eviction"), COMBOS)
async def test_sessions_beyond_kv_capacity_all_answer(server: str, pressure: str, policy: str, eviction: str) -> None:
    applied = await handle("prefill").configure_scheduler.remote(policy=policy, eviction=eviction)
    assert (applied["policy"], applied["eviction"]) == (policy, eviction)
    capacity = (await stats("prefill"))["kv_blocks_total"]
    before = (await stats("prefill"))["scheduler"]
    seed = COMBOS.index((policy, eviction))

    async with httpx.AsyncClient(timeout=180) as client:
        sessions = [asyncio.create_task(run_session(client, pressure, i, seed)) for i in range(SESSION_COUNT)]
        await asyncio.sleep(1.0)
        plain = await client.post(
            f"{pressure}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a plain request"}], "max_tokens": 4},
        )
        assert plain.status_code == 200, plain.text  # served while the sessions hold the cache
        results = await asyncio.wait_for(asyncio.gather(*sessions), timeout=240)
        expected = await asyncio.gather(*(one_shot(client, server, r["input"]) for r in results))

    for k, (result, want) in enumerate(zip(results, expected, strict=True)):
        assert result["answer"]["status"] == "completed", result
        assert result["answer"]["text"] == want, f"session {k} under {policy}/{eviction}"
    after = (await stats("prefill"))["scheduler"]
    resident = sum(r["info"]["resident_tokens"] for r in results)
    assert resident > capacity * 128, "the sessions must not fit the cache together"
    evictions = sum(after.get(f"evictions_{k}", 0) - before.get(f"evictions_{k}", 0) for k in ("recompute", "swap"))
    assert evictions > 0, (before, after)
    if eviction == "swap":
        assert after.get("swapped_in_blocks", 0) > before.get("swapped_in_blocks", 0), after
    # Replace chunks invalidate what follows the common prefix, in the engine between two steps (a chunk in flight
    # is ended there), or by a new request when the session's is gone (the prefix cache gives the prefix back).
    # Nothing to cut where the replaced input never reached the engine: a session residency control kept from
    # streaming (its input waited, whole), or one whose appends waited behind a chunk still queued in the engine
    # (those versions were coalesced: tests/unit/prefill/test_streaming_sender.py).
    updates = [r["info"] for k, r in enumerate(results) if k % 3 == 0]
    assert all(u["rewrites"] >= 1 or u["buffered"] or u["coalesced"] >= 1 for u in updates), updates
    assert any(u["rewrites"] >= 1 for u in updates), updates
    assert sum(r["info"]["invalidated_tokens"] for r in results) > 0
    await wait_idle("prefill")
    await wait_idle("decode")


async def test_prefill_abandoned_before_decode_frees_its_blocks(pressure: str) -> None:
    """A prefill whose decode never comes (the client left between the two) holds its KV for the NIXL lease,
    not for the old 480 s abort timeout."""
    await wait_idle("prefill")
    body = {"messages": [{"role": "user", "content": text_of(99, 300)}], "max_tokens": 4, "request_id": "abandoned"}
    result = await handle("prefill").prefill.remote("chat", body)
    assert "kv_transfer_params" in result, result
    held = await stats("prefill")
    assert held["kv_blocks_free"] < held["kv_blocks_total"], "the KV waits for decode"
    started = time.monotonic()
    await wait_idle("prefill", timeout=30)
    assert time.monotonic() - started < 20


async def hold_every_block(seed: int) -> None:
    """Abandoned hand-offs (a decode that never comes) until the prefill cache is all but full: their KV stays
    for the NIXL lease, and the scheduler may not evict it."""
    total = (await stats("prefill"))["kv_blocks_total"]
    held = 0
    for k in range(12):
        body = {"messages": [{"role": "user", "content": text_of(500 + seed + k, 300)}], "max_tokens": 1}
        result = await handle("prefill").prefill.remote("chat", body)
        held = total - (await stats("prefill"))["kv_blocks_free"]
        if "error" in result or held >= total - 4:
            break
    assert held >= total - 8, (held, total)


async def test_no_evictable_memory_is_refused_with_429_then_served(pressure: str) -> None:
    """When every block belongs to prefills waiting for their decode (nothing the scheduler may evict), a
    session's answer is refused with 429 and Retry-After once the admission timeout passes, and a whole prompt
    is prefilled by decode instead; never left hanging. When the KV is released, prefill serves again."""
    await wait_idle("prefill")
    # Refusals come after the admission timeout: short, so that they come before the held KV's lease (6 s) ends.
    await handle("prefill").configure_scheduler.remote(policy="fcfs", eviction="recompute", admission_timeout_s=1)
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            # A whole prompt refused by prefill for capacity is prefilled by decode instead (conditional
            # disaggregation, `fallback_on_overload`): served, after the admission timeout, never hanging.
            await hold_every_block(0)
            started = time.monotonic()
            body = {"messages": [{"role": "user", "content": text_of(900, 300)}], "max_tokens": 2}
            r = await client.post(f"{pressure}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-prefilled-by"] == "decode"
            assert time.monotonic() - started < 15
            # A session always hands off from its prefill replica: its answer is refused, with Retry-After.
            await wait_idle("prefill", timeout=30)
            await hold_every_block(20)
            started = time.monotonic()
            r = await client.post(f"{pressure}{SESSIONS}", json={"messages": [], "max_tokens": 2})
            sid = r.json()["session_id"]
            chunk = {"sequence_id": 0, "payload": text_of(901, 300), "end_of_input": True}
            assert (await client.post(f"{pressure}{SESSIONS}/{sid}/chunks", json=chunk)).status_code in (202, 429)
            r = await client.get(f"{pressure}{SESSIONS}/{sid}/events")
            assert r.status_code == 429, r.text
            assert time.monotonic() - started < 15
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "RateLimitError"
            await client.delete(f"{pressure}{SESSIONS}/{sid}")
            await wait_idle("prefill", timeout=30)  # the lease ran out: the blocks are back
            r = await client.post(f"{pressure}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-prefilled-by"] == "prefill"
    finally:
        await handle("prefill").configure_scheduler.remote(admission_timeout_s=60)
