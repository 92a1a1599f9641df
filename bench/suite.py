"""The benchmark suite against the Stream2LLM paper and the peers, in one command.

    .venv/bin/python bench/suite.py --quick        # every part, small: a smoke run of a few minutes
    .venv/bin/python bench/suite.py                # the full run: the figures in docs/benchmarks.md
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
- `preemptive`: end of turn -> first token with and without preemptive answers (bench/preemptive.py: spoken
  turns, an end-of-turn detector's lag of 300 and 600 ms, at low and saturating load).

Writes to `--out` (bench/results/): the workloads replayed (`workloads/*.json`), the raw results
(`suite.json`), `suite.md`, the plots and `summary.json` (bench/suite_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hashlib
import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pressure
import replay
import suite_report
import systems
import workloads
import yaml
from tqdm import tqdm

from core.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = RESULTS / "quick"  # a quick run's scratch folder (git ignores it): never over a full run's results
MODEL = "local:medium-llama"  # the larger local model: a 3,000-token prefill takes about 1 s on one core
PARTS = ("append", "update", "pressure", "tokens", "preemptive", "voice")


# ------------------------------------------------------------------------------------------- settings
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every part, small (a smoke run of a few minutes)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--queries", type=int, default=None, help="queries per append/update run (full 30, quick 6)")
    # QPS levels: the prefill core's load at each, not the paper's QPS, is what maps to the paper's runs
    # (docs/benchmarks.md)
    p.add_argument("--append-qps", type=float, nargs="+", default=None, help="full: 0.5 1.0; the last is headline")
    p.add_argument("--update-qps", type=float, nargs="+", default=None, help="full: 0.25 0.5; the last is headline")
    p.add_argument("--model", default=MODEL, help="local:medium-llama, or a hub id / path (GPU runs)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tokens-median", type=int, default=1800, help="median input tokens per query")
    p.add_argument("--tokens-min", type=int, default=600)
    p.add_argument("--tokens-max", type=int, default=3400, help="below max_model_len, with room for the template")
    p.add_argument("--pressure-queries", type=int, default=None, help="full 30, quick 6")
    p.add_argument("--pressure-qps", type=float, default=None, help="full 0.5, quick 1.0")
    p.add_argument("--delay-multiplier", type=float, default=None, help="pressure: full 4, quick 2")
    p.add_argument("--kv-sessions", type=float, default=3.5, help="pressure: prefill KV for this many sessions")
    p.add_argument("--pressure-kv-gb", type=float, default=None, help="pressure: the prefill KV cache in GiB")
    p.add_argument("--policies", nargs="+", default=["fcfs", "lcas", "mcps"])
    p.add_argument("--answer-tokens", type=int, default=2, help="the paper times the first token only")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a query may take past its last chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default bench/results/ (--quick: bench/results/quick/)")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "config.yaml")
    args = p.parse_args(argv)
    full = not args.quick
    args.out = args.out or (RESULTS if full else QUICK_RESULTS)
    args.queries = args.queries or (30 if full else 6)
    args.append_qps = args.append_qps or ([0.5, 1.0] if full else [1.0])
    args.update_qps = args.update_qps or ([0.25, 0.5] if full else [1.0])
    args.pressure_queries = args.pressure_queries or (30 if full else 6)
    args.pressure_qps = args.pressure_qps or (0.5 if full else 1.0)
    args.delay_multiplier = args.delay_multiplier or (4.0 if full else 2.0)
    return args


@dataclass
class Model:
    name: str
    path: str
    dtype: str | None  # None: the config's
    kv_bytes_per_token: int
    block_tokens: int


def model_of(args: argparse.Namespace) -> Model:
    """The model to serve: a local one is built if need be; a hub model's KV size comes from its config."""
    config = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    block = int((config.get("engine") or {}).get("block_size") or 128)  # (vLLM's CPU block size is 128)
    if args.model.startswith("local:"):
        from local_models.llm import make_local_model, spec

        s = spec(args.model).served_here()
        return Model(args.model, str(make_local_model(args.model)), s.dtype, s.kv_bytes_per_token, block)
    from transformers import AutoConfig

    from local_models.llm import resolve_model

    path = resolve_model(args.model)
    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return Model(args.model, path, None, 2 * c.num_hidden_layers * kv_heads * head_dim * 2, block)  # K+V, 16-bit


def app_args(args: argparse.Namespace, model: Model, prefill_kv_gb: float | None) -> dict[str, Any]:
    """The config's application args on the benchmark's model (and a small prefill KV cache for the pressure
    part)."""
    a = copy.deepcopy(yaml.safe_load(args.config.read_text())["applications"][0]["args"])
    a["model"] = model.name
    engine = a.setdefault("engine", {})
    engine["max_model_len"] = args.max_model_len
    if model.dtype:
        engine["dtype"] = model.dtype
    if prefill_kv_gb is not None:
        a.setdefault("prefill", {}).setdefault("engine", {})["kv_cache_gb"] = prefill_kv_gb
    return a


def pressure_kv_gb(args: argparse.Namespace, model: Model) -> float:
    """`--pressure-kv-gb`, or room for `--kv-sessions` sessions of the median size (never below one full-length
    request: vLLM's rule)."""
    if args.pressure_kv_gb:
        return args.pressure_kv_gb
    tokens, block = args.tokens_median + 128, model.block_tokens  # + the chat template and the answer
    blocks = max(math.ceil(args.kv_sessions * tokens / block), math.ceil(args.max_model_len / block) + 1)
    return blocks * block * model.kv_bytes_per_token / 2**30


# ------------------------------------------------------------------------------------------- workloads
def workload(
    args: argparse.Namespace, kind: str, qps: float, level: int, model: str, count_tokens: Any
) -> tuple[workloads.Trace, Path]:
    """The trace for (kind, qps): generated once per seed and size and saved, so every system replays it. Each
    QPS level has its own seed (its own text): a system replays each level once, and its prefix cache must
    not answer one level from another's KV."""
    seed = args.seed + level
    pressure = kind == "pressure"
    queries = args.pressure_queries if pressure else args.queries
    delay = args.delay_multiplier if pressure else 1.0
    sizes = [args.tokens_min, args.tokens_median, args.tokens_max, model]  # a change of these is another trace
    tag = hashlib.sha1(json.dumps(sizes).encode()).hexdigest()[:6]
    name = f"{kind}-q{qps:g}-n{queries}-s{seed}" + (f"-d{delay:g}" if pressure else "") + f"-{tag}.json"
    path = args.out / "workloads" / name
    if path.exists():
        return workloads.Trace.load(path), path
    trace = workloads.generate(
        "append" if pressure else kind,
        queries=queries,
        qps=qps,
        seed=seed,
        delay_multiplier=delay,
        tokens_median=args.tokens_median,
        tokens_min=args.tokens_min,
        tokens_max=args.tokens_max,
        count_tokens=count_tokens,
    )
    trace.kind = kind
    trace.save(path)
    return trace, path


def warm_up_trace(count_tokens: Any) -> workloads.Trace:
    return workloads.generate(
        "append", queries=2, qps=4.0, seed=10**6, tokens_median=600, tokens_min=300, count_tokens=count_tokens
    )


# ------------------------------------------------------------------------------------------- running
class Runner:
    def __init__(self, args: argparse.Namespace, count_tokens: Any) -> None:
        self.args, self.count_tokens = args, count_tokens
        self.runs: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def replay(self, system: systems.System, trace: workloads.Trace, label: str, mode: str) -> dict[str, Any]:
        desc = f"{trace.kind} q{trace.qps:g} {label}"
        before = prefill_stats() if system.name == "app" else None
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
        p50 = suite_report.pct(ok, 50)
        print(
            f"  {desc}: {len(ok)}/{len(ok) + result['errors']} ok, P50 {'-' if p50 is None else f'{p50:.0f}'} ms, "
            f"completion {result['completion_s']:.1f}s, errors {result['error_kinds'] or 0}, "
            f"send lag max {result['send_lag_ms']['max']:.0f} ms",
            flush=True,
        )
        for sample in result["error_samples"][:2]:
            print(f"    e.g. {sample}", flush=True)
        run = {"workload": trace.kind, "qps": trace.qps, "system": label, **result}
        if before is not None:
            run["work"], after = work(trace, result, before)
            # where the work went (computed by kind, evictions, recompute, invalidated input, swaps)
            counters = [pressure.scheduler_counters(stats) for stats in (before, after)]
            run["scheduler_delta"] = pressure.counter_delta(*counters)
            print(f"  {desc}: work ratio {run['work']['work_ratio'] or 0:.3f} (computed / prompt tokens)", flush=True)
        self.runs.append(run)
        return run

    def warm_up(self, system: systems.System, modes: list[str]) -> None:
        """A couple of short queries per mode, not counted: the first requests after start-up are slow."""
        for mode in modes:
            trace = warm_up_trace(self.count_tokens)
            result = asyncio.run(replay.replay(trace, base=system.base, model=system.model, mode=mode))
            if result["errors"]:
                self.notes.append(f"warm-up of {system.name} ({mode}) had errors: {result['error_samples']}")


def prefill_stats() -> dict[str, Any] | None:
    """The app's prefill replica stats (prompt tokens computed of every kind: streamed input, recompute after
    eviction, superseded versions, hand-offs; the scheduler's counters), or None when the app is not running."""
    try:
        return pressure.prefill_call("stats")
    except Exception:  # noqa: BLE001 - not this app (the peer), or no engine: no work figure
        return None


def work(
    trace: workloads.Trace, result: dict[str, Any], before: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What a run cost the prefill engine against what not streaming costs: computed / prompt tokens of the
    queries answered (1.0: each prompt token computed once, as `on_end_only` does); and the stats after it."""
    pressure.wait_idle(120)  # the run's last sessions end (their KV freed) before the count is read
    after = prefill_stats()
    answered = [q for q, t in zip(trace.queries, result["ttft_ms"], strict=True) if t is not None]
    prompt = sum(q.prompt_tokens or 0 for q in answered)
    key = "prompt_tokens_computed_total"
    computed = None if after is None else int(after[key]) - int(before[key])
    ratio = computed / prompt if computed is not None and prompt else None
    return {"prompt_tokens": prompt, "computed_tokens": computed, "work_ratio": ratio}, after


@contextlib.contextmanager
def started(name: str, factory: Any) -> Iterator[systems.System]:
    t = time.perf_counter()
    print(f"== starting {name}", flush=True)
    with factory as system:
        print(f"  {name} up in {time.perf_counter() - t:.0f}s", flush=True)
        yield system


def idle(runner: Runner, timeout: float = 120.0) -> None:
    """Until the app's prefill engine runs nothing (runs must not overlap), then both engines forget their
    cached prefixes: runs replay the same text, and none may be answered from another's KV."""
    from pressure import wait_idle
    from ray import serve

    if not wait_idle(timeout):
        runner.notes.append(f"the prefill engine was still busy {timeout:.0f}s after a run: the next one overlapped")
    for role in ("prefill", "decode"):
        handle = serve.get_deployment_handle(role, app_name=systems.APP_NAME)
        try:
            for _ in range(30):  # False while a request still holds blocks (a session being closed)
                if handle.reset_prefix_cache.remote().result(timeout_s=60):
                    break
                time.sleep(1.0)
            else:
                runner.notes.append(f"the {role} engine's prefix cache could not be reset between two runs")
        except Exception as e:  # noqa: BLE001 - noted; the runs go on
            runner.notes.append(f"resetting the {role} engine's prefix cache failed: {type(e).__name__}: {e}"[:300])
    time.sleep(1.0)


def configure(policy: str) -> dict[str, Any]:
    from pressure import prefill_call

    try:
        return {"ok": prefill_call("configure_scheduler", timeout=600, policy=policy)}
    except Exception as e:  # noqa: BLE001 - recorded: the run is then under whatever policy was set
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def pressure_runs(runner: Runner, app: systems.System, trace: workloads.Trace) -> None:
    """The pressure trace streamed under each policy, then not streamed (`on_end_only`)."""
    for policy in runner.args.policies:
        idle(runner)
        if "error" in (conf := configure(policy)):
            runner.notes.append(f"configure_scheduler({policy}) failed: {conf['error']}")
        runner.replay(app, trace, policy, "streaming")
    idle(runner)
    configure(runner.args.policies[0])
    runner.replay(app, trace, "nonstreaming", "on_end_only")


def token_streaming(args: argparse.Namespace) -> dict[str, Any] | None:
    """bench/token_path.py in its own process (its systems start their own Ray); its results JSON."""
    tag = "suite_token_path"
    argv = ["--systems", "app", "plain", "rayllm", "--session-concurrency", "--tag", tag, "--config", str(args.config)]
    argv += ["--quick"] if args.quick else ["--concurrency", "32", "128"]
    argv += ["--out", str(args.out)]
    print(f"== tokens: bench/token_path.py {' '.join(argv)}", flush=True)
    return _run_part("token_path.py", argv, args.out / f"{tag}.json")


def separate_part(args: argparse.Namespace, name: str) -> dict[str, Any] | None:
    """bench/<name>.py in its own process (it starts its own Ray: the preemptive and voice parts); its results
    JSON, or None if it failed."""
    out = args.out / name
    argv = ["--config", str(args.config), "--out", str(out), *(["--quick"] if args.quick else [])]
    print(f"== {name}: bench/{name}.py {' '.join(argv)}", flush=True)
    return _run_part(f"{name}.py", argv, out / f"{name}.json")


def _run_part(script: str, argv: list[str], result: Path) -> dict[str, Any] | None:
    """bench/<script> in its own process; the result it wrote (its topic's file, replaced by each run), or None if
    it failed or wrote none."""
    before = result.stat().st_mtime_ns if result.exists() else None
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *argv], cwd=ROOT)
    if done.returncode != 0 or not result.exists() or result.stat().st_mtime_ns == before:
        return None
    return json.loads(result.read_text())


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

    started_at = time.perf_counter()
    model = model_of(args)
    count_tokens = workloads.token_counter(model.path)

    runner = Runner(args, count_tokens)
    raw: dict[str, Any] = {
        "provenance": provenance(args, argv),
        "model": {**asdict(model), "max_model_len": args.max_model_len},
        "workloads": {},
        "runs": runner.runs,
        "token_streaming": None,
        "preemptive": None,
        "voice": None,
        "notes": runner.notes,
    }
    traces: dict[str, list[workloads.Trace]] = {}
    for kind, levels in (("append", args.append_qps), ("update", args.update_qps), ("pressure", [args.pressure_qps])):
        if kind not in args.parts:
            continue
        made = [workload(args, kind, qps, i, model.name, count_tokens) for i, qps in enumerate(levels)]
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

    try:
        main_kinds = [k for k in ("append", "update") if k in traces]
        pressure = traces["pressure"][0] if "pressure" in traces else None
        kv_gb = pressure_kv_gb(args, model)
        blocks = round(kv_gb * 2**30 / (model.block_tokens * model.kv_bytes_per_token))
        small = f"app with a {blocks}-block prefill KV cache"
        # Quick mode is a smoke run: one app (the small cache) serves every part, which saves a start-up.
        shared = args.quick and pressure is not None
        if pressure is not None:
            raw["workloads"]["pressure"]["prefill_kv_blocks"] = blocks
        if main_kinds:
            cfg = raw["app_args"] = app_args(args, model, kv_gb if shared else None)
            if shared:
                runner.notes.append(f"quick mode: every part ran on one app with a {blocks}-block prefill KV cache")
            with started(small if shared else "app", systems.app(cfg)) as app:
                runner.warm_up(app, ["streaming", "on_end_only"])
                for kind in main_kinds:
                    for trace in traces[kind]:
                        for label in ("streaming", "on_end_only"):
                            idle(runner)
                            runner.replay(app, trace, label, label)
                if shared and pressure is not None:
                    pressure_runs(runner, app, pressure)
            with started("peer (Ray Serve LLM P/D)", systems.rayllm(AppConfig.model_validate(cfg))) as peer:
                runner.warm_up(peer, ["whole"])
                for kind in main_kinds:
                    for trace in traces[kind]:
                        time.sleep(2.0)
                        runner.replay(peer, trace, "peer", "whole")
        if pressure is not None and not (shared and main_kinds):
            cfg = raw["pressure_app_args"] = app_args(args, model, kv_gb)
            with started(small, systems.app(cfg)) as app:
                runner.warm_up(app, ["streaming", "on_end_only"])
                pressure_runs(runner, app, pressure)

        if "tokens" in args.parts:
            raw["token_streaming"] = token_streaming(args)
            if raw["token_streaming"] is None:
                runner.notes.append("the token-path part failed: see its output above")
        if "preemptive" in args.parts:
            raw["preemptive"] = separate_part(args, "preemptive")
            if raw["preemptive"] is None:
                runner.notes.append("the preemptive-answers part failed: see its output above")
        if "voice" in args.parts:
            raw["voice"] = separate_part(args, "voice")
            if raw["voice"] is None:
                runner.notes.append("the voice part failed: see its output above")
    except BaseException as e:  # whatever ran is written: a failure late in a 35-minute run keeps the rest
        runner.notes.append(f"the suite stopped early: {type(e).__name__}: {e}"[:300])
        raise
    finally:
        raw["provenance"]["total_s"] = round(time.perf_counter() - started_at)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        written = suite_report.write(raw, args.out, stamp)
        print(f"\nwritten: {', '.join(str(p) for p in written.values())}", flush=True)
        print((args.out / "summary.json").read_text(), flush=True)
    return written


if __name__ == "__main__":
    main()
