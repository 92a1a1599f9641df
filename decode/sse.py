"""Decode's own SSE encoder for chat answers that need nothing but text deltas: each engine step encoded once.

vLLM's `chat_completion_stream_generator` builds three pydantic objects per token, runs the configured tool parser
on every delta (even for a request without tools) and dumps the chunk to JSON; decode then cut the token ids
back out of that JSON with a regex, because the router asks for them (router/streams/resume.py) whether or not the
client did.
For a request with no tools, logprobs, echo, reasoning parser, beam search or `n` > 1 this generator takes its
place: the per-token frame is a template made once per stream from vLLM's own models (so the keys, their order
and the JSON are vLLM's), filled with the delta's text; the token ids travel beside the frame (`Frame`), in it only
when the client asked. Every other frame (the role, the finish, usage, errors) is vLLM's own model, once per
stream. Anything else keeps vLLM's generator. tests/unit/decode/test_decode_sse.py feeds the same engine outputs to both
and compares the bytes.

The frames are those of vLLM's generator with no tool parser, whether or not the config names one: a request that
offers no tools gets its text as text, as OpenAI's API does. (vLLM runs a configured tool parser on every request:
hermes turns `<tool_call>` text into calls the request never offered, and writes an empty step as `"delta":{}`
rather than `"delta":{"content":""}`.)
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, Literal

from decode import pacing

IdsMode = Literal["strip", "keep"]
# How the request the serving layer is about to start wants its token ids (decode/server.py `start`): None, as
# the request says; "strip": beside the frames only (the router asked, the client did not); "keep": in them too.
IDS: contextvars.ContextVar[IdsMode | None] = contextvars.ContextVar("rtpd_ids", default=None)
# A template's holes. Strings are private-use characters (written as is by pydantic and by json.dumps); numbers are
# unique in a document whose other numbers are holes too (`created`) or 0 (`index`).
_TEXT, _ID, _MODEL = "\ue000text\ue000", "\ue000id\ue000", "\ue000model\ue000"
_IDS, _CREATED = 987_654_321, 987_654_325
_PROMPT, _COMPLETION, _TOTAL = 987_654_322, 987_654_323, 987_654_324


class Frame(str):
    """SSE text with what the router needs beside it: the prompt's ids (first frame), the ids this frame's text
    came from, and whether it shows text or ends the answer (decode/feed.py `ShownIds`)."""

    prompt_ids: list[int] | None = None
    token_ids: list[int] = []  # (never mutated: each frame gets its own list)
    shows: bool = False


def _frame(text: str, prompt: list[int] | None = None, tokens: list[int] | None = None, shows: bool = True) -> Frame:
    frame = Frame(text)
    frame.prompt_ids, frame.token_ids, frame.shows = prompt, tokens or [], shows
    return frame


@contextlib.contextmanager
def ids_mode(mode: IdsMode | None) -> Iterator[None]:
    """The request the serving layer starts within this block has its token ids handled as `mode` says."""
    token = IDS.set(mode)
    try:
        yield
    finally:
        IDS.reset(token)


def text_only(serving: Any, request: Any) -> bool:
    """Whether `request`'s stream is nothing but text deltas, which this encoder writes as vLLM would."""
    parser = serving.parser_cls
    return (
        (request.n or 1) == 1
        and not request.logprobs
        and not request.echo
        and not request.tools
        and not request.use_beam_search
        and not request.return_prompt_text
        and (parser is None or parser.reasoning_parser_cls is None)
        and not (serving.enable_log_outputs and serving.request_logger)
    )


def install(serving: Any) -> None:
    """Route the text-only streams of vLLM's chat serving object `serving` through `text_stream`."""
    vllm_stream = serving.chat_completion_stream_generator

    def stream_generator(
        request: Any,
        result_generator: AsyncIterator[Any],
        request_id: str,
        model_name: str,
        conversation: Any,
        tokenizer: Any,
        request_metadata: Any,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_token_counts: dict[str, int] | None = None,
    ) -> AsyncGenerator[str, None]:
        if text_only(serving, request):
            pacing.apply()  # (under load: a few tokens a frame)
            return text_stream(
                serving, request, result_generator, request_id, model_name, request_metadata, mm_token_counts, IDS.get()
            )
        return vllm_stream(
            request,
            result_generator,
            request_id,
            model_name,
            conversation,
            tokenizer,
            request_metadata,
            chat_template_kwargs=chat_template_kwargs,
            mm_token_counts=mm_token_counts,
        )

    serving.chat_completion_stream_generator = stream_generator


class _Template:
    """A JSON document with holes: made once by dumping vLLM's model with sentinels in them."""

    def __init__(self, dumped: str, holes: list[str]) -> None:
        self.parts: list[str] = []
        self.order: list[int] = []
        at = {dumped.find(hole): i for i, hole in enumerate(holes) if hole in dumped}
        if any(dumped.count(hole) > 1 for hole in holes):
            raise ValueError(f"a hole occurs twice in {dumped!r}")
        rest = 0
        for start in sorted(at):
            self.parts.append(dumped[rest:start])
            self.order.append(at[start])
            rest = start + len(holes[at[start]])
        self.parts.append(dumped[rest:])

    def fill(self, *values: str) -> str:
        out = [self.parts[0]]
        for part, i in zip(self.parts[1:], self.order, strict=True):
            out.append(values[i])
            out.append(part)
        return "".join(out)


async def text_stream(
    serving: Any,
    request: Any,
    result_generator: AsyncIterator[Any],
    request_id: str,
    model_name: str,
    request_metadata: Any,
    mm_token_counts: dict[str, int] | None,
    ids: IdsMode | None,
) -> AsyncGenerator[str, None]:
    """vLLM's `chat_completion_stream_generator` for a text-only request (`text_only`), frame for frame."""
    from vllm.entrypoints.openai.chat_completion import serving as chat
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )
    from vllm.exceptions import GenerationError

    created = int(time.time())
    kind = "chat.completion.chunk"
    include_usage, continuous = chat.should_include_usage(request.stream_options, serving.enable_force_include_usage)
    with_ids = ids == "keep" if ids is not None else bool(request.return_token_ids)
    details = serving._include_reasoning_tokens_details

    def chunk(choice: Any | None, usage: Any | None = None, **fields: Any) -> Any:
        made = ChatCompletionStreamResponse(
            id=request_id, object=kind, created=created, choices=[choice] if choice else [], model=model_name, **fields
        )
        if usage is not None:
            made.usage = usage
        return made

    def running_usage(prompt: int, completion: int) -> Any:
        return _usage(prompt, completion, prompt + completion, details)

    template: _Template | None = None
    filled: list[str] = []
    num_prompt = completion = 0
    cached = cache_created = None
    first = True
    finished = False
    last: Any = None
    try:
        async for res in result_generator:
            last = res
            if res.prompt_token_ids is not None:
                num_prompt = len(res.prompt_token_ids) + len(res.encoder_prompt_token_ids or ())
            if first:
                prompt_ids = list(res.prompt_token_ids) if res.prompt_token_ids is not None else None
                cached, cache_created = res.num_cached_tokens, res.num_cache_creation_tokens
                role = serving.get_chat_request_role(request)
                choice = ChatCompletionResponseStreamChoice(
                    index=0, delta=DeltaMessage(role=role, content=""), logprobs=None, finish_reason=None
                )
                usage = running_usage(num_prompt, 0) if continuous else None
                head = chunk(choice, usage, prompt_token_ids=prompt_ids if with_ids else None, prompt_text=None)
                yield _frame(f"data: {head.model_dump_json(exclude_unset=True)}\n\n", prompt_ids, shows=False)
                first = False
            for output in res.outputs:
                if finished:
                    continue
                serving._raise_if_error(output.finish_reason, request_id)
                text = output.text
                tokens = list(output.token_ids)
                if not text and not tokens and not completion:
                    continue
                completion += len(tokens)
                token_ids = tokens if with_ids else None
                if output.finish_reason is None:
                    if template is None:
                        template = _content_template(with_ids, continuous, details)
                        filled = [json.dumps(v, ensure_ascii=False) for v in (request_id, model_name)]
                    data = template.fill(
                        json.dumps(text, ensure_ascii=False),
                        json.dumps(token_ids, separators=(",", ":")),
                        str(num_prompt),
                        str(completion),
                        str(num_prompt + completion),
                        *filled,
                        str(created),
                    )
                    yield _frame(f"data: {data}\n\n", None, tokens, shows=bool(text))
                    continue
                choice = ChatCompletionResponseStreamChoice(
                    index=0,
                    delta=DeltaMessage(content=text),
                    logprobs=None,
                    finish_reason=output.finish_reason or "stop",
                    stop_reason=output.stop_reason,
                    token_ids=token_ids,
                )
                end = chunk(choice, running_usage(num_prompt, completion) if continuous else None)
                if not include_usage and serving.system_fingerprint is not None:
                    end.system_fingerprint = serving.system_fingerprint
                finished = True
                yield _frame(f"data: {end.model_dump_json(exclude_unset=True)}\n\n", None, tokens)
        if include_usage:
            usage = running_usage(num_prompt, completion)
            usage.prompt_tokens_details = chat._make_prompt_tokens_details(
                serving.enable_prompt_tokens_details, cached, cache_created, mm_token_counts
            )
            metrics = None
            if serving.enable_per_request_metrics:
                metrics = chat.build_per_request_timing_metrics(last.metrics if last is not None else None, completion)
            spec = chat.build_spec_decoding_metrics(last)
            if spec is not None:
                metrics = metrics or chat.PerRequestMetrics()
                metrics.speculative_decoding = spec
            tail = chunk(None, usage, system_fingerprint=serving.system_fingerprint, metrics=metrics)
            yield f"data: {tail.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
        request_metadata.final_usage_info = running_usage(num_prompt, completion)
    except GenerationError as e:
        yield f"data: {serving._convert_generation_error_to_streaming_response(e)}\n\n"
    except Exception as e:
        chat.logger.exception("Error in chat completion stream generator.")
        yield f"data: {serving.create_streaming_error_response(e)}\n\n"
    yield "data: [DONE]\n\n"


def _content_template(with_ids: bool, continuous: bool, details: bool) -> _Template:
    """The frame vLLM writes for a step of text that does not end the answer, with holes (`_Template.fill`'s order:
    text, token ids, prompt / completion / total tokens, id, model, created)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )

    choice = ChatCompletionResponseStreamChoice(
        index=0,
        delta=DeltaMessage(content=_TEXT),
        logprobs=None,
        finish_reason=None,
        token_ids=[_IDS] if with_ids else None,
    )
    made = ChatCompletionStreamResponse(
        id=_ID, object="chat.completion.chunk", created=_CREATED, choices=[choice], model=_MODEL
    )
    if continuous:
        made.usage = _usage(_PROMPT, _COMPLETION, _TOTAL, details)
    holes = [json.dumps(_TEXT, ensure_ascii=False), f"[{_IDS}]", str(_PROMPT), str(_COMPLETION), str(_TOTAL)]
    holes += [json.dumps(_ID, ensure_ascii=False), json.dumps(_MODEL, ensure_ascii=False), str(_CREATED)]
    return _Template(made.model_dump_json(exclude_unset=True), holes)


def _usage(prompt: int, completion: int, total: int, details: bool) -> Any:
    """vLLM's UsageInfo as its chat stream sets it (reasoning-token details only where a reasoning parser runs)."""
    from vllm.entrypoints.openai.chat_completion import serving as chat
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=total,
        completion_tokens_details=chat._make_completion_tokens_details(0) if details else None,
    )
