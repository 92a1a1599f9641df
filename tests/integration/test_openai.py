"""OpenAI endpoints through router → prefill → NIXL → decode, on the real stack."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import ray
from ray import serve

from tests.integration.conftest import APP, engine_stats, wait_idle

pytestmark = pytest.mark.integration

LONG = "The quick brown fox jumps over the lazy dog while the compiler parses every token. " * 24
PROMPTS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": LONG}],
]


def chat(server: str, **body) -> httpx.Response:
    return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)


def sse_frames(server: str, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of an SSE response, checking the framing of every event."""
    frames = []
    with httpx.stream("POST", f"{server}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buffer = ""
        for text in r.iter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                assert event.startswith("data: "), event
                frames.append(event[len("data: ") :])
        assert buffer == ""
    return frames


@pytest.mark.parametrize("messages", PROMPTS, ids=["short", "multi-block"])
def test_greedy_pd_matches_single_engine(server, model_name, reference, messages):
    r = chat(server, model=model_name, messages=messages, max_tokens=24, temperature=0, return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    expected = ray.get(reference.chat.remote(messages, 24))
    assert choice["token_ids"] == expected
    assert len(expected) > 0


def test_completions_greedy_matches_single_engine(server, model_name, reference):
    body = {"model": model_name, "prompt": LONG, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["token_ids"] == ray.get(reference.complete.remote(LONG, 16))


def test_kv_moved_over_nixl(server, model_name):
    rid = f"kvmove-{time.time_ns()}"
    before = engine_stats("decode")
    r = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": model_name, "messages": PROMPTS[1], "max_tokens": 4, "temperature": 0},
        headers={"X-Request-Id": rid},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 2 * before["block_size"]  # the prompt spans several KV blocks

    decode = engine_stats("decode", f"chatcmpl-{rid}")
    prefill = engine_stats("prefill", f"chatcmpl-{rid}-prefill")
    assert decode["kv_transfers"] == before["kv_transfers"] + 1
    assert decode["kv_transfer_bytes"] > before["kv_transfer_bytes"]
    # decode computed at most one block of the prompt itself (in practice: the last token)
    assert 1 <= decode["prompt_tokens_computed"] <= decode["block_size"]
    # the prefill engine computed the rest (less whatever its prefix cache already held)
    assert prefill["prompt_tokens_computed"] >= 1


def test_decode_takes_the_prompt_ids_from_prefill(server, model_name, reference):
    """A chat prompt's token ids travel with its KV (vLLM's decode-side token reuse): decode starts from the ids
    the prefill replica computed the KV of, instead of rendering the chat template and tokenizing again."""
    body = {"model": model_name, "messages": PROMPTS[1], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    prefill = serve.get_deployment_handle("prefill", app_name=APP)
    prefilled = prefill.prefill.remote("chat", {**body, "request_id": f"ids-{uuid.uuid4().hex}"}).result(timeout_s=120)
    params = prefilled["kv_transfer_params"]
    # Decode answers the ids' prompt, whatever the messages say: it did not render them. (Decode reads the KV
    # first, whatever is asserted after: a failure leaves no KV held for the next test.)
    other = {**body, "messages": [{"role": "user", "content": "a different question"}], "kv_transfer_params": params}
    decode = serve.get_deployment_handle("decode", app_name=APP)
    answer = decode.start.remote(consumer="test", stream_id=uuid.uuid4().hex, endpoint="chat", body=other)
    response = answer.result(timeout_s=120)["response"]
    assert len(params.get("prompt_token_ids") or []) == prefilled["prompt_tokens"]
    assert response["usage"]["prompt_tokens"] == prefilled["prompt_tokens"]
    assert response["choices"][0]["token_ids"] == ray.get(reference.chat.remote(PROMPTS[1], 8))
    wait_idle("prefill")  # decode read the KV: the prefill replica holds none of it


def test_short_prompt_is_prefilled_by_decode(server, model_name):
    """Conditional disaggregation: a prompt under `router.disaggregation.min_prompt_tokens` never reaches a
    prefill replica (decode computes it all, nothing crosses NIXL); a long one goes through prefill."""
    before = engine_stats("decode")
    rids = {name: f"cond-{name}-{time.time_ns()}" for name in ("short", "long")}
    usage = {}
    for name, messages in zip(("short", "long"), PROMPTS, strict=True):
        r = httpx.post(
            f"{server}/v1/chat/completions",
            json={"model": model_name, "messages": messages, "max_tokens": 4, "temperature": 0},
            headers={"X-Request-Id": rids[name]},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-prefilled-by"] == ("decode" if name == "short" else "prefill")
        assert "decode;dur=" in r.headers["server-timing"]
        usage[name] = r.json()["usage"]["prompt_tokens"]
    assert usage["short"] < 256 <= usage["long"]  # either side of the shipped config's threshold

    short_prefill = engine_stats("prefill", f"chatcmpl-{rids['short']}")
    short_decode = engine_stats("decode", f"chatcmpl-{rids['short']}")
    assert short_prefill["prompt_tokens_computed"] == 0
    assert short_decode["prompt_tokens_computed"] == usage["short"]
    long_prefill = engine_stats("prefill", f"chatcmpl-{rids['long']}")
    long_decode = engine_stats("decode", f"chatcmpl-{rids['long']}")
    assert long_prefill["prompt_tokens_computed"] >= 1
    assert long_decode["prompt_tokens_computed"] <= long_decode["block_size"]
    assert engine_stats("decode")["kv_transfers"] == before["kv_transfers"] + 1  # the long one only


def test_sse_contract_frame_by_frame(server, model_name):
    body = {
        "model": model_name,
        "messages": PROMPTS[1],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    frames = sse_frames(server, "/v1/chat/completions", body)
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1

    first, *content, final, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] is None
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert all("role" not in c["choices"][0]["delta"] for c in content)
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 12

    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in [first, *content, final])
    whole = chat(server, **{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert streamed == whole.json()["choices"][0]["message"]["content"]


def test_a_busy_decode_sends_a_few_tokens_a_frame_with_the_same_answer(server, model_name, reference):
    """The test app paces every text answer (conftest: `decode.pacing.min_streams` 1): vLLM's stream_interval of
    2 sends the first token alone, then two a frame; the tokens and text are the unpaced single engine's."""
    body = {"model": model_name, "messages": PROMPTS[0], "max_tokens": 9, "temperature": 0, "stream": True}
    frames = sse_frames(server, "/v1/chat/completions", {**body, "return_token_ids": True})
    chunks = [json.loads(f) for f in frames[:-1]]
    per_frame = [len(c["choices"][0].get("token_ids") or []) for c in chunks if c["choices"]]
    assert per_frame[:2] == [0, 1] and max(per_frame) == 2, per_frame  # (the role frame, the first token, pairs)
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert streamed == ray.get(reference.chat.remote(PROMPTS[0], 9))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == chat(server, **{**body, "stream": False}).json()["choices"][0]["message"]["content"]


def test_sse_without_usage_has_no_usage_chunk(server, model_name):
    body = {"model": model_name, "messages": PROMPTS[0], "max_tokens": 3, "stream": True}
    frames = sse_frames(server, "/v1/chat/completions", body)
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c.get("usage") is None for c in chunks)


def test_official_openai_client(server, model_name):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    whole = client.chat.completions.create(model=model_name, messages=PROMPTS[1], max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model=model_name, messages=PROMPTS[1], max_tokens=10, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == 10

    completion = client.completions.create(model=model_name, prompt="def main():", max_tokens=5, temperature=0)
    assert completion.choices[0].text
    assert [m.id for m in client.models.list()] == [model_name]


def test_sampling_parameters(server, model_name):
    base = {"model": model_name, "messages": PROMPTS[0], "max_tokens": 8}
    seeded = [chat(server, **base, temperature=1.0, top_p=0.9, seed=7).json() for _ in range(2)]
    assert seeded[0]["choices"][0]["message"]["content"] == seeded[1]["choices"][0]["message"]["content"]

    r = chat(server, **{**base, "max_tokens": None}, max_completion_tokens=3, temperature=0).json()
    assert r["usage"]["completion_tokens"] == 3

    r = chat(server, **base, n=2, temperature=1.0, seed=1).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]

    r = chat(server, **base, temperature=0, logprobs=True, top_logprobs=2).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(len(t["top_logprobs"]) == 2 for t in content)

    # a stop string cuts the greedy answer where it first appears
    full = chat(server, **{**base, "max_tokens": 24}, temperature=0).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = chat(server, **{**base, "max_tokens": 24}, temperature=0, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == full[: full.index(stop)]


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ("{not json", 400, None),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, None),
        ({"messages": "not a list"}, 400, "messages"),
        # (the replicas' own: a client's would make decode read KV from the host it names, or skip the template)
        ({"messages": PROMPTS[0], "kv_transfer_params": {"prompt_token_ids": [1, 2]}}, 400, "kv_transfer_params"),
    ],
    ids=["malformed-json", "unknown-model", "negative-max-tokens", "too-long", "bad-messages", "kv-transfer-params"],
)
def test_bad_requests_get_openai_errors(server, model_name, payload, status, param):
    content = payload if isinstance(payload, str) else json.dumps(payload)
    r = httpx.post(
        f"{server}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param:
        assert error["param"] == param
    # and the server keeps serving
    assert chat(server, model=model_name, messages=PROMPTS[0], max_tokens=2).status_code == 200


def test_disconnect_mid_stream_aborts_everywhere(server, model_name):
    wait_idle("decode")
    before = engine_stats("decode")
    max_tokens = 2000
    body = {
        "model": model_name,
        "messages": PROMPTS[0],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_text())  # the stream has started; hang up now
    # the connection is closed here: both engines drop the request and every KV block
    for role in ("decode", "prefill"):
        stats = wait_idle(role)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    generated = engine_stats("decode")["generation_tokens"] - before["generation_tokens"]
    assert 0 < generated < max_tokens  # aborted, not run to completion
