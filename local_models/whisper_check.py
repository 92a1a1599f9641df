"""Check `local:tiny-whisper` in vLLM itself: every sample clip, as is and padded with silence, transcribes exactly.

The build verifies the fit with transformers in float32; this loads the built folder with vLLM's ordinary loader
and CPU kernels, as the speech deployment serves it, and decodes greedily with vLLM's own Whisper prompt. Also:
silence and faint noise give "", and (`--cuts N`) N more random VAD-like cuts per clip, drawn with a seed the fit
never used. Slow (vLLM starts in ~20 s), so not part of the unit tests:

    python -m local_models.whisper_check [--model DIR] [--cuts N]

Prints one line per case and exits non-zero if any transcript differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from local_models.whisper import DECODER_PROMPT, RATE, SENTENCES, Cut, load_sample, make_speech_model, random_cuts

CHECK_SEED = 99  # (the fit draws its cuts with SEED and SEED + 1)


def cases(extra_cuts: int) -> list[tuple[str, str, np.ndarray]]:
    """(slug, description, audio): each clip plain, with 300 ms before / 600 ms after, sent at 24 kHz (`Cut.rate`),
    and `extra_cuts` random cuts; then silences, whose transcript is ""."""
    rng = np.random.default_rng(CHECK_SEED)
    out = []
    for slug in SENTENCES:
        clip = load_sample(slug)
        fixed = [Cut(), Cut(pre_ms=300, post_ms=600), Cut(pre_ms=100, post_ms=100, rate=24_000)]
        for cut in [*fixed, *random_cuts(rng, extra_cuts)]:
            kind = f"{cut.pre_ms}/{cut.post_ms} ms, -{cut.trim_start_ms}/-{cut.trim_end_ms} ms, noise {cut.noise:g}"
            out.append((slug, f"{kind}, {cut.rate // 1000} kHz", cut.apply(clip, rng)))
    out.append(("silence", "zeros 1 s", np.zeros(RATE, np.float32)))
    for level in (3e-5, 1e-4, 1e-3):
        out.append(
            ("silence", f"noise {level:g} 1.5 s", (level * rng.standard_normal(RATE * 3 // 2)).astype(np.float32))
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: build/reuse models/tiny-whisper)")
    parser.add_argument("--cuts", type=int, default=0, help="random VAD-like cuts per clip, besides the three fixed")
    args = parser.parse_args()
    model = args.model or str(make_speech_model())
    # One KV-cache GiB and no core pinning: a check beside whatever else runs on the machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=512,  # >= max_source_positions (250): one window's encoder input in one step
        limit_mm_per_prompt={"audio": 1},
        # (max_model_len: vLLM derives it from the decoder's positions, max_target_positions = 128)
    )
    print(f"loaded in {time.monotonic() - started:.1f} s")
    todo = cases(args.cuts)
    prompts = [
        {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (audio, RATE)}},
            "decoder_prompt": DECODER_PROMPT,
        }
        for _, _, audio in todo
    ]
    started = time.monotonic()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    print(f"{len(todo)} transcripts in {time.monotonic() - started:.2f} s")
    tokenizer = llm.get_tokenizer()
    want_prompt = tokenizer(DECODER_PROMPT, add_special_tokens=False).input_ids
    print(f"decoder prompt ids {outputs[0].prompt_token_ids} (expected {want_prompt})")
    prompt_ok = all(out.prompt_token_ids == want_prompt for out in outputs)
    failed = 0
    for (slug, kind, _), out in zip(todo, outputs, strict=True):
        got = out.outputs[0].text
        ok = got.strip() == SENTENCES.get(slug, "")
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {slug:16} {kind:40} {got!r}")
    print(f"{len(todo) - failed}/{len(todo)} exact; decoder prompts {'as expected' if prompt_ok else 'DIFFER'}")
    return 1 if failed or not prompt_ok else 0


if __name__ == "__main__":  # (vLLM spawns worker processes that import this module)
    sys.exit(main())
