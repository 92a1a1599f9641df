"""Conditional disaggregation: whether a request's prompt is prefilled on a prefill replica or by decode.

As in Dynamo and llm-d, disaggregation is a per-request decision. A short prompt costs less to compute on
decode than to prefill elsewhere and move over NIXL (which moves whole blocks only), unless decode is the
bottleneck (every decode replica runs `decode_busy_streams` streams: its replicas' routing stats); and when
prefill is the bottleneck (this router already waits on many prefills, or a prefill replica refuses for
capacity) decode computes the prompt rather than queue it. Streaming-input sessions always hand off: their KV is
already on their prefill replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

from core import metrics
from core.config import AppConfig, DisaggregationConfig
from core.placement import pool_stats
from core.protocol import Endpoint

logger = logging.getLogger(__name__)
Where = Literal["prefill", "decode"]
_CHARS_PER_TOKEN_MAX = 16  # a prompt this many characters per threshold token is long without counting
# A token stands for at least one byte of the rendered prompt, but for what the tokenizer adds around it (a BOS, a
# SentencePiece prefix space): a prompt of fewer bytes than the threshold by this margin is short without counting.
_ADDED_TOKENS_MAX = 16
_PLAIN = {"role", "content", "name"}  # a message's keys whose rendered bytes `_chat_bytes` bounds
_ROLES = {"system", "developer", "user", "assistant", "tool"}  # (any other role is rendered whole, as before)
_SHAPE_MESSAGES_MAX = 64  # a longer conversation is rendered whole (one shape each would fill the cache)
_SHAPES_KEPT = 1024  # chat templates' own bytes, by the conversation's shape (`Disaggregation._template_bytes`)


class Disaggregation:
    def __init__(self, app: AppConfig, stats: Callable[[str], list[dict[str, Any]] | None] = pool_stats) -> None:
        self.config: DisaggregationConfig = app.router.disaggregation
        self.app = app
        self.stats = stats
        self.inflight = 0
        self.tokenizer: Any = None
        self._loading: asyncio.Task[None] | None = None
        self._template_bytes: dict[tuple[tuple[str, bool], ...], int] = {}

    def start(self) -> None:
        """Load the tokenizer in the background (until it is there, every request is disaggregated)."""
        if self.config.min_prompt_tokens > 0 and self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(asyncio.to_thread(self._load))

    def _load(self) -> None:
        from transformers import AutoTokenizer

        from local_models.llm import resolve_model

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.app.tokenizer or resolve_model(self.app.model))
        except Exception:
            logger.exception("no tokenizer for conditional disaggregation: every request goes through prefill")

    def prompt_tokens(self, endpoint: Endpoint, body: dict[str, Any]) -> int | None:
        """The prompt's length in tokens (None: unknown, or too long to be worth counting)."""
        if self.tokenizer is None:
            return None
        # Tokenizing runs on the router's event loop: only prompts that could be short are counted.
        limit = min(64 * 1024, self.config.min_prompt_tokens * _CHARS_PER_TOKEN_MAX)
        try:
            if endpoint == "chat":
                ids = self._render(body, limit, tokenize=True)
                if ids is None:
                    return None
                return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            if isinstance(prompt, str) and len(prompt) <= limit:
                return len(self.tokenizer.encode(prompt))
        except Exception:  # an unusual template or content: let the engines judge the request
            return None
        return None

    def at_most(self, endpoint: Endpoint, body: dict[str, Any]) -> int | None:
        """A bound on the prompt's tokens without tokenizing it: its rendered bytes (None: unknown). Tokenizing on
        the router's event loop was 11-12% of its CPU under 128 streams of chats (py-spy), for a decision the bytes
        settle whenever the prompt is short; decode tokenizes it anyway."""
        if self.tokenizer is None:
            return None
        limit = self.config.min_prompt_tokens
        try:
            if endpoint == "chat" and (size := self._chat_bytes(body)) is not None:
                return size + _ADDED_TOKENS_MAX
            text = self._render(body, limit, tokenize=False) if endpoint == "chat" else body.get("prompt")
            if not isinstance(text, str):
                return None
            return len(text.encode()) + _ADDED_TOKENS_MAX
        except Exception:  # (prompt_tokens judges it, or the engines do)
            return None

    def _chat_bytes(self, body: dict[str, Any]) -> int | None:
        """A chat prompt's rendered bytes without rendering it (None: not a plain conversation): its messages' text
        plus what the template writes around them, rendered once per shape (roles, names) with one-character
        contents (a template that writes a tag only around non-empty content counts it). Rendering on the router's
        loop was ~4% of its CPU at 1-token answers (py-spy). A bound for templates that write the content as it is;
        one that adds text for some contents (a reasoning block re-wrapped) makes it a few bytes short: a prompt at
        the threshold may then be prefilled by decode, which costs a little time, never a wrong answer. A text
        already at the threshold is returned as it is (the caller counts its tokens), without rendering."""
        messages = body.get("messages")
        if body.get("tools") or not isinstance(messages, list) or not 0 < len(messages) <= _SHAPE_MESSAGES_MAX:
            return None
        shape: list[tuple[str, bool]] = []
        size = 0
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m.keys() <= _PLAIN:
                return None
            name, role = m.get("name"), m.get("role")
            if role not in _ROLES or (name is not None and not isinstance(name, str)):
                return None
            shape.append((role, name is not None))
            size += len(m["content"].encode()) + len((name or "").encode())
        if size + _ADDED_TOKENS_MAX >= self.config.min_prompt_tokens:
            return size  # (long enough without what the template adds)
        key = tuple(shape)
        if (around := self._template_bytes.get(key)) is None:
            dummy = [{"role": r, "content": "x", **({"name": "x"} if named else {})} for r, named in key]
            rendered = self.tokenizer.apply_chat_template(dummy, tokenize=False, add_generation_prompt=True)
            around = len(rendered.encode()) - sum(1 + named for _, named in key)
            if len(self._template_bytes) >= _SHAPES_KEPT:
                self._template_bytes.clear()
            self._template_bytes[key] = around
        return size + around

    def _render(self, body: dict[str, Any], limit: int, tokenize: bool) -> Any:
        """A chat request's prompt through the chat template, as text or ids (None: its messages are not a list, or
        they and its tools are over `limit` characters)."""
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or len(str(messages)) + len(str(tools or "")) > limit:
            return None
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True, **extra)

    def choose(self, endpoint: Endpoint, body: dict[str, Any]) -> tuple[Where, str]:
        """(where the prompt is prefilled, why)."""
        why = "long"
        if self.config.min_prompt_tokens > 0:
            tokens = self.at_most(endpoint, body)
            if tokens is None or tokens >= self.config.min_prompt_tokens:
                tokens = self.prompt_tokens(endpoint, body)
            if tokens is not None and tokens < self.config.min_prompt_tokens:
                if not self.decode_busy():
                    return "decode", "short"
                why = "decode_busy"
        if self.config.max_inflight_prefills is not None and self.inflight >= self.config.max_inflight_prefills:
            return "decode", "prefill_busy"
        return "prefill", why

    def decode_busy(self) -> bool:
        """Every decode replica runs `decode_busy_streams` streams or more (their last routing stats)."""
        threshold, decode = self.config.decode_busy_streams, self.stats("decode")
        if threshold is None or not decode:
            return False
        return all(isinstance(s.get("active_streams"), int) and s["active_streams"] >= threshold for s in decode)

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    @staticmethod
    def count(where: Where, why: str) -> None:
        metrics.inc(metrics.ROUTER_PREFILLS, 1, "where whole prompts were prefilled", where=where, reason=why)
