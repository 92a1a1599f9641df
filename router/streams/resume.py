"""Resuming an answer on another decode replica when its own failed, from the tokens already sent.

The router asks decode for the answer's token ids (vLLM's `return_token_ids`; decode cuts them out of the frames
unless the client asked for them, decode/feed.py) and keeps, per stream, the prompt's ids and the ids it has
forwarded (`Progress`). When the replica dies, the answer goes on elsewhere as a `completion` whose prompt is the
prompt's ids plus those generated ids, computed there (no KV transfer: the dead replica's KV is gone, and the
prefill replica's may be released); its frames are rewritten into the original stream's shape (`Rewriter`), so
that the client sees one stream with no token repeated or lost. With greedy sampling the text is the one the
uninterrupted answer would have had. A request whose answer a continuation cannot reproduce exactly is not
resumed (`refusal`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from core.protocol import SSE_DONE, Endpoint, sse
from core.protocol import continuation_refusal as refusal  # noqa: F401  (its home: what decode may continue)

MAX_RESUMES = 2  # per stream: a request that kills replicas must not take the whole pool down with it

# Sampling fields that mean the same on chat and completions and that a continuation copies. Not copied: the
# prompt's own fields, `n`, `truncate_prompt_tokens` (it would cut the continuation's prompt) and
# `kv_transfer_params` (never re-pull KV the failed replica may have released).
_COPIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "length_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "user",
    "priority",
    "vllm_xargs",
    "cache_salt",
    "stream",
    "stream_options",
    "return_tokens_as_token_ids",
)


@dataclass
class Progress:
    """What one stream has forwarded to its client so far."""

    prompt: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    meta: dict[str, Any] | None = None  # the original stream's id, created, model
    sent: bool = False
    finished: bool = False  # a frame with a finish reason went out
    usage_sent: bool = False
    done: bool = False  # `[DONE]` went out

    def add_ids(self, prompt: list[int] | None, tokens: list[int]) -> None:
        if self.prompt is None and prompt is not None:
            self.prompt = list(prompt)
        self.generated.extend(tokens)

    def saw(self, text: str) -> None:
        """One forwarded item: cheap substring checks on the hot path, one JSON parse per stream."""
        if self.meta is None and text.startswith("data: {"):
            first = json.loads(text[6 : text.index("\n\n")])
            self.meta = {k: first.get(k) for k in ("id", "created", "model")}
        self.sent = True
        self.finished = self.finished or '"finish_reason":"' in text
        self.usage_sent = self.usage_sent or '"choices":[],"usage"' in text
        self.done = self.done or SSE_DONE in text


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def tail(endpoint: Endpoint, body: dict[str, Any], progress: Progress) -> str:
    """The end of a stream that failed after its last token: the usage frame (if asked) and `[DONE]`."""
    out = ""
    if (body.get("stream_options") or {}).get("include_usage") and not progress.usage_sent:
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        meta = progress.meta or {}
        counts = usage(len(progress.prompt or []), len(progress.generated))
        out += sse({**meta, "object": obj, "choices": [], "usage": counts})
    return out + SSE_DONE


def _max_tokens(body: dict[str, Any]) -> int | None:
    limits = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens")) if isinstance(v, int)]
    return min(limits) if limits else None


def continuation(body: dict[str, Any], progress: Progress, attempt: int) -> dict[str, Any]:
    """The completion request that goes on from the prompt's ids plus the ids already generated."""
    assert progress.prompt is not None
    done = len(progress.generated)
    out = {k: body[k] for k in _COPIED if k in body}
    out.update(prompt=[*progress.prompt, *progress.generated], return_token_ids=True)
    if (limit := _max_tokens(body)) is not None:
        out["max_tokens"] = max(1, limit - done)
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - done)
    if body.get("request_id"):
        out["request_id"] = f"{body['request_id']}-resume{attempt}"
    return out


def restart(body: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The request again, from nothing (nothing reached the client): computed there, its KV not pulled."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if body.get("request_id"):
        out["request_id"] = f"{body['request_id']}-resume{attempt}"
    return out


class Rewriter:
    """A continuation's `text_completion` frames in the original stream's shape: its id, created and model, its
    object (a chat stream's frames become `chat.completion.chunk` deltas), and usage counted from the original
    prompt (the continuation's prompt holds the tokens generated before it)."""

    def __init__(self, endpoint: Endpoint, progress: Progress, keep_ids: bool) -> None:
        assert progress.prompt is not None
        self.endpoint, self.keep_ids = endpoint, keep_ids
        self.meta = progress.meta or {}
        self.prompt_tokens, self.before = len(progress.prompt), len(progress.generated)

    def __call__(self, text: str) -> str:
        out = []
        for frame in text.split("\n\n"):
            if not frame:
                continue
            if frame.startswith("data: {") and not frame.startswith('data: {"error"'):
                frame = "data: " + json.dumps(self.frame(json.loads(frame[6:])), separators=(",", ":"))
            out.append(frame + "\n\n")
        return "".join(out)

    def frame(self, data: dict[str, Any]) -> dict[str, Any]:
        chat = self.endpoint == "chat"
        out: dict[str, Any] = {
            "id": self.meta.get("id", data.get("id")),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.meta.get("created", data.get("created")),
            "model": self.meta.get("model", data.get("model")),
            "choices": [self._chat_choice(c) if chat else self._choice(c) for c in data.get("choices") or []],
        }
        if data.get("usage"):
            out["usage"] = usage(self.prompt_tokens, self.before + data["usage"].get("completion_tokens", 0))
        return out

    def _ids(self, choice: dict[str, Any]) -> list[int] | None:
        return choice.get("token_ids") if self.keep_ids else None

    def _chat_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": choice.get("index", 0),
            "delta": {"content": choice.get("text", "")},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if out["finish_reason"] is not None:
            out["stop_reason"] = choice.get("stop_reason")
        out["token_ids"] = self._ids(choice)
        return out

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": choice.get("index", 0),
            "text": choice.get("text", ""),
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason"),
            "prompt_token_ids": None,  # the original stream sent them
            "token_ids": self._ids(choice),
        }
