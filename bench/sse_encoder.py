"""CPU per output token of decode's SSE encoding: vLLM's `chat_completion_stream_generator` against decode/sse.py.

The same engine outputs (one token per step, as decode's engine makes them, a few bytes of text each) go through
vLLM's generator (with no tool parser, and with the `hermes` one the shipped config names, which vLLM runs on every
delta even for a request without tools) and through decode/sse.py, then through what decode did with each frame
before the feed: `ShownIds.take` (a regex that cuts the token ids out of vLLM's frames) or `take_frame` (the ids
beside). No engine, no Ray: the process's CPU time, `time.process_time`, over many streams, so the figure is the
encoder's own and repeatable on a busy machine. The ratio is what the numbers are for.

    .venv/bin/python bench/sse_encoder.py [--streams 200] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import record

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", "\n", ' "é"']


def serving(tool_parser: str | None) -> Any:
    """vLLM's chat serving object without an engine: what the stream generators read."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.parser import ParserManager

    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    parser = None
    if tool_parser:
        parser = ParserManager.get_parser(
            tool_parser_name=tool_parser,
            reasoning_parser_name=None,
            enable_auto_tools=True,
            tool_strict_level="auto",
            model_name="m",
            is_harmony=False,
            tokenizer=None,
        )
    settings = {
        "parser_cls": parser,
        "enable_force_include_usage": False,
        "response_role": "assistant",
        "_include_reasoning_tokens_details": False,
        "enable_log_outputs": False,
        "request_logger": None,
        "system_fingerprint": None,
        "enable_prompt_tokens_details": False,
        "enable_per_request_metrics": False,
        "log_error_stack": False,
        "model_config": None,  # (the hermes parser reads nothing of it)
    }
    for key, value in settings.items():
        setattr(chat, key, value)
    return chat


def outputs(tokens: int) -> list[Any]:
    from vllm.outputs import CompletionOutput, RequestOutput

    made = []
    for i in range(tokens):
        last = i == tokens - 1
        step = CompletionOutput(
            0, WORDS[i % len(WORDS)], [100 + i], None, None, finish_reason="length" if last else None
        )
        made.append(RequestOutput("r", None, list(range(40)), None, [step], last, num_cached_tokens=0))
    return made


async def _feed(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def one_stream(encoder: str, chat: Any, request: Any, items: list[Any], tokenizer: Any) -> int:
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

    from decode import sse
    from decode.feed import ShownIds

    shown = ShownIds(keep=False)
    metadata = RequestResponseMetadata(request_id="chatcmpl-1")
    if encoder == "decode":
        stream = sse.text_stream(chat, request, _feed(items), "chatcmpl-1", "m", metadata, None, "strip")
    else:
        stream = chat.chat_completion_stream_generator(
            request, _feed(items), "chatcmpl-1", "m", [], tokenizer, metadata
        )
    frames = 0
    async for frame in stream:
        if frame.startswith('data: {"error"'):
            raise RuntimeError(f"{encoder} failed: {frame}")
        if isinstance(frame, sse.Frame):
            shown.take_frame(frame)
        else:
            shown.take(frame)
        frames += 1
    return frames


def measure(encoder: str, chat: Any, streams: int, tokens: int, tokenizer: Any) -> float:
    """CPU microseconds per output token over `streams` streams of `tokens` tokens."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True}
    )
    items = outputs(tokens)

    async def run() -> None:
        for _ in range(streams):
            frames = await one_stream(encoder, chat, request, items, tokenizer)
            assert frames == tokens + 2, frames  # (the role frame, a frame a token, [DONE])

    started = time.process_time()
    asyncio.run(run())
    return (time.process_time() - started) / (streams * tokens) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from local_models.llm import make_local_model

    tokenizer = AutoTokenizer.from_pretrained(make_local_model())
    cases = [
        ("vLLM, no tool parser", "vllm", None),
        ("vLLM, hermes", "vllm", "hermes"),
        ("decode/sse.py", "decode", None),
    ]
    figures: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(args.rounds):  # alternated, so that a busy spell hits every case alike
        for name, encoder, tool_parser in cases:
            chat = serving(tool_parser)
            figures[name].append(measure(encoder, chat, args.streams, args.tokens, tokenizer))
    ours = statistics.median(figures["decode/sse.py"])
    table = [
        f"SSE encoding, CPU per output token ({args.streams} streams x {args.tokens} tokens, median of {args.rounds})",
        "",
        "| encoder | us / token | x decode/sse.py |",
        "|---|---|---|",
    ]
    for name, values in figures.items():
        median = statistics.median(values)
        table.append(f"| {name} | {median:.1f} | {median / ours:.2f} |")
    table += ["", f"`{record.command()}`"]
    print("\n".join(table))
    record.write("sse_encoder", table, {"args": vars(args), "us_per_token": figures})


if __name__ == "__main__":
    main()
