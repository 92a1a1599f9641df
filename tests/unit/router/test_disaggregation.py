"""Conditional disaggregation (router/openai/disaggregation.py): which whole prompts go through a prefill replica."""

from __future__ import annotations

import re
from typing import Any

import pytest

from core.config import AppConfig
from local_models.llm import DEFAULT_DIR
from router.openai.disaggregation import Disaggregation

LONG_TEXT = " ".join(f"word{i} and some more text" for i in range(200))  # well over 256 tokens


class FakeTokenizer:
    """One token per word (and per template marker); records what it was asked to tokenise."""

    def __init__(self, batch_encoding: bool = True) -> None:
        self.batch_encoding = batch_encoding  # transformers 5 returns a BatchEncoding, older ones a list
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return list(range(len(re.findall(r"\S+", text)) + 1))  # + BOS

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool) -> Any:
        assert tokenize and add_generation_prompt
        self.calls += 1
        ids = [0] * (sum(len(str(m["content"]).split()) + 3 for m in messages) + 3)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if self.batch_encoding else ids


class BrokenTokenizer:
    def encode(self, text: str) -> list[int]:
        raise ValueError("no")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("an unusual template")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if (DEFAULT_DIR / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(DEFAULT_DIR)
    return FakeTokenizer()


def disaggregation(tokenizer: Any, min_prompt_tokens: int = 256, max_inflight: int | None = 32) -> Disaggregation:
    config = {"min_prompt_tokens": min_prompt_tokens, "max_inflight_prefills": max_inflight}
    d = Disaggregation(AppConfig.model_validate({"router": {"disaggregation": config}}))
    d.tokenizer = tokenizer
    return d


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]}


def test_short_prompts_are_prefilled_by_decode(tokenizer: Any) -> None:
    d = disaggregation(tokenizer)
    assert d.choose("chat", chat("Hello there")) == ("decode", "short")
    assert d.choose("completion", {"prompt": "Once upon a time"}) == ("decode", "short")


def test_long_prompts_go_through_prefill(tokenizer: Any) -> None:
    d = disaggregation(tokenizer)
    assert d.choose("chat", chat(LONG_TEXT)) == ("prefill", "long")
    assert d.choose("completion", {"prompt": LONG_TEXT}) == ("prefill", "long")


def test_prompt_tokens_counts_what_the_engine_will_see(tokenizer: Any) -> None:
    d = disaggregation(tokenizer)
    body = chat("Hello there")
    rendered = tokenizer.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert d.prompt_tokens("chat", body) == len(ids) > 2
    assert d.prompt_tokens("completion", {"prompt": "Once upon a time"}) == len(tokenizer.encode("Once upon a time"))


@pytest.mark.parametrize("batch_encoding", [True, False])
def test_chat_template_results_of_either_shape(batch_encoding: bool) -> None:
    d = disaggregation(FakeTokenizer(batch_encoding), min_prompt_tokens=10)
    assert d.prompt_tokens("chat", {"messages": [{"role": "user", "content": "one two"}]}) == 8
    assert d.choose("chat", {"messages": [{"role": "user", "content": "one two"}]}) == ("decode", "short")


def test_token_id_prompts_are_counted_without_the_tokenizer() -> None:
    fake = FakeTokenizer()
    d = disaggregation(fake)
    assert d.choose("completion", {"prompt": list(range(255))}) == ("decode", "short")
    assert d.choose("completion", {"prompt": list(range(256))}) == ("prefill", "long")  # the threshold itself
    assert fake.calls == 0


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("completion", {"prompt": "x " * (40 * 1024)}),  # over 64 KiB: long enough without counting
        ("chat", {"messages": [{"role": "user", "content": "x " * (40 * 1024)}]}),
        ("completion", {"prompt": [[1, 2], [3]]}),  # a batch of prompts
        ("completion", {"prompt": []}),
        ("chat", {"messages": "not a list"}),
    ],
    ids=["long-completion", "long-chat", "batch", "empty", "bad-messages"],
)
def test_prompts_not_worth_counting_go_through_prefill(endpoint: str, body: dict[str, Any]) -> None:
    fake = FakeTokenizer()
    d = disaggregation(fake)
    assert d.prompt_tokens(endpoint, body) is None
    assert d.choose(endpoint, body) == ("prefill", "long")
    assert fake.calls == 0


def test_zero_min_prompt_tokens_always_disaggregates() -> None:
    broken = BrokenTokenizer()  # never asked
    d = disaggregation(broken, min_prompt_tokens=0)
    assert d.choose("chat", chat("Hi")) == ("prefill", "long")
    assert d.choose("completion", {"prompt": [1]}) == ("prefill", "long")
    d.start()  # nothing to load: no tokenizer is needed
    assert d._loading is None


def test_without_a_tokenizer_every_prompt_goes_through_prefill() -> None:
    d = disaggregation(None)
    assert d.prompt_tokens("chat", chat("Hi")) is None
    assert d.choose("chat", chat("Hi")) == ("prefill", "long")
    assert d.choose("completion", {"prompt": "Hi"}) == ("prefill", "long")


def test_a_tokenizer_error_lets_the_engines_judge() -> None:
    d = disaggregation(BrokenTokenizer())
    assert d.choose("chat", chat("Hi")) == ("prefill", "long")
    # (a text prompt's bytes bound its tokens: two bytes are short whatever the tokenizer)
    assert d.choose("completion", {"prompt": "Hi"}) == ("decode", "short")
    assert d.choose("completion", {"prompt": "Hi " * 200}) == ("prefill", "long")


class Counting:
    """A real tokenizer that counts how often it tokenizes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.tokenized, self.rendered = tokenizer, 0, 0

    def apply_chat_template(self, messages: Any, tokenize: bool, **kwargs: Any) -> Any:
        self.tokenized += tokenize
        self.rendered += 1
        return self.tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)

    def encode(self, text: str) -> list[int]:
        self.tokenized += 1
        return self.tokenizer.encode(text)


def test_a_prompt_shorter_in_bytes_than_the_threshold_is_not_tokenized(tokenizer: Any) -> None:
    """Tokens stand for at least a byte each (but for a few the tokenizer adds): the rendered prompt's bytes decide
    a short prompt; only one that is not that short is tokenized, and then decided by its tokens."""
    if isinstance(tokenizer, FakeTokenizer):
        pytest.skip("needs the local model's tokenizer (made by `make models`)")
    counting = Counting(tokenizer)
    d = disaggregation(counting, min_prompt_tokens=256)
    assert d.choose("chat", chat("Hi")) == ("decode", "short") and counting.tokenized == 0
    assert d.choose("completion", {"prompt": "Once upon a time"}) == ("decode", "short") and counting.tokenized == 0
    # ~250 bytes of words the tokenizer merges into far fewer tokens: counted, and short
    words = chat("the " * 60)
    assert (d.at_most("chat", words) or 256) >= 256
    assert d.choose("chat", words) == ("decode", "short") and counting.tokenized == 1
    assert d.prompt_tokens("chat", words) < 256
    for text in ("x" * 300, "é" * 200, "the " * 300):  # never decided short by a bound below the real count
        bound = d.at_most("chat", chat(text))
        assert bound is None or bound >= d.prompt_tokens("chat", chat(text)) or bound >= 256


def test_busy_prefill_sends_prompts_to_decode(tokenizer: Any) -> None:
    d = disaggregation(tokenizer, max_inflight=2)
    long_body = chat(LONG_TEXT)
    with d.prefilling():
        assert d.inflight == 1
        assert d.choose("chat", long_body) == ("prefill", "long")
        with d.prefilling():
            assert d.choose("chat", long_body) == ("decode", "prefill_busy")
            assert d.choose("chat", chat("Hi")) == ("decode", "short")  # short first
        assert d.choose("chat", long_body) == ("prefill", "long")
    assert d.inflight == 0


def test_prefilling_counts_down_when_the_prefill_fails(tokenizer: Any) -> None:
    d = disaggregation(tokenizer, max_inflight=1)
    with pytest.raises(RuntimeError), d.prefilling():
        assert d.choose("completion", {"prompt": LONG_TEXT}) == ("decode", "prefill_busy")
        raise RuntimeError("prefill replica died")
    assert d.inflight == 0
    assert d.choose("completion", {"prompt": LONG_TEXT}) == ("prefill", "long")


def test_no_in_flight_limit(tokenizer: Any) -> None:
    d = disaggregation(tokenizer, min_prompt_tokens=0, max_inflight=None)
    d.inflight = 10_000
    assert d.choose("chat", chat("Hi")) == ("prefill", "long")


def test_count_never_raises() -> None:
    Disaggregation.count("decode", "short")
    Disaggregation.count("prefill", "long")


def test_short_prompts_go_through_prefill_while_every_decode_replica_is_busy(tokenizer: Any) -> None:
    """Decode's engine is the bottleneck under load: a short prompt computed there slows every stream it runs."""
    decode: list[dict[str, Any]] = [{"active_streams": 16}, {"active_streams": 20}]
    d = disaggregation(tokenizer)
    d.stats = lambda name: decode if name == "decode" else None
    assert d.choose("chat", chat("Hello there")) == ("prefill", "decode_busy")
    decode[0]["active_streams"] = 15  # one decode replica has room
    assert d.choose("chat", chat("Hello there")) == ("decode", "short")
    decode[0]["active_streams"] = 99
    d.config.decode_busy_streams = None
    assert d.choose("chat", chat("Hello there")) == ("decode", "short")
    d.config.decode_busy_streams, d.inflight = 16, 32  # prefill busy too: decode computes it after all
    assert d.choose("chat", chat("Hello there")) == ("decode", "prefill_busy")


def test_a_plain_conversations_bound_renders_its_template_once_per_shape(tokenizer: Any) -> None:
    """The router bounds a chat prompt's bytes without rendering it: the template is rendered once per shape of
    conversation (roles, names), and for a template that writes contents as they are the bound is never below the
    rendered prompt's bytes; a text already at the threshold, an unknown role or a long conversation is not
    rendered for a shape."""
    if isinstance(tokenizer, FakeTokenizer):
        pytest.skip("needs the local model's tokenizer (made by `make models`)")
    counting = Counting(tokenizer)
    d = disaggregation(counting, min_prompt_tokens=256)
    bodies = [chat(text) for text in ("Hi", "é" * 40, "Hello there, how are you?", "")]
    for body in bodies:
        rendered = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        assert d.at_most("chat", body) >= len(rendered.encode())
    assert counting.rendered == 1  # (one shape: system, user)
    named = {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}
    assert d.at_most("chat", named) is not None and counting.rendered == 2
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    d.at_most("chat", parts)  # (content parts: rendered as a whole, as before)
    assert counting.rendered == 3
    assert d._chat_bytes(chat("y" * 300)) == len("Be brief.") + 300 and counting.rendered == 3
    assert d._chat_bytes({"messages": [{"role": "narrator", "content": "Hi"}]}) is None
    assert d._chat_bytes({"messages": [{"role": "user", "content": ""}] * 65}) is None
    assert len(d._template_bytes) == 2
