"""The benchmark suite against the Stream2LLM paper and the peers, in one command.

    .venv/bin/python bench/suite.py --quick        # every part, small: a smoke run of a few minutes
    .venv/bin/python bench/suite.py                # the full run: the figures in bench/README.md
    .venv/bin/python bench/suite.py --parts append update   # some parts only

Parts (`--parts`, default all):
- `append` and `update`: the paper's two workloads (bench/workloads.py: a web crawler's pages appended about
  0.7 s apart; a vector search's candidate documents rewritten about 37 ms apart), replayed open loop at each
  QPS against this app streaming (its default scheduler), this app with `on_end_only` (not streaming), and Ray
  Serve LLM's P/D app given the whole prompt once the last chunk is available (the peer), all on the larger
  local model (`local:medium-llama`) with the same engine settings. TTFT: last chunk available -> first token.
- `pressure`: the append workload with its delays multiplied (`--delay-multiplier`) against a prefill KV cache
  that holds only a few sessions (`--kv-sessions`): this app streaming under each policy (`--policies`)
  against the same app not streaming (`on_end_only`).
- `tokens`: the token path (bench/token_path.py at 32 and 128 streams: this app, a plain vLLM server and Ray
  Serve LLM on the config's model), for the token-streaming ratios.

Writes to `--out` (bench/results/): the workloads replayed (`workloads/*.json`), the raw results
(`suite-<stamp>.json`), `suite.md`, the plots and `summary.json` (bench/suite_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import replay
import suite_report
import systems
import workloads
import yaml
from tqdm import tqdm

from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "local:medium-llama"
MAX_MODEL_LEN = 4096
BLOCK_TOKENS = 128  # vLLM's CPU block size
PARTS = ("append", "update", "pressure", "tokens")


# ------------------------------------------------------------------------------------------- settings
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every part, small (a smoke run of a few minutes)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--queries", type=int, default=None, help="queries per append/update run (full 40, quick 6)")
    p.add_argument("--append-qps", type=float, nargs="+", default=None, help="full: 0.5 1.0; the last is headline")
    p.add_argument("--update-qps", type=float, nargs="+", default=None, help="full: 0.5 1.0; the last is headline")
    p.add_argument("--tokens-median", type=int, default=1800, help="median input tokens per query")
    p.add_argument("--pressure-queries", type=int, default=None, help="full 30, quick 6")
    p.add_argument("--pressure-qps", type=float, default=None, help="full 0.5, quick 1.0")
    p.add_argument("--delay-multiplier", type=float, default=None, help="pressure: full 4, quick 2")
    p.add_argument("--kv-sessions", type=float, default=3.5, help="pressure: prefill KV for this many sessions")
    p.add_argument("--policies", nargs="+", default=["fcfs", "lcas", "mcps"])
    p.add_argument("--answer-tokens", type=int, default=2, help="the paper times the first token only")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a query may take past its last chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "config.yaml")
    args = p.parse_args(argv)
    full = not args.quick
    args.queries = args.queries or (40 if full else 6)
    args.append_qps = args.append_qps or ([0.5, 1.0] if full else [1.0])
    args.update_qps = args.update_qps or ([0.5, 1.0] if full else [1.0])
    args.pressure_queries = args.pressure_queries or (30 if full else 6)
    args.pressure_qps = args.pressure_qps or (0.5 if full else 1.0)
    args.delay_multiplier = args.delay_multiplier or (4.0 if full else 2.0)
    return args


def app_args(args: argparse.Namespace, model_path: Path, dtype: str, prefill_kv_gb: float | None) -> dict[str, Any]:
    """configs/config.yaml's application args on the larger local model (and a small prefill KV cache for the
    pressure part)."""
    a = copy.deepcopy(yaml.safe_load(args.config.read_text())["applications"][0]["args"])
    a["model"] = MODEL
    engine = a.setdefault("engine", {})
    engine["max_model_len"], engine["dtype"] = MAX_MODEL_LEN, dtype
    if prefill_kv_gb is not None:
        a.setdefault("prefill", {}).setdefault("engine", {})["kv_cache_gb"] = prefill_kv_gb
    return a


def pressure_kv_gb(args: argparse.Namespace, kv_bytes_per_token: int) -> float:
    """Room for `--kv-sessions` sessions of the median size (never below one full-length request: vLLM's rule)."""
    tokens = args.tokens_median + 128  # + the chat template and the answer
    blocks = max(math.ceil(args.kv_sessions * tokens / BLOCK_TOKENS), math.ceil(MAX_MODEL_LEN / BLOCK_TOKENS) + 1)
    return blocks * BLOCK_TOKENS * kv_bytes_per_token / 2**30


# ------------------------------------------------------------------------------------------- workloads
def workload(args: argparse.Namespace, kind: str, qps: float, count_tokens: Any) -> tuple[workloads.Trace, Path]:
    """The trace for (kind, qps): generated once per seed and size and saved, so every system replays it."""
    pressure = kind == "pressure"
    queries = args.pressure_queries if pressure else args.queries
    delay = args.delay_multiplier if pressure else 1.0
    name = f"{kind}-q{qps:g}-n{queries}-s{args.seed}" + (f"-d{delay:g}" if pressure else "") + ".json"
    path = args.out / "workloads" / name
    if path.exists():
        return workloads.Trace.load(path), path
    trace = workloads.generate(
        "append" if pressure else kind,
        queries=queries,
        qps=qps,
        seed=args.seed,
        delay_multiplier=delay,
        tokens_median=args.tokens_median,
        count_tokens=count_tokens,
    )
    trace.kind = kind
    trace.save(path)
    return trace, path


def warm_up_trace() -> workloads.Trace:
    return workloads.generate("append", queries=2, qps=4.0, seed=10**6, tokens_median=600, tokens_min=300)


# ------------------------------------------------------------------------------------------- running
class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.runs: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def replay(self, system: systems.System, trace: workloads.Trace, label: str, mode: str) -> dict[str, Any]:
        desc = f"{trace.kind} q{trace.qps:g} {label}"
        with tqdm(total=len(trace.queries), desc=desc, unit="q", leave=True, file=sys.stdout) as bar:
            result = asyncio.run(
                replay.replay(
                    trace,
                    base=system.base,
                    model=system.model,
                    mode=mode,
                    answer_tokens=self.args.answer_tokens,
                    timeout_s=self.args.timeout,
                    progress=bar,
                )
            )
        ok = [t for t in result["ttft_ms"] if t is not None]
        p50 = sorted(ok)[len(ok) // 2] if ok else None
        print(
            f"  {desc}: {len(ok)}/{len(ok) + result['errors']} ok, P50 {'-' if p50 is None else f'{p50:.0f}'} ms, "
            f"completion {result['completion_s']:.1f}s, errors {result['error_kinds'] or 0}",
            flush=True,
        )
        run = {"workload": trace.kind, "qps": trace.qps, "system": label, **result}
        self.runs.append(run)
        return run

    def warm_up(self, system: systems.System, modes: list[str]) -> None:
        """A couple of short queries per mode, not counted: the first requests after start-up are slow."""
        for mode in modes:
            result = asyncio.run(replay.replay(warm_up_trace(), base=system.base, model=system.model, mode=mode))
            if result["errors"]:
                self.notes.append(f"warm-up of {system.name} ({mode}) had errors: {result['error_samples']}")


@contextlib.contextmanager
def started(name: str, factory: Any) -> Iterator[systems.System]:
    t = time.perf_counter()
    print(f"== starting {name}", flush=True)
    with factory as system:
        print(f"  {name} up in {time.perf_counter() - t:.0f}s", flush=True)
        yield system


def idle(timeout: float = 120.0) -> None:
    """Until the app's prefill engine runs nothing (the runs must not overlap)."""
    from pressure import wait_idle

    wait_idle(timeout)
    time.sleep(1.0)


def configure(policy: str) -> dict[str, Any]:
    from pressure import prefill_call

    try:
        return {"ok": prefill_call("configure_scheduler", timeout=600, policy=policy)}
    except Exception as e:  # noqa: BLE001 - recorded: the run is then under whatever policy was set
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def token_streaming(args: argparse.Namespace) -> dict[str, Any] | None:
    """bench/token_path.py in its own process (its systems start their own Ray); its results JSON."""
    tag = "suite_token_path"
    argv = ["--systems", "app", "plain", "rayllm", "--session-concurrency", "--tag", tag]
    argv += ["--quick"] if args.quick else ["--concurrency", "32", "128"]
    before = set(RESULTS.glob(f"{tag}-*.json"))
    print(f"== tokens: bench/token_path.py {' '.join(argv)}", flush=True)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "token_path.py"), *argv], cwd=ROOT)
    made = sorted(set(RESULTS.glob(f"{tag}-*.json")) - before)
    if done.returncode != 0 or not made:
        return None
    return json.loads(made[-1].read_text())


def provenance(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from token_path import machine

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    m = machine()
    return {
        "command": shlex.join(["python", "bench/suite.py", *argv]),
        "commit": commit.stdout.strip(),
        "machine": f"{m['nproc']} cores, {m['cpu_model']}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
    }


def main(argv: list[str] | None = None) -> dict[str, Path]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from serve_app.local_model import make_local_model, spec

    started_at = time.perf_counter()
    model_path = make_local_model("medium-llama")
    s = spec("medium-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    runner = Runner(args)
    raw: dict[str, Any] = {
        "provenance": provenance(args, argv),
        "model": {"name": MODEL, "path": str(model_path), "spec": s.__dict__, "max_model_len": MAX_MODEL_LEN},
        "workloads": {},
        "runs": runner.runs,
        "token_streaming": None,
        "notes": runner.notes,
    }
    traces: dict[str, list[workloads.Trace]] = {}
    for kind, levels in (("append", args.append_qps), ("update", args.update_qps), ("pressure", [args.pressure_qps])):
        if kind not in args.parts:
            continue
        made = [workload(args, kind, qps, count_tokens) for qps in levels]
        traces[kind] = [t for t, _ in made]
        raw["workloads"][kind] = {
            "files": [str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path) for _, path in made],
            "stats": {f"{t.qps:g}": t.stats() for t, _ in made},
            "paper": workloads.PAPER.get("append" if kind == "pressure" else kind, {}),
            "qps": levels,
            "headline_qps": levels[-1],
        }
        if kind == "pressure":
            raw["workloads"][kind] |= {"delay_multiplier": args.delay_multiplier, "kv_sessions": args.kv_sessions}

    main_kinds = [k for k in ("append", "update") if k in traces]
    if main_kinds:
        cfg = app_args(args, model_path, s.dtype, None)
        raw["app_args"] = cfg
        with started("app", systems.app(cfg)) as app:
            runner.warm_up(app, ["streaming", "on_end_only"])
            for kind in main_kinds:
                for trace in traces[kind]:
                    for label in ("streaming", "on_end_only"):
                        idle()
                        runner.replay(app, trace, label, label)
        with started("peer (Ray Serve LLM P/D)", systems.rayllm(AppConfig.model_validate(cfg))) as peer:
            runner.warm_up(peer, ["whole"])
            for kind in main_kinds:
                for trace in traces[kind]:
                    time.sleep(2.0)
                    runner.replay(peer, trace, "peer", "whole")

    if "pressure" in traces:
        kv_gb = pressure_kv_gb(args, s.kv_bytes_per_token)
        cfg = app_args(args, model_path, s.dtype, kv_gb)
        raw["pressure_app_args"] = cfg
        blocks = round(kv_gb * 2**30 / (BLOCK_TOKENS * s.kv_bytes_per_token))
        raw["workloads"]["pressure"]["prefill_kv_blocks"] = blocks
        with started(f"app with a {blocks}-block prefill KV cache", systems.app(cfg)) as app:
            runner.warm_up(app, ["streaming", "on_end_only"])
            trace = traces["pressure"][0]
            for policy in args.policies:
                idle()
                if "error" in (conf := configure(policy)):
                    runner.notes.append(f"configure_scheduler({policy}) failed: {conf['error']}")
                runner.replay(app, trace, policy, "streaming")
            idle()
            configure(args.policies[0])
            runner.replay(app, trace, "nonstreaming", "on_end_only")

    if "tokens" in args.parts:
        raw["token_streaming"] = token_streaming(args)
        if raw["token_streaming"] is None:
            runner.notes.append("the token-path part failed: see its output above")

    raw["provenance"]["total_s"] = round(time.perf_counter() - started_at)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    written = suite_report.write(raw, args.out, stamp)
    print(f"\nwritten: {', '.join(str(p) for p in written.values())}", flush=True)
    print((args.out / "summary.json").read_text(), flush=True)
    return written


if __name__ == "__main__":
    main()
