"""A session's conversation: its input as chat messages (or a completion's prompt), tool calls and their results
included, and its rendering as the engine will see it.

Input joins the conversation as whole messages (`add_message`, a tool's result, the session's in-progress text
committed: `commit`) or stays the in-progress text of the current turn (`buffer`, owned by the session:
prefill/session.py, which hands it to the renders). `full_request` is the ordinary OpenAI request equal to everything
received so far; `stable_tokens` the part of its render no later input can change, which is what streams to the
engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from core.chat_render import template_messages, template_tools

_MARK = "\ue000"  # a private-use character no input contains: marks the end of the stable text


class SessionError(Exception):
    """An error for the client; `close` ends the session too (its input can no longer be made whole)."""

    def __init__(self, status: int, message: str, param: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.close = status, message, param, close


class Conversation:
    """One session's conversation (`Session.conversation`). Of its session it is given only `answering`: whether
    an answer is being generated now (input committed meanwhile waits for that answer, in `deferred`)."""

    def __init__(
        self, endpoint: Literal["chat", "completion"], request: dict[str, Any], answering: Callable[[], bool]
    ) -> None:
        self.endpoint = endpoint
        # The OpenAI request the answer is made from; its messages/prompt grow with the input.
        self.request = request
        self.instructions: str | None = None
        # Input committed while an answer is generated joins the conversation after that answer.
        self.deferred: list[dict[str, Any]] = []
        self._answering = answering

    def add_message(
        self,
        role: str,
        content: str,
        tool_call_id: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> None:
        """A whole conversation item (realtime `conversation.item.create`), checked and counted by the session,
        which commits its in-progress text first (`Session.add_message`). A `tool` message answers an open call
        (`tool_call_id`); an assistant's `tool_calls` (a client's `function_call` item) join the assistant message
        they follow, when it made calls too."""
        if tool_calls:
            last = (self.deferred or self._messages() or [{}])[-1]
            if last.get("role") == "assistant" and last.get("tool_calls") and not content:
                last["tool_calls"] = [*last["tool_calls"], *tool_calls]
                return
            self.commit({"role": "assistant", "content": content, "tool_calls": tool_calls})
        elif role == "tool":
            self.commit({"role": "tool", "tool_call_id": tool_call_id, "content": content})
        else:
            self.commit({"role": role, "content": content})

    def truncate_answer(self, chars: int) -> bool:
        """The last assistant message keeps its first `chars` characters (realtime `conversation.item.truncate`:
        what the user heard of it); False if there is none, or it is shorter."""
        messages = [*self._messages(), *self.deferred] if self.endpoint == "chat" else []
        last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        if last is None or not isinstance(last.get("content"), str) or len(last["content"]) <= chars:
            return False
        last["content"] = last["content"][:chars]
        return True

    def open_tool_calls(self) -> list[str]:
        """The ids of the calls the conversation's last assistant message made that no tool message answered."""
        calls: list[str] = []
        for message in [*self._messages(), *self.deferred] if self.endpoint == "chat" else []:
            if message.get("role") == "assistant":
                calls = [c.get("id") for c in message.get("tool_calls") or [] if c.get("id")]
            elif message.get("role") == "tool" and message.get("tool_call_id") in calls:
                calls.remove(message["tool_call_id"])
        return calls

    def check_tool_result(self, tool_call_id: str | None) -> None:
        if self.endpoint != "chat":
            raise SessionError(400, "tool results go to chat sessions (this one completes a prompt)", "role")
        if not tool_call_id:
            raise SessionError(400, "a tool's result names the call it answers: tool_call_id", "tool_call_id")
        if tool_call_id not in (open_calls := self.open_tool_calls()):
            waiting = ", ".join(open_calls) or "none"
            raise SessionError(
                400, f"tool_call_id {tool_call_id!r} is not an open tool call (open: {waiting})", "tool_call_id"
            )

    def commit(self, message: dict[str, Any]) -> None:
        """Input joins the conversation; while an answer is generated it waits for that answer, so that the
        conversation reads in the order it happened (the answer was asked for first)."""
        if self._answering():
            self.deferred.append(message)
        elif self.endpoint == "chat":
            self._messages().append(message)
        else:
            self.request["prompt"] = self.request.get("prompt", "") + message["content"]

    def add_answer(self, text: str, failed: bool = False, tool_calls: list[dict[str, Any]] | None = None) -> None:
        """The assistant's answer joins the conversation, so the next turn builds on it; an empty one too,
        so that user and assistant turns keep alternating (strict chat templates refuse two user turns).
        An answer that failed before any output adds nothing: trying again answers the same turn. Its tool
        calls wait for their results (`tool` messages)."""
        if failed and not text and not tool_calls:
            pass
        elif self.endpoint == "chat" and tool_calls:
            self._messages().append({"role": "assistant", "content": text, "tool_calls": tool_calls})
        elif self.endpoint == "chat":
            self._messages().append({"role": "assistant", "content": text})
        else:
            self.request["prompt"] = self.request.get("prompt", "") + text
        deferred, self.deferred = self.deferred, []
        for message in deferred:
            self.commit(message)

    def _messages(self) -> list[dict[str, Any]]:
        return self.request.setdefault("messages", [])

    def full_request(self, buffer: str, instructions: str | None = None) -> dict[str, Any]:
        """The ordinary OpenAI request equal to everything received so far, the session's in-progress text
        (`buffer`) included; `instructions` replace the session's for one response."""
        request = json.loads(json.dumps(self.request))
        if self.endpoint == "chat":
            messages = request.setdefault("messages", [])
            if buffer:
                messages.append({"role": "user", "content": buffer})
            if instructions := instructions if instructions is not None else self.instructions:
                messages.insert(0, {"role": "system", "content": instructions})
        else:
            request["prompt"] = request.get("prompt", "") + buffer
        return request

    def stable_tokens(self, tokenizer: Any, buffer: str) -> list[int]:
        """Tokens of the input that no later chunk can change: the render up to the in-progress text's (`buffer`'s)
        last whitespace, minus one token of margin (BPE may merge across the cut)."""
        cut = max(buffer.rfind(" "), buffer.rfind("\n"))
        stable_buffer = buffer[: max(cut, 0)]
        request = self.full_request(buffer)
        if self.endpoint == "chat":
            messages = request["messages"]
            if not messages:
                return []
            if buffer:  # mark where the stable in-progress text ends; the template suffix follows it
                messages[-1]["content"] = stable_buffer + _MARK
            text = self._render(tokenizer, request, messages)
            end = text.find(_MARK) if buffer else len(text)
            if buffer and end < 0:  # the template rewrote the content: stream committed messages only
                messages.pop()
                text = self._render(tokenizer, request, messages)
                end = len(text)
            text = text.replace(_MARK, "")
            add_special = False
        else:
            text = request.get("prompt", "")
            text = text[: len(text) - len(buffer) + len(stable_buffer)]
            end = len(text)
            add_special = True
        enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        keep = 0
        while keep < len(ids) and offsets[keep][1] <= end:
            keep += 1
        return list(ids[: max(keep - 1, 0)])

    @staticmethod
    def _render(tokenizer: Any, request: dict[str, Any], messages: list[dict[str, Any]]) -> str:
        """The chat template as the hand-off will apply it: the request's own template, tools and template
        arguments included, tools and tool calls in vLLM's form (otherwise the streamed prefix differs and the
        hand-off recomputes it all)."""
        kwargs = dict(request.get("chat_template_kwargs") or {})
        if request.get("tools"):
            kwargs["tools"] = template_tools(request["tools"])
        if request.get("chat_template"):
            kwargs["chat_template"] = request["chat_template"]
        kwargs.update(tokenize=False, add_generation_prompt=False)
        return tokenizer.apply_chat_template(template_messages(messages), **kwargs)
