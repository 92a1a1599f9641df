"""`local:tiny-llama-tools`: the tiny model fitted, when it is built, to answer a few conversations with tools.

A model of random weights never writes a tool call by itself, so `tool_choice: "auto"` (the model decides, vLLM's
tool parser reads its text) could not be shown end to end on a generated model. This one is the tiny model trained
(40-70 s on one core, by local_models/fit.py) on the conversations below, until greedy decoding reproduces each answer
with a clear margin: asked for the weather it writes a Hermes `<tool_call>` (one or two, for parallel calls); given
the tool's result it answers in text; asked something else it answers without a call; asked for a story it tells a
long one. Everything else about it is the tiny model's: the same tokenizer, chat template and architecture, loaded
and served with the same code.
Tests and examples send these very conversations (`EXAMPLES`), rendered as vLLM renders them
(core/chat_render.py).
"""

from __future__ import annotations

import json
from typing import Any

from core.chat_render import template_messages, template_tools
from local_models.fit import Recipe, fit, margin_loss, margins

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
TOOLS = [WEATHER, TIME]
WEATHER_RESULT = '{"temperature_c": 21, "sky": "clear"}'


def tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    """An assistant's tool call as the API carries it (arguments as a JSON string)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _calls(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
STORY = (
    "Once upon a time, a small robot lived by the sea. Every morning it counted the waves, and every evening it told "
    "the gulls how many it had counted. One day the sea was calm, and there were no waves to count. The robot sat on "
    "the sand and waited, and at last it heard the tide coming home."
)
# (conversation, the answer the fitted model gives to it, greedy)
EXAMPLES: list[tuple[list[dict[str, Any]], str]] = [
    (PARIS, _calls(("get_weather", {"city": "Paris"}))),
    ([{"role": "user", "content": "What time is it in Tokyo?"}], _calls(("get_time", {"timezone": "Asia/Tokyo"}))),
    (
        [{"role": "user", "content": "Compare the weather in Paris and Rome."}],
        _calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})),
    ),
    (
        [
            *PARIS,
            {"role": "assistant", "content": None, "tool_calls": [tool_call("get_weather", {"city": "Paris"})]},
            {"role": "tool", "tool_call_id": "call_0", "content": WEATHER_RESULT},
        ],
        "It is 21 degrees and clear in Paris.",
    ),
    ([{"role": "user", "content": "Say hello."}], "Hello! How can I help?"),
    # A long answer (115 tokens), for tests that need one still streaming: a user speaking over it (barge-in).
    ([{"role": "user", "content": "Tell a story."}], STORY),
]
RECIPE = Recipe(lr=3e-3, max_steps=600)
REPRODUCE = "python -m local_models.llm --model tiny-llama-tools --force"


def prompts(tokenizer: Any) -> list[tuple[list[int], str]]:
    """(prompt ids, answer) of each example, its prompt rendered as vLLM renders it."""
    rendered = []
    for messages, answer in EXAMPLES:
        prompt = tokenizer.apply_chat_template(
            template_messages(messages), tools=template_tools(TOOLS), add_generation_prompt=True, tokenize=False
        )
        rendered.append((tokenizer(prompt, add_special_tokens=False)["input_ids"], answer))
    return rendered


def fit_tool_calls(model: Any, tokenizer: Any) -> dict[str, Any]:
    """Train `model` until greedy decoding gives each example's answer with a clear margin (local_models/fit.py);
    what it took. Leaves the model in float32."""
    import torch

    rows = [
        (prompt_ids, tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        for prompt_ids, answer in prompts(tokenizer)
    ]
    # One batch, padded at the end (causal: padding changes nothing before it); only the answers are scored, and
    # the output layer runs on the positions that predict them alone.
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    targets = torch.full((len(rows), width), -100)
    for i, (prompt_ids, answer_ids) in enumerate(rows):
        ids[i, : len(prompt_ids) + len(answer_ids)] = torch.tensor(prompt_ids + answer_ids)
        targets[i, len(prompt_ids) - 1 : len(prompt_ids) + len(answer_ids) - 1] = torch.tensor(answer_ids)
    first = min(len(p) for p, _ in rows) - 1
    last = max(len(p) + len(a) for p, a in rows) - 1
    targets = targets[:, first:last]

    def logits() -> Any:
        hidden = model.model(input_ids=ids).last_hidden_state[:, first:last]
        return model.lm_head(hidden)

    model.train()
    report = fit(
        "local:tiny-llama-tools",
        model,
        loss=lambda _step: margin_loss(logits(), targets, RECIPE),
        worst=lambda: float(margins(logits(), targets).min()),
        recipe=RECIPE,
        reproduce=REPRODUCE,
    )
    model.eval()
    return report
