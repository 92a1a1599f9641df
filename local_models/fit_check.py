"""Fit each fitted local model under every CPU kernel path torch runs here, and check what each fit decodes.

A fit's trajectory depends on the floating point of the kernels torch picks, so a fit that converges on one machine
may not on another (local_models/fit.py). `ATEN_CPU_CAPABILITY` forces torch onto a path (`default`, `avx2`,
`avx512`) at import, so one machine can try them all: each (model, path) is built in a subprocess under that
path, then decoded greedily there with transformers (every example's answer, every clip's transcript). `--vllm`
also decodes each saved model with vLLM, as the app serves it.

    python -m local_models.fit_check [--paths default avx2 avx512] [--models tiny-llama-tools tiny-whisper] [--vllm]

Prints a line per (model, path) and a JSON summary; exits non-zero if any fit or decode fails. `make test` runs it
(tests/unit/local_models/test_fit_paths.py) for the paths other than the one `make models` built with.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PATHS = ("default", "avx2", "avx512")
MODELS = ("tiny-llama-tools", "tiny-whisper")
MODULE = "local_models.fit_check"  # (not __name__: "__main__" when run with -m)


def _python(args: list[str], path: str | None, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python args` under kernel path `path`; past `timeout` its whole process group is killed (vLLM's engine
    processes with it) and it returns code -9 with "timed out" as its last line of stderr."""
    env = dict(os.environ)
    if path:
        env["ATEN_CPU_CAPABILITY"] = path
    with subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            return subprocess.CompletedProcess(child.args, -9, out, f"{err}\ntimed out after {timeout:.0f} s")
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def _tail(done: subprocess.CompletedProcess[str], lines: int = 3) -> list[str]:
    return (done.stdout.strip().splitlines() + done.stderr.strip().splitlines())[-lines:] or ["no output"]


# A kernel of the dispatched path runs before the capability is printed: under a hypervisor that hides AVX-512 from
# the OS (no avx512 flags in /proc/cpuinfo) while CPUID still names it, torch reports AVX512 when asked for it and
# then dies of SIGILL in its first vectorized kernel, so a path counts only once its kernels ran.
_KERNEL = "torch.softmax(torch.randn(64, 64), -1).sum().item()"
_PROBE = f"import torch; {_KERNEL}; print(torch.backends.cpu.get_cpu_capability())"


def capability_under(path: str) -> str:
    """The capability torch runs when `path` is asked for: the path itself, or what torch fell back to; "" when
    its kernels cannot run here."""
    done = _python(["-c", _PROBE], path, 120)
    return done.stdout.strip().lower() if done.returncode == 0 else ""


def available_paths() -> list[str]:
    """The kernel paths torch can run on this CPU."""
    return [path for path in PATHS if capability_under(path) == path]


def native_path() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def build_and_decode(model: str, out: Path) -> dict[str, Any]:
    """(In the worker, under the forced path) build `model` into `out` and decode its targets with transformers."""
    from local_models.fit import capability

    started = time.monotonic()
    if model == "tiny-whisper":
        from local_models.whisper import make_speech_model

        make_speech_model(force=True, out=out)
        failures = decode_whisper(out)
    else:
        from local_models.llm import make_local_model

        make_local_model(model, force=True, out=out)
        failures = decode_tools(out)
    stamp = json.loads((out / "local_model.json").read_text())
    return {
        "model": model,
        "capability": capability(),
        "fit": stamp.get("fit"),
        "fingerprint": stamp["fingerprint"],
        "failures": failures,
        "seconds": round(time.monotonic() - started, 1),
    }


def decode_tools(out: Path) -> list[str]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from local_models.tools_fit import prompts

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    failures = []
    for prompt_ids, answer in prompts(tokenizer):
        want = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            got = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=len(want), do_sample=False, eos_token_id=None
            )[0, len(prompt_ids) :].tolist()
        if got != want:
            failures.append(f"{answer[:40]!r}: got {tokenizer.decode(got)[:80]!r}")
    return failures


def decode_whisper(out: Path) -> list[str]:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from local_models.whisper import SENTENCES, Cut, load_sample, transcribe

    model = WhisperForConditionalGeneration.from_pretrained(out).eval()
    processor = WhisperProcessor.from_pretrained(out)
    rng = __import__("numpy").random.default_rng(0)
    failures = []
    for slug, text in SENTENCES.items():
        for cut in (Cut(), Cut(pre_ms=300, post_ms=600), Cut(pre_ms=300, post_ms=600, rate=24_000)):
            got = transcribe(model, processor, cut.apply(load_sample(slug), rng)).strip()
            if got != text:
                failures.append(f"{slug} {cut}: got {got!r}")
    return failures


def vllm_decode_tools(out: Path) -> list[str]:
    """(In a worker) greedy answers of every example from vLLM, as the app serves the model."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from local_models.tools_fit import prompts

    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=1024)
    cases = prompts(llm.get_tokenizer())
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids, _ in cases], SamplingParams(temperature=0, max_tokens=200)
    )
    return [
        f"{answer[:40]!r}: got {o.outputs[0].text[:80]!r} ({o.outputs[0].finish_reason})"
        for (_, answer), o in zip(cases, outputs, strict=True)
        if o.outputs[0].text != answer or o.outputs[0].finish_reason != "stop"
    ]


def check(paths: list[str], models: list[str], out: Path, vllm: bool, parallel: int = 2) -> list[dict[str, Any]]:
    """Build and decode every (model, path), `parallel` at a time (each fit uses one thread)."""

    def one(job: tuple[str, str]) -> dict[str, Any]:
        model, path = job
        where = out / f"{model}-{path}"
        done = _python(["-m", MODULE, "--worker", model, "--out", str(where)], path, 1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            return {"model": model, "path": path, "ok": False, "error": " | ".join(_tail(done))}
        result = json.loads(lines[-1]) | {"path": path}
        if vllm:
            checked = (
                _python(["-m", "local_models.whisper_check", "--model", str(where)], None, 900)
                if (model == "tiny-whisper")
                else _python(["-m", MODULE, "--vllm-worker", "--out", str(where)], None, 900)
            )
            result["vllm"] = "exact" if checked.returncode == 0 else _tail(checked)
        result["ok"] = not result["failures"] and result.get("vllm", "exact") == "exact"
        return result

    jobs = [(model, path) for model in models for path in paths]
    with ThreadPoolExecutor(parallel) as pool:
        results = []
        for result in pool.map(one, jobs):
            fit = result.get("fit") or {}
            print(
                f"{'ok  ' if result['ok'] else 'FAIL'} {result['model']:18} {result['path']:8} "
                f"{result.get('capability', '')}: {fit.get('steps', '-')} steps (attempt {fit.get('attempt', '-')}), "
                f"margin {fit.get('margin', '-')}, {result.get('seconds', '-')} s; "
                f"{len(result.get('failures', []))} decode failures; vLLM {result.get('vllm', 'not run')}"
                + (f"; {result['error']}" if "error" in result else ""),
                flush=True,
            )
            results.append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=None, help="kernel paths (default: every one this CPU runs)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--vllm", action="store_true", help="also decode each saved model with vLLM")
    parser.add_argument("--out", type=Path, default=None, help="where the builds go (default: a temporary folder)")
    parser.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(build_and_decode(args.worker, args.out)))
        return 0
    if args.vllm_worker:
        failures = vllm_decode_tools(args.out)
        print("\n".join(failures) or "exact")
        return 1 if failures else 0
    paths = args.paths or available_paths()
    with tempfile.TemporaryDirectory() as scratch:
        results = check(paths, args.models, args.out or Path(scratch), args.vllm)
    print(json.dumps({"native": native_path(), "paths": paths, "results": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":  # (vLLM spawns processes that import this module)
    sys.exit(main())
