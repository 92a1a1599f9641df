"""Make the project's generated local models, used for development, tests and benchmarks.

Llama-architecture checkpoints with seeded random weights and a byte-level BPE tokenizer trained on
Python's own standard library sources (text that is on every machine that runs this project), with a
ChatML chat template, saved in Hugging Face format. vLLM loads them with exactly the code that loads any
real model; users name a real model (hub id or path) in the config instead.

- `local:tiny-llama` (models/tiny-llama): 2 layers, 128 wide, float32. Fast enough for every test.
- `local:tiny-llama-tools` (models/tiny-llama-tools): the tiny model fitted at build time to answer a few
  conversations with tool calls (local_models/tools_fit.py), for `tool_choice: "auto"` end to end.
- `local:medium-llama` (models/medium-llama): 8 layers, 512 wide (4 attention heads of 64, 2 KV heads),
  bfloat16, 4,096 positions. Big enough that prefill costs real time on vLLM's CPU backend (a 3,000-token
  prompt takes about a second on one core), for benchmarks where compute and KV memory matter
  (bench/pressure.py). KV cache: 4,096 bytes per token (512 KiB per 128-token CPU block).

All share the tokenizer (same training, same vocabulary) and the chat template.

    python -m local_models.llm [--model NAME ... | all] [--out DIR] [--force]

From code: `make_local_model()` (tiny-llama), `make_local_model("medium-llama")`, or by config name:
`LOCAL_MODELS["local:medium-llama"]()` returns the model's directory, built on first use.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sysconfig
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_DIR = MODELS_DIR / "tiny-llama"
VERSION = 2  # bump when the recipe changes, so stale copies are rebuilt

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# ChatML, with tools in the Hermes format (Qwen 2.5's, NousResearch's): the tools' signatures in the system turn,
# an assistant's calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what vLLM's `hermes`
# parser reads back), a tool's result in a `tool` turn. Without tools it renders exactly as plain ChatML.
# (Transformers compiles templates with `trim_blocks`: a newline right after a `{% ... %}` tag is dropped.)
_TOOLS_SYSTEM = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
)
_TOOL_CALLS = (
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}}"
    "\n</tool_call>{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}<|im_end|>\n"
)
CHAT_TEMPLATE = (
    _TOOLS_SYSTEM + "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # (in the tools' system turn above)
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}" + _TOOL_CALLS + ""
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>tool\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 2048
CORPUS_BYTES = 4_000_000
SEED = 1234


@dataclass(frozen=True)
class LocalModelSpec:
    """The shape of one generated model. The tokenizer and chat template are the same for all."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str  # what the weights are saved in, and the dtype to serve them in
    max_position_embeddings: int = 4096
    # Per-head width; default hidden_size // num_attention_heads. Set it to make attention narrower than the
    # residual stream (fewer heads of the usual width), as Mistral/Gemma-style configs do.
    attention_head_dim: int | None = None
    initializer_range: float = 0.5  # wide weights: greedy output varies instead of repeating one token
    fit: str | None = None  # "tools": trained at build time to call tools (local_models/tools_fit.py)
    version: int = VERSION

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token: K and V, every layer, every KV head."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    def served_here(self) -> LocalModelSpec:
        """The spec as this machine serves it: a bfloat16 model in float32 on a CPU that does not compute
        bfloat16 natively (vLLM's CPU backend prefilled ~140 tokens/s in bfloat16 on an AVX2-only EPYC against
        ~1,000 in float32; one with AVX-512 BF16 does ~3,000 in bfloat16), so that a benchmark's prefill costs
        about what it was sized for."""
        if self.dtype == "bfloat16" and not native_bf16():
            return replace(self, dtype="float32")
        return self


_TINY = LocalModelSpec(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    dtype="float32",
)
SPECS: dict[str, LocalModelSpec] = {
    "tiny-llama": _TINY,
    # The tiny model, fitted to answer a few conversations with tool calls (`tool_choice: "auto"` end to end);
    # initialised at the usual scale: wide random weights would fight the fitting.
    "tiny-llama-tools": replace(_TINY, initializer_range=0.02, fit="tools", version=4),  # (4: local_models/fit.py)
    # Sized so that a 3,000-token prefill takes about a second on one core of the development machines
    # (vLLM CPU backend, bfloat16 with AVX-512 BF16); see docs/benchmarks.md (pressure.py) for the measurement.
    # Attention is 4 heads of 64 (narrower than the 512-wide residual stream) with 2 KV heads: at 3,000
    # tokens attention is about half of the prefill time, and this keeps the total near one second.
    "medium-llama": LocalModelSpec(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_head_dim=64,
        dtype="bfloat16",
        initializer_range=0.05,
    ),
}


@functools.cache
def native_bf16() -> bool:
    """Whether the engine here computes bfloat16 natively: a CUDA device, or a CPU with AVX-512 BF16 or AMX."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return True  # (not Linux: assume it does)
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def model_dir(name: str) -> Path:
    """Where `make_local_model(name)` puts the model (default location)."""
    return MODELS_DIR / _short(name)


def spec(name: str) -> LocalModelSpec:
    return SPECS[_short(name)]


def _short(name: str) -> str:
    short = name.removeprefix("local:")
    if short not in SPECS:
        raise ValueError(f"unknown local model {name!r}; known: {', '.join(SPECS)}")
    return short


def _corpus() -> list[str]:
    """Deterministic text: the standard library's sources in sorted order, up to CORPUS_BYTES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= CORPUS_BYTES:
            break
    return texts


def _train_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _fingerprint(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        h.update((out / name).read_bytes())
    return h.hexdigest()[:16]


def make_local_model(name: str | Path = "tiny-llama", force: bool = False, *, out: Path | None = None) -> Path:
    """Build the named local model into `out` (default models/<name>) unless an up-to-date copy is there.

    `name` is "tiny-llama" or "medium-llama" (a "local:" prefix is accepted). For backward compatibility a
    Path as the first argument is taken as `out` for tiny-llama. Returns the model's directory.
    """
    if isinstance(name, Path):
        name, out = "tiny-llama", name
    short = _short(name)
    s = SPECS[short]
    out = Path(out) if out is not None else MODELS_DIR / short

    stamp = out / "local_model.json"
    if not force and stamp.exists():
        made = json.loads(stamp.read_text())
        # Older stamps (tiny-llama's first recipe) carry no spec: the version alone decides.
        if made.get("version") == s.version and made.get("spec", asdict(s)) == asdict(s):
            return out

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        **({"head_dim": s.attention_head_dim} if s.attention_head_dim else {}),
        max_position_embeddings=s.max_position_embeddings,
        initializer_range=s.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=s.dtype,
    )
    torch.manual_seed(SEED)
    # Initialise in float32 (the same random stream for every dtype), then cast for saving.
    model = LlamaForCausalLM(config).to(torch.float32)
    report = None
    if s.fit == "tools":
        from local_models.tools_fit import fit_tool_calls

        report = fit_tool_calls(model, tokenizer)
    model = model.to(getattr(torch, s.dtype))
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    stamp.write_text(
        json.dumps(
            {
                "version": s.version,
                "name": f"local:{short}",
                "fingerprint": _fingerprint(out),
                "kv_bytes_per_token": s.kv_bytes_per_token,
                "spec": asdict(s),
                **({"fit": report} if report else {}),
            }
        )
    )
    return out


# Config name -> a callable that builds (if needed) and returns the model's directory. `resolve_model` can
# serve every generated model with: `if model in LOCAL_MODELS: return str(LOCAL_MODELS[model]())`.
LOCAL_MODELS: dict[str, Callable[[], Path]] = {
    f"local:{short}": functools.partial(make_local_model, short) for short in SPECS
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", nargs="+", default=["tiny-llama"], choices=[*SPECS, "all"], help="which models to make"
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory (default models/<model>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    names = list(SPECS) if "all" in args.model else args.model
    if args.out is not None and len(names) > 1:
        parser.error("--out needs a single --model")
    for name in names:
        path = make_local_model(name, force=args.force, out=args.out)
        print(f"local model ready at {path} ({json.loads((path / 'local_model.json').read_text())})")


if __name__ == "__main__":
    main()


def resolve_model(model: str) -> str:
    """`local:tiny-llama` and the project's other generated models (built on first use); anything else is a hub id
    or a path."""
    if model in LOCAL_MODELS:
        return str(LOCAL_MODELS[model]())
    return model
