"""Tool calls at the router: put together from streamed deltas, checked on the way in, counted, and translated
between the Realtime API's shapes and chat completions'.

The engines do the real work (vLLM's chat template renders the tools, its tool parser or structured outputs make
the calls): a chat completion's frames pass through untouched. Sessions and Realtime responses need the calls
whole (the conversation goes on from them) and, for Realtime, as `function_call` items.
"""

from __future__ import annotations

from typing import Any

from core import metrics


def merge_deltas(calls: list[dict[str, Any]], deltas: Any) -> None:
    """Fold one frame's `delta.tool_calls` into `calls` (OpenAI's streamed form: the first fragment of a call
    carries its `index`, `id`, `type` and `function.name`, later ones more `function.arguments`)."""
    if not isinstance(deltas, list):
        return
    for delta in deltas:
        if not isinstance(delta, dict):
            continue
        index = delta.get("index")
        if not isinstance(index, int) or index < 0:
            index = len(calls)
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = calls[index], delta.get("function") or {}
        if delta.get("id"):
            call["id"] = delta["id"]
        if function.get("name"):
            call["function"]["name"] = function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]


def message_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole (non-streamed) message's `tool_calls`, in the form `merge_deltas` builds."""
    return [
        {
            "id": call.get("id"),
            "type": "function",
            "function": {
                "name": (call.get("function") or {}).get("name") or "",
                "arguments": (call.get("function") or {}).get("arguments") or "",
            },
        }
        for call in message.get("tool_calls") or []
        if isinstance(call, dict)
    ]


def count(surface: str, calls: int) -> None:
    if calls:
        metrics.inc(metrics.TOOL_CALLS, calls, "tool calls answered, by surface", surface=surface)


def count_in_frames(text: str) -> int:
    """Tool calls begun in relayed SSE text (a call's first fragment carries its `id`)."""
    if '"tool_calls"' not in text:
        return 0
    import json

    begun = 0
    for frame in text.split("\n\n"):
        if frame.startswith("data: {") and '"tool_calls"' in frame:
            for choice in json.loads(frame[6:]).get("choices") or []:
                delta = choice.get("delta") or choice.get("message") or {}
                begun += sum(1 for call in delta.get("tool_calls") or [] if call.get("id"))
    return begun


def check_tools(tools: Any) -> tuple[int, str] | None:
    """(index, why) of the first tool whose `parameters` is not a JSON Schema (vLLM checks the shape of `tools`,
    not the schemas, which fail only later, when a forced call compiles one into a grammar)."""
    if not isinstance(tools, list):
        return None
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        schema = function.get("parameters") if isinstance(function, dict) else None
        if schema is None:
            continue
        if not isinstance(schema, dict):
            return i, "a tool's parameters are a JSON Schema object"
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as e:
            return i, f"not a valid JSON Schema: {e.message}"
    return None


def refusal(body: dict[str, Any]) -> dict[str, Any] | None:
    """A request's tools checked (`check_tools`): OpenAI error JSON naming the tool's parameters, or None."""
    if (bad := check_tools(body.get("tools"))) is None:
        return None
    from core.protocol import error_body

    param = f"tools.{bad[0]}.function.parameters"
    return error_body(400, f"{param}: {bad[1]}", param)


# --- Realtime ------------------------------------------------------------------------------------------------
def realtime_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Realtime function tools (`{"type": "function", "name", "description", "parameters"}`) as chat tools."""
    out = []
    for tool in tools:
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("parameters") is not None:
            function["parameters"] = tool["parameters"]
        out.append({"type": "function", "function": function})
    return out


def realtime_tool_choice(choice: Any) -> Any:
    """`"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}` as chat's `tool_choice`."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def from_chat(tools: list[dict[str, Any]], choice: Any) -> tuple[list[dict[str, Any]], Any]:
    """Chat's `tools` and `tool_choice` back in Realtime's shapes (the inverse of the two above)."""
    flat = [{"type": "function", **tool["function"]} for tool in tools]
    return flat, {"type": "function", **choice["function"]} if isinstance(choice, dict) else choice or "auto"


def function_call_item(call: dict[str, Any], item_id: str, status: str) -> dict[str, Any]:
    """A call as a Realtime conversation item."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": status,
        "call_id": call.get("id") or "",
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
    }
