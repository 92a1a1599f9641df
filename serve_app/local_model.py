"""Make the small local model used for development and tests.

A Llama-architecture checkpoint with seeded random weights and a byte-level BPE tokenizer trained on
Python's own standard library sources (text that is on every machine that runs this project), with a
ChatML chat template, saved in Hugging Face format. vLLM loads it with exactly the code that loads any real
model; users name a real model (hub id or path) in the config instead.

    python -m serve_app.local_model [--out models/tiny-llama]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
VERSION = 1  # bump when the recipe changes, so stale copies are rebuilt

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 2048
CORPUS_BYTES = 4_000_000
SEED = 1234


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


def make_local_model(out: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Build the model into `out` unless an up-to-date copy is there. Returns `out`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    stamp = out / "local_model.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("version") == VERSION:
        return out
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.5,  # wide weights: greedy output varies instead of repeating one token
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    stamp.write_text(json.dumps({"version": VERSION, "fingerprint": _fingerprint(out)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    path = make_local_model(args.out, force=args.force)
    print(f"local model ready at {path} ({json.loads((path / 'local_model.json').read_text())})")


if __name__ == "__main__":
    main()
