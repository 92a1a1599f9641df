"""A chat request's messages and tools as vLLM hands them to the chat template.

vLLM renders a request's `tools` as its pydantic models dump them (`"description": null` where none was given)
and the `arguments` of an assistant's `tool_calls` as objects, not the JSON strings the API carries
(vllm/renderers/chat_utils.py `_postprocess_messages`). Anything that renders a conversation itself and must
produce the very tokens the engine will (a session's streamed prefix, the router's prompt count, the fitted local
model's training text) renders what these return.
"""

from __future__ import annotations

import json
from typing import Any


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """`tools` as vLLM passes them to the template (None: no tools)."""
    if not tools:
        return None
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    return [ChatCompletionToolsParam.model_validate(tool).model_dump() for tool in tools]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each assistant tool call's `arguments` as an object (copies; the input is left as is)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_with_object_arguments(call) for call in calls]}
        out.append(message)
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except ValueError:
            arguments = {}  # (vLLM does the same: a malformed history must not fail every later turn)
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
