"""What a session answer produced, as the router sees it pass: the owner's record of it (`Outcome`, read off
decode's SSE frames as they go to the client), and a finished answer given again from that record to a reader
that did not stream it (`replay_frames`, `completion_object`: the OpenAI frames or object its stream had)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from core.protocol import SSE_DONE, choice_text, sse
from router.openai import tool_calls


@dataclass
class Outcome:
    """What the owner learns of an answer: accumulated from decode's frames as they pass."""

    status: str = "completed"
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    response: dict[str, Any] = field(default_factory=dict)  # id, created, model
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls, from the streamed fragments

    def absorb(self, sse_text: str, keep_usage: bool) -> tuple[str, list[str]]:
        """One decode item (one or more SSE frames): what to forward to the client, and the text deltas."""
        forward, deltas = [], []
        for frame in sse_text.split("\n\n"):
            if not frame.startswith("data: "):
                continue
            if frame == "data: [DONE]":
                forward.append(SSE_DONE)
                continue
            data = json.loads(frame[6:])
            if "error" in data:
                self.status, self.error = "failed", data["error"]
                forward.append(frame + "\n\n")
                continue
            if not self.response:
                self.response = {k: data.get(k) for k in ("id", "created", "model")}
            if data.get("usage"):
                self.usage = data["usage"]
                if not data.get("choices") and not keep_usage:
                    continue  # the owner always asks decode for usage; this client did not
            piece, finish_reason = choice_text(data)  # (sessions have one choice: n is 1)
            if '"tool_calls"' in frame:
                for choice in data.get("choices") or []:
                    tool_calls.merge_deltas(self.tool_calls, (choice.get("delta") or {}).get("tool_calls"))
            if piece:
                deltas.append(piece)
            self.finish_reason = finish_reason or self.finish_reason
            forward.append(frame + "\n\n")
        self.text += "".join(deltas)
        return "".join(forward), deltas

    def absorb_response(self, body: dict[str, Any]) -> None:
        """A whole (non-streaming) response."""
        choice = (body.get("choices") or [{}])[0]
        self.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
        self.tool_calls = tool_calls.message_calls(choice.get("message") or {})
        self.finish_reason, self.usage = choice.get("finish_reason"), body.get("usage")
        self.response = {k: body.get(k) for k in ("id", "created", "model")}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _choice(endpoint: str, text: str | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
    if endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": text or ""}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


def _meta(endpoint: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The response's id, created and model as decode wrote them; made up for an answer that ended before
    decode wrote anything (cancelled or failed before its first frame)."""
    meta = summary.get("response") or {}
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    return {
        "id": meta.get("id") or f"{prefix}-{uuid.uuid4().hex}",
        "created": meta.get("created") or int(time.time()),
        "model": meta.get("model") or "",
    }


def replay_frames(endpoint: str, summary: dict[str, Any], include_usage: bool) -> str:
    """A finished answer as the SSE frames its stream had: role (chat), text with the finish reason, usage
    (if asked), `[DONE]`."""
    meta = _meta(endpoint, summary)
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    base = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"]}
    frames = []
    if endpoint == "chat":
        frames.append({**base, "choices": [_choice(endpoint, None, None, True)]})
    text, finish = summary.get("text"), summary.get("finish_reason")
    calls = summary.get("tool_calls") if endpoint == "chat" else None
    if calls:  # each call whole, in one fragment, as vLLM streams a forced call
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        if text:
            frames.append({**base, "choices": [_choice(endpoint, text, None, False)]})
        frames.append({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})
    else:
        frames.append({**base, "choices": [_choice(endpoint, text, finish, False)]})
    if summary.get("error"):
        frames.append({"error": summary["error"]})
    if include_usage and summary.get("usage"):
        frames.append({**base, "choices": [], "usage": summary["usage"]})
    return "".join(sse(f) for f in frames) + SSE_DONE


def completion_object(endpoint: str, summary: dict[str, Any]) -> dict[str, Any]:
    """A finished answer as the object a non-streaming request returns."""
    meta = _meta(endpoint, summary)
    text, finish = summary.get("text") or "", summary.get("finish_reason")
    if endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls := summary.get("tool_calls"):
            message.update(content=text or None, tool_calls=calls)
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}, "text_completion"
    body = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"]}
    return {**body, "choices": [choice], "usage": summary.get("usage")}
