"""Protocol helpers, the prefill request transform, config merging and stream coalescing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.config import AppConfig
from core.protocol import choice_text, error_body, error_status, parse_sse, sse, validate_openai_body
from prefill.server import decode_params, prefill_body
from router.sessions.rest import session_spec


def test_error_body_is_openai_shaped():
    body = error_body(404, "no such model", "model")
    assert body == {"error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}}
    assert error_status(body) == 404
    assert error_status({"error": {"code": "weird"}}) == 500


def test_validation_uses_vllms_request_models():
    assert validate_openai_body("chat", {"messages": [{"role": "user", "content": "hi"}]}) is None
    err = validate_openai_body("chat", {"messages": "nope"})
    assert err["error"]["code"] == 400 and err["error"]["param"] == "messages"
    assert validate_openai_body("completion", {"prompt": "x", "logprobs": -3}) is not None


def test_prefill_body_asks_for_one_token_and_remote_decode():
    body = {
        "messages": [],
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "logprobs": True,
        "request_id": "r1",
    }
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["n"] == 1
    assert out["stream"] is False and "stream_options" not in out and "logprobs" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["request_id"] == "r1-prefill"
    assert out["return_token_ids"] is True  # (the prompt's ids, for decode: `decode_params`)
    assert body["max_tokens"] == 50  # the client's request is untouched
    # Ids only where decode takes them: not for a completion, nor a chat whose rendered prompt comes back.
    assert "return_token_ids" not in prefill_body({"prompt": "x", "max_tokens": 5}, "completion")
    assert "return_token_ids" not in prefill_body({**body, "return_prompt_text": True})


def test_a_chats_prompt_ids_go_to_decode_with_its_kv():
    kv = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    result = SimpleNamespace(kv_transfer_params=kv, prompt_token_ids=[5, 6, 7])
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert decode_params("chat", chat, result) == {**kv, "prompt_token_ids": [5, 6, 7]}
    assert kv == {"do_remote_prefill": True, "remote_block_ids": [1, 2]}  # (a new dict: the response's is kept)
    # Decode renders the prompt itself where the client wants the rendered text back, and for a completion.
    assert decode_params("chat", {**chat, "return_prompt_text": True}, result) == kv
    assert decode_params("chat", {**chat, "echo": True}, result) == kv
    assert decode_params("completion", {"prompt": "hi"}, SimpleNamespace(kv_transfer_params=kv)) == kv
    assert decode_params("chat", chat, SimpleNamespace(kv_transfer_params=kv, prompt_token_ids=None)) == kv
    assert decode_params("chat", chat, SimpleNamespace(kv_transfer_params=None, prompt_token_ids=[5])) is None


def test_sse_parsing():
    text = sse({"choices": [{"delta": {"content": "he"}, "finish_reason": None}]}) + sse(
        {"choices": [{"text": "llo", "finish_reason": "stop"}]}
    )
    frames = parse_sse(text + "data: [DONE]\n\n")
    assert [choice_text(f) for f in frames] == [("he", None), ("llo", "stop")]
    assert choice_text({"choices": []}) == ("", None)


def test_session_spec_splits_request_and_session_settings():
    spec = session_spec({"messages": [], "max_tokens": 5, "start_policy": "on_min_length", "min_tokens": 9})
    assert spec["request"] == {"messages": [], "max_tokens": 5}
    assert spec["start_policy"] == {"type": "on_min_length", "min_tokens": 9}


def test_role_engine_config_merges_over_shared():
    config = AppConfig.model_validate(
        {
            "engine": {"max_model_len": 1024, "env": {"A": "1"}, "engine_kwargs": {"seed": 1}},
            "prefill": {"engine": {"max_model_len": 2048, "env": {"B": "2"}}},
        }
    )
    # round-trips through Ray as JSON, then merges the same way
    config = AppConfig.model_validate(config.model_dump(mode="json"))
    prefill, decode = config.engine_for("prefill"), config.engine_for("decode")
    assert prefill.max_model_len == 2048 and decode.max_model_len == 1024
    assert prefill.env == {"A": "1", "B": "2"} and decode.env == {"A": "1"}
    assert prefill.engine_kwargs == {"seed": 1}


def test_prefill_prefix_cache_cannot_be_disabled():
    with pytest.raises(ValueError):
        AppConfig.model_validate({"prefill": {"engine": {"enable_prefix_caching": False}}})
