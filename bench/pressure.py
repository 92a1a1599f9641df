"""Memory-pressure benchmark: streaming-input sessions whose KV does not all fit in the prefill cache.

A crawler-like workload (seeded): sessions arrive as a Poisson process; each streams a few thousand tokens
of fresh text (no prefix-cache help across sessions) in 6-8 chunks, seconds apart (lognormal gaps, median
0.7 s times `--delay-multiplier`). The prefill engine's KV cache holds only a few sessions' worth
(`--kv-sessions`, or `--kv-cache-gb`), so the prefill scheduler must evict idle sessions and bring them
back. The app serves `local:medium-llama` (prefill of ~3,000 tokens costs about a second on one core).

Every system runs in the same process on the same app, one after another, with the same arrival times,
sizes and gaps (different text): each (policy, eviction) in {fcfs, lcas, mcps} x {recompute, swap, cost},
`vllm/recompute` (the engine's own order and victims), and `on_end_only` (the non-streaming baseline: the
whole input is prefilled after the last chunk), switched at runtime with the prefill deployment's
`configure_scheduler`. TTFT is the time from sending the last chunk (`end_of_input`) to the first answer
token. Reported per system: P50/P95/P99 TTFT, baseline/system ratios (>1 = faster than the baseline),
errors and timeouts (each session is bounded by `--session-timeout`), and the deltas of the prefill
scheduler's counters (evictions, admissions, swapped-out blocks, recomputed tokens).

    .venv/bin/python bench/pressure.py --quick                    # smoke run, a few minutes
    .venv/bin/python bench/pressure.py [--sessions 30] [--qps 0.3] [--delay-multiplier 1] [--systems ...]
    .venv/bin/python bench/pressure.py --measure-prefill          # one-core prefill time of the model, no app
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai_stream import pct_ms, wait_health  # bench/ is on sys.path when a bench runs

from core.protocol import choice_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
APP = "realtime-pd"
PORT = 8793
SESSIONS = "/v1/streaming_input/sessions"
MODEL = "local:medium-llama"
BLOCK_TOKENS = 128  # vLLM's CPU block size

POLICIES = ("fcfs", "lcas", "mcps")
EVICTIONS = ("recompute", "swap", "cost")
BASELINE = "on_end_only"
ALL_SYSTEMS = [f"{p}/{e}" for p in POLICIES for e in EVICTIONS] + ["vllm/recompute", BASELINE]

# Words for the generated documents: each session draws its own sequence, numbered, so no two sessions
# share a 128-token block (no prefix-cache hits across sessions).
_WORDS = (
    "crawler index page document section table figure vector search query result source link anchor title summary "
    "abstract method dataset model layer token cache stream prefill decode latency memory block session request "
    "answer server client replica engine policy eviction swap recompute budget chunk"
)
WORDS = _WORDS.split()


# ---------------------------------------------------------------------------------------------- workload
@dataclass
class SessionPlan:
    index: int
    arrival_s: float  # offset from the system's start
    tokens: int  # target input size
    gaps_s: list[float]  # before chunks 1..n-1
    chunks: int


@dataclass
class Outcome:
    system: str
    index: int
    ttft_s: float | None = None
    error: str | None = None
    timed_out: bool = False
    first_from: str = "delta"  # "delta", or "done" when the answer had no text
    prompt_tokens: int | None = None
    prompt_tokens_computed: int | None = None
    session_wall_s: float | None = None
    start_s: float | None = None  # offsets from the system's start: when the session was created / ended
    end_s: float | None = None
    chunk_statuses: list[int] = field(default_factory=list)


def plan_workload(args: argparse.Namespace) -> list[SessionPlan]:
    """Arrival times, sizes and gaps: the same for every system (seeded)."""
    rng = random.Random(args.seed)
    plans, t = [], 0.0
    for i in range(args.sessions):
        if i:
            t += rng.expovariate(args.qps)
        chunks = rng.randint(args.min_chunks, args.max_chunks)
        median = args.gap_median_s * args.delay_multiplier
        gaps = [median * math.exp(rng.gauss(0.0, args.gap_sigma)) for _ in range(chunks - 1)]
        plans.append(SessionPlan(i, t, rng.randint(args.min_tokens, args.max_tokens), gaps, chunks))
    return plans


def make_text(tokenizer: Any, seed: str, tokens: int) -> str:
    """Fresh text of about `tokens` tokens (cut at a word boundary)."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:  # a word here is about 6 tokens: start a little short, add until long enough
        words += [f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(max(16, (tokens - 6 * len(words)) // 7))]
        text = " ".join(words)
        offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        if len(offsets) > tokens:
            break
    if len(offsets) > tokens:
        cut = offsets[tokens][0]
        text = text[: text.rfind(" ", 0, cut) if " " in text[:cut] else cut]
    return text


def split_chunks(text: str, n: int, rng: random.Random) -> list[str]:
    """`n` pieces of roughly equal size (±30%), cut anywhere (a chunk may end inside a word)."""
    weights = [rng.uniform(0.7, 1.3) for _ in range(n)]
    total, cuts, acc = sum(weights), [], 0.0
    for w in weights[:-1]:
        acc += w
        cuts.append(int(len(text) * acc / total))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# ------------------------------------------------------------------------------------------- one session
async def one_session(
    client: httpx.AsyncClient,
    system: str,
    plan: SessionPlan,
    pieces: list[str],
    args: argparse.Namespace,
    t0: float | None = None,
) -> Outcome:
    out = Outcome(system=system, index=plan.index)
    policy = BASELINE if system == BASELINE else "on_first_chunk"
    # One turn per session: it closes with its answer (no re-prefill of a conversation that will not continue).
    body = {"messages": [], "max_tokens": args.answer_tokens, "temperature": 0, "start_policy": policy}
    body["close_after_answer"] = True
    if args.served_model:
        body["model"] = args.served_model
    sid: str | None = None
    watcher: asyncio.Task[None] | None = None
    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    first: asyncio.Future[tuple[float, str]] = loop.create_future()

    def settle(value: tuple[float, str] | BaseException) -> None:
        if not first.done():
            if isinstance(value, BaseException):
                first.set_exception(value)
            else:
                first.set_result(value)

    async def watch() -> None:
        try:
            async with client.stream("GET", f"{SESSIONS}/{sid}/events") as r:
                if r.status_code != 200:
                    await r.aread()
                    settle(RuntimeError(f"events HTTP {r.status_code}: {r.text[:200]}"))
                    return
                async for line in r.aiter_lines():  # the chat chunks of a streamed chat completion
                    if line == "data: [DONE]":
                        settle((time.perf_counter(), "done"))
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        settle(RuntimeError(f"event error: {json.dumps(event)[:200]}"))
                    elif choice_text(event)[0]:
                        settle((time.perf_counter(), "delta"))
            settle(RuntimeError("event stream ended without an answer"))
        except Exception as e:  # noqa: BLE001 - any failure of the stream is this session's error
            settle(RuntimeError(f"events: {type(e).__name__}: {e}"))

    async def drive() -> None:
        nonlocal sid, watcher
        r = await client.post(SESSIONS, json=body)
        if r.status_code != 201:
            raise RuntimeError(f"create HTTP {r.status_code}: {r.text[:200]}")
        sid = r.json()["session_id"]
        watcher = asyncio.create_task(watch())
        last_sent = None
        for seq, piece in enumerate(pieces):
            if seq:
                await asyncio.sleep(plan.gaps_s[seq - 1])
            end = seq == len(pieces) - 1
            if end:
                last_sent = time.perf_counter()
            r = await client.post(
                f"{SESSIONS}/{sid}/chunks", json={"sequence_id": seq, "payload": piece, "end_of_input": end}
            )
            out.chunk_statuses.append(r.status_code)
            if r.status_code >= 400:
                raise RuntimeError(f"chunk {seq} HTTP {r.status_code}: {r.text[:200]}")
        at, source = await first
        out.ttft_s, out.first_from = at - last_sent, source

    async def describe() -> None:
        """Sizes from the session's record, after its answer (not part of the timed or bounded part)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
            await client.get(f"{SESSIONS}/{sid}/result", params={"wait": "true"}, timeout=30)
            info = (await client.get(f"{SESSIONS}/{sid}", timeout=10)).json()
            answers = info.get("answers") or [{}]
            out.prompt_tokens = (answers[0].get("usage") or {}).get("prompt_tokens")
            out.prompt_tokens_computed = info.get("prompt_tokens_computed")

    try:
        await asyncio.wait_for(drive(), args.session_timeout)
        await describe()
    except asyncio.TimeoutError:
        out.timed_out, out.error = True, f"timeout after {args.session_timeout:.0f}s"
    except Exception as e:  # noqa: BLE001 - counted, never fatal
        out.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        out.session_wall_s = time.perf_counter() - started
        if t0 is not None:
            out.start_s, out.end_s = started - t0, started - t0 + out.session_wall_s
        if watcher is not None:
            watcher.cancel()
        if first.done() and not first.cancelled():
            first.exception()  # retrieved: an error seen after the session already failed is not logged again
        if sid is not None:
            with contextlib.suppress(httpx.HTTPError):
                await client.delete(f"{SESSIONS}/{sid}", timeout=10)
    return out


async def run_system(
    base: str, system: str, plans: list[SessionPlan], texts: list[list[str]], args: argparse.Namespace
) -> list[Outcome]:
    limits = httpx.Limits(max_connections=4 * len(plans) + 16, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(args.session_timeout)) as c:
        t0 = time.perf_counter()

        async def launch(plan: SessionPlan, pieces: list[str]) -> Outcome:
            await asyncio.sleep(max(0.0, plan.arrival_s - (time.perf_counter() - t0)))
            return await one_session(c, system, plan, pieces, args, t0)

        return await asyncio.gather(*(launch(p, t) for p, t in zip(plans, texts, strict=True)))


# ---------------------------------------------------------------------------------------------- summary


def counter_delta(before: Any, after: Any) -> Any:
    """after - before for every number in (nested) dicts; other values as they are after."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        out = {k: counter_delta(before.get(k), v) for k, v in after.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, 0, 0.0)}
    if isinstance(after, bool) or not isinstance(after, (int, float)):
        return None
    return after - (before if isinstance(before, (int, float)) and not isinstance(before, bool) else 0)


SETTINGS_KEYS = ("policy", "eviction")
GAUGES = ("queue_running", "queue_waiting", "idle_sessions", "evicted_now", "host_slots", "host_slots_free")


def scheduler_counters(stats: dict[str, Any] | None) -> dict[str, Any]:
    sched = dict((stats or {}).get("scheduler") or {})
    return {k: v for k, v in sched.items() if k not in SETTINGS_KEYS + GAUGES + ("block_bytes",)}


def peak_open(outcomes: list[Outcome]) -> int:
    """The most sessions open at once, as the client saw them."""
    edges = sorted(
        [(o.start_s, 1) for o in outcomes if o.start_s is not None]
        + [(o.end_s, -1) for o in outcomes if o.end_s is not None]
    )
    peak = n = 0
    for _, step in edges:
        n += step
        peak = max(peak, n)
    return peak


def summarise(outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o.ttft_s for o in outcomes if o.error is None and o.ttft_s is not None]
    errors = [o for o in outcomes if o.error is not None]
    sizes = [o.prompt_tokens for o in outcomes if o.prompt_tokens]
    return {
        "sessions": len(outcomes),
        "ok": len(ok),
        "errors": len(errors),
        "timeouts": sum(o.timed_out for o in outcomes),
        "error_examples": sorted({o.error for o in errors if o.error})[:3],
        "peak_open_sessions": peak_open(outcomes),
        "first_from_done": sum(o.first_from == "done" for o in outcomes if o.error is None),
        **{f"ttft_p{q}_ms": pct_ms(ok, q) for q in (50, 95, 99)},
        "ttft_mean_ms": 1000 * sum(ok) / len(ok) if ok else None,
        "mean_prompt_tokens": statistics.mean(sizes) if sizes else None,
    }


def add_ratios(summary: dict[str, dict[str, Any]]) -> None:
    base = summary.get(BASELINE)
    for s in summary.values():
        for q in (50, 95, 99):
            b, v = (base or {}).get(f"ttft_p{q}_ms"), s.get(f"ttft_p{q}_ms")
            s[f"speedup_p{q}"] = b / v if b and v else None


def table(summary: dict[str, dict[str, Any]]) -> str:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        "| system | ok/sessions | peak open | errors (timeouts) | P50 ms | P95 ms | P99 ms | x P50 | x P95 | x P99 "
        "| work ratio | evictions | swapped blocks | recomputed tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        c = s.get("scheduler_delta") or {}
        ev = {k.removeprefix("evictions_"): v for k, v in c.items() if k.startswith("evictions_")}
        if isinstance(c.get("evictions"), dict):
            ev.update(c["evictions"])
        kinds = {k: v for k, v in ev.items() if k in ("recompute", "swap")}
        ev_text = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "0"
        if ev.keys() - kinds.keys():  # the same evictions by where the victim was (idle session / active)
            ev_text += " (" + ", ".join(f"{k} {v}" for k, v in sorted(ev.items()) if k not in kinds) + ")"
        cells = [
            name,
            f"{s['ok']}/{s['sessions']}",
            s["peak_open_sessions"],
            f"{s['errors']} ({s['timeouts']})",
            *(f(s[f"ttft_p{q}_ms"], ".0f") for q in (50, 95, 99)),
            *(f(s.get(f"speedup_p{q}"), ".2f") for q in (50, 95, 99)),
            f(s.get("work_ratio"), ".3f"),
            ev_text,
            c.get("swapped_out_blocks", 0),
            c.get("recomputed_tokens", 0),
        ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the app
def resolve_systems(names: list[str] | None) -> list[str]:
    if not names:
        return list(ALL_SYSTEMS)
    out: list[str] = []
    for raw in names:
        for name in raw.split(","):
            name = name.strip()
            if name in ("baseline", "on_end_only"):
                picked = [BASELINE]
            elif name == "vllm":
                picked = ["vllm/recompute"]
            elif name in POLICIES:
                picked = [f"{name}/{e}" for e in EVICTIONS]
            elif name in ALL_SYSTEMS:
                picked = [name]
            else:
                raise SystemExit(f"unknown system {name!r}; known: {', '.join(ALL_SYSTEMS)}, or a policy name")
            out += [p for p in picked if p not in out]
    return out


def kv_cache_gb(args: argparse.Namespace, kv_bytes_per_token: int) -> float:
    """`--kv-cache-gb`, or room for `--kv-sessions` sessions of the mean size (never below one full-length
    request, which vLLM requires)."""
    if args.kv_cache_gb:
        return args.kv_cache_gb
    mean_tokens = (args.min_tokens + args.max_tokens) / 2 + 64  # + chat template and the answer
    blocks = max(math.ceil(args.kv_sessions * mean_tokens / BLOCK_TOKENS), math.ceil(4096 / BLOCK_TOKENS) + 1)
    return blocks * BLOCK_TOKENS * kv_bytes_per_token / 2**30


def app_args(args: argparse.Namespace, model_path: Path, kv_gb: float, dtype: str) -> dict[str, Any]:
    """configs/config.yaml's application args, on the medium model, with a small prefill KV cache."""
    config = yaml.safe_load(Path(args.config).read_text())
    a = config["applications"][0]["args"]
    a["model"] = MODEL
    engine = a.setdefault("engine", {})
    engine["max_model_len"] = 4096
    engine["dtype"] = dtype
    prefill = a.setdefault("prefill", {})
    prefill.setdefault("engine", {})["kv_cache_gb"] = kv_gb
    if args.decode_kv_cache_gb:
        a.setdefault("decode", {}).setdefault("engine", {})["kv_cache_gb"] = args.decode_kv_cache_gb
    if args.swap_gb is not None or args.cost_model:
        sched = prefill.setdefault("scheduler", {})
        if args.swap_gb is not None:
            sched["swap_gb"] = args.swap_gb
        if args.cost_model:
            sched["cost_model"] = args.cost_model
    return a


def prefill_call(method: str, timeout: float = 60, **kwargs: Any) -> Any:
    from ray import serve

    handle = serve.get_deployment_handle("prefill", app_name=APP)
    return getattr(handle, method).remote(**kwargs).result(timeout_s=timeout)


def prefill_stats() -> dict[str, Any] | None:
    try:
        return prefill_call("stats")
    except Exception as e:  # noqa: BLE001
        print(f"  prefill stats failed: {type(e).__name__}: {e}", flush=True)
        return None


def wait_idle(timeout: float) -> bool:
    """Wait until the prefill engine runs nothing and no session holds KV (blocks may stay cached)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = prefill_stats() or {}
        if s.get("num_requests", 1) == 0 and s.get("unfinished_requests", 1) == 0:
            return True
        time.sleep(1)
    return False


def configure(system: str, default: dict[str, str]) -> dict[str, Any]:
    """Switch the prefill scheduler; the baseline runs under the config's default policy."""
    if system == BASELINE:
        policy, eviction = default["policy"], default["eviction"]
    else:
        policy, eviction = system.split("/")
    try:
        result = prefill_call("configure_scheduler", timeout=600, policy=policy, eviction=eviction)
    except Exception as e:  # noqa: BLE001 - recorded; the system still runs (under whatever is set)
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    if isinstance(result, dict) and "error" in result:
        return {"error": json.dumps(result["error"])[:500]}
    return {"ok": result}


async def warm_up(base: str, args: argparse.Namespace, tokenizer: Any) -> None:
    """One short streaming session and one baseline session (not counted): the first request after
    /health can wait tens of seconds."""
    plan = SessionPlan(-1, 0.0, 300, [0.1, 0.1], 3)
    for system in ("warm-up", BASELINE):
        text = make_text(tokenizer, f"warm-up/{system}", plan.tokens)
        pieces = split_chunks(text, plan.chunks, random.Random(0))
        warm = argparse.Namespace(**{**vars(args), "session_timeout": 300.0})
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            o = await one_session(client, system, plan, pieces, warm)
        print(f"  warm-up {system}: ttft={o.ttft_s} error={o.error}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from local_models.llm import make_local_model, spec
    from serve_app.builder import build_app

    model_path = make_local_model("medium-llama")
    s = spec("medium-llama").served_here()
    if args.dtype:
        s = replace(s, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    kv_gb = kv_cache_gb(args, s.kv_bytes_per_token)
    cfg = app_args(args, model_path, kv_gb, s.dtype)
    systems = resolve_systems(args.systems)
    plans = plan_workload(args)
    block_bytes = BLOCK_TOKENS * s.kv_bytes_per_token
    print(
        f"model {MODEL} ({model_path}), {s.kv_bytes_per_token} KV bytes/token, prefill KV {kv_gb:.4f} GiB "
        f"= {round(kv_gb * 2**30 / block_bytes)} blocks of {BLOCK_TOKENS} tokens; {len(plans)} sessions per system, "
        f"{sum(p.tokens for p in plans) / len(plans):.0f} tokens mean, arrivals over {plans[-1].arrival_s:.0f}s; "
        f"systems: {', '.join(systems)}",
        flush=True,
    )
    # Texts per system: same sizes and chunking, different words (no prefix-cache hits across systems).
    texts = {
        system: [
            split_chunks(
                make_text(tokenizer, f"{args.seed}/{system}/{p.index}", p.tokens), p.chunks, random.Random(p.index)
            )
            for p in plans
        ]
        for system in systems
    }

    base = f"http://127.0.0.1:{args.port}"
    ray.init(
        address="local",
        num_cpus=8,  # logical: the engines' own processes are not Ray-scheduled
        include_dashboard=False,
        log_to_driver=args.logs,
        runtime_env={"env_vars": {"RAY_SERVE_LOG_TO_STDERR": "0"}},
    )
    record: dict[str, Any] = {
        "args": vars(args),
        "model": MODEL,
        "model_path": str(model_path),
        "model_spec": asdict(s),
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "prefill_kv_cache_gb": kv_gb,
        "prefill_kv_blocks": round(kv_gb * 2**30 / block_bytes),
        "app_args": cfg,
        "workload": [asdict(p) for p in plans],
        "systems": {},
    }
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        started = time.perf_counter()
        serve.run(build_app(cfg), name=APP, route_prefix="/")
        wait_health(base, 600)
        print(f"app up in {time.perf_counter() - started:.0f}s", flush=True)
        stats = prefill_stats() or {}
        sched = stats.get("scheduler") or {}
        default = {"policy": sched.get("policy", "fcfs"), "eviction": sched.get("eviction", "recompute")}
        record["prefill_stats_at_start"] = stats
        asyncio.run(warm_up(base, args, tokenizer))
        wait_idle(60)
        for system in systems:
            print(f"== {system}", flush=True)
            conf = configure(system, default)
            if "error" in conf:
                print(f"  configure_scheduler failed: {conf['error']}", flush=True)
            before = prefill_stats()
            t = time.perf_counter()
            outcomes = asyncio.run(run_system(base, system, plans, texts[system], args))
            wall = time.perf_counter() - t
            idle = wait_idle(args.idle_timeout)
            after = prefill_stats()
            summary = summarise(outcomes)
            delta = counter_delta(scheduler_counters(before), scheduler_counters(after))
            computed = sum(delta.get(f"computed_{k}", 0) for k in ("streamed", "handoff", "whole"))
            prompt = sum(o.prompt_tokens or 0 for o in outcomes if o.error is None)
            summary.update(
                {
                    # prefill tokens computed (every kind) per prompt token answered; 1.0 = each computed once
                    "work_ratio": computed / prompt if prompt and computed else None,
                    "wall_s": wall,
                    "configure": conf,
                    "idle_after": idle,
                    "scheduler_delta": delta,
                    "scheduler_after": (after or {}).get("scheduler"),
                }
            )
            record["systems"][system] = {"summary": summary, "sessions": [asdict(o) for o in outcomes]}
            p50 = summary["ttft_p50_ms"]
            line = [
                f"  {summary['ok']}/{summary['sessions']} ok (peak {summary['peak_open_sessions']} open)",
                f"{summary['errors']} errors ({summary['timeouts']} timeouts)",
                f"P50 {'-' if p50 is None else f'{p50:.0f}'} ms",
                f"{wall:.0f}s",
                f"counters {summary['scheduler_delta']}",
            ]
            print(", ".join(line) + ("" if idle else ", prefill NOT idle afterwards"), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return record


# ------------------------------------------------------------------------------------- prefill timing
def measure_prefill(args: argparse.Namespace) -> None:
    """The model's prefill time on one core: vllm.LLM, random token ids, one output token, no prefix cache.

    Reports wall time and the CPU time of vLLM's worker process over each call: on a shared machine the
    wall time includes waiting for the core, the worker's CPU time much less so.
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from local_models.llm import make_local_model, spec

    path = args.model_dir or make_local_model("medium-llama")
    dtype = args.dtype or spec("medium-llama").served_here().dtype
    llm = LLM(
        model=str(path),
        dtype=dtype,
        max_model_len=4096,
        kv_cache_memory_bytes=256 * 2**20,
        enable_prefix_caching=False,
    )
    workers = [
        p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join(p.cmdline()) + p.name()
    ] or psutil.Process().children(recursive=True)

    def cpu() -> float:
        total = 0.0
        for w in workers:
            with contextlib.suppress(psutil.Error):
                t = w.cpu_times()
                total += t.user + t.system
        return total

    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    result: dict[str, Any] = {
        "model": MODEL,
        "dtype": dtype,
        "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "workers": [w.name() for w in workers],
    }
    llm.generate([TokensPrompt(prompt_token_ids=[9] * 64)], params, use_tqdm=False)  # warm-up
    for n in args.prefill_tokens:
        walls, cpus = [], []
        for _ in range(args.prefill_repeats):
            ids = [rng.randrange(8, 2000) for _ in range(n)]
            load = os.getloadavg()[0]
            c, t = cpu(), time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            walls.append(time.perf_counter() - t)
            cpus.append(cpu() - c)
        result[str(n)] = {
            "wall_s": walls,
            "worker_cpu_s": cpus,
            "wall_min_s": min(walls),
            "wall_median_s": statistics.median(walls),
            "worker_cpu_median_s": statistics.median(cpus),
            "loadavg_1m": load,
        }
        print(
            f"prefill {n} tokens ({dtype}, one core): wall min {min(walls):.3f} s, median "
            f"{statistics.median(walls):.3f} s; worker CPU median {statistics.median(cpus):.3f} s "
            f"(load average {load:.1f})",
            flush=True,
        )
    print(json.dumps(result))


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 8 sessions per system at 3/s, smaller inputs")
    p.add_argument("--sessions", type=int, default=None, help="sessions per system (default 40; quick 8)")
    p.add_argument("--qps", type=float, default=None, help="session arrival rate, Poisson (default 0.6; quick 3)")
    p.add_argument("--delay-multiplier", type=float, default=1.0, help="scales the gaps between chunks")
    p.add_argument("--gap-median-s", type=float, default=0.7, help="median gap between chunks before scaling")
    p.add_argument("--gap-sigma", type=float, default=0.5, help="lognormal sigma of the gaps")
    p.add_argument("--min-chunks", type=int, default=6)
    p.add_argument("--max-chunks", type=int, default=8)
    p.add_argument("--min-tokens", type=int, default=None, help="input size range (default 2000-3500; quick 1200-2000)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--answer-tokens", type=int, default=2, help="max_tokens of each answer")
    p.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help=f"subset of: {', '.join(ALL_SYSTEMS)} (also a policy name for its three evictions, 'vllm', 'baseline')",
    )
    p.add_argument("--kv-cache-gb", type=float, default=None, help="prefill KV cache (GiB); default from --kv-sessions")
    p.add_argument(
        "--kv-sessions", type=float, default=None, help="prefill KV cache for this many mean sessions (3.5; quick 2)"
    )
    p.add_argument("--decode-kv-cache-gb", type=float, default=None, help="decode KV cache (default: the config's)")
    p.add_argument("--swap-gb", type=float, default=None, help="prefill.scheduler.swap_gb (default: the config's)")
    p.add_argument("--cost-model", default=None, help="prefill.scheduler.cost_model: a saved latency model")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the model's; float32 on a CPU without bf16)")
    p.add_argument("--session-timeout", type=float, default=None, help="bound on one session, s (180; quick 30)")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="wait for the prefill engine between systems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--config", default=str(ROOT / "configs" / "config.yaml"))
    p.add_argument("--served-model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--logs", action="store_true", help="show Ray/Serve/vLLM logs")
    p.add_argument("--measure-prefill", action="store_true", help="only time the model's prefill on one core")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[1000, 2000, 3000])
    p.add_argument("--prefill-repeats", type=int, default=5)
    p.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)  # time another checkpoint
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (
        ("sessions", 40, 8),
        ("qps", 0.6, 3.0),
        ("min_tokens", 2000, 1200),
        ("max_tokens", 3500, 2000),
        ("session_timeout", 180.0, 30.0),
        ("kv_sessions", 3.5, 2.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.max_tokens < args.min_tokens or args.max_tokens > 3900:
        p.error("need min-tokens <= max-tokens <= 3900 (max_model_len 4096)")
    if args.min_chunks < 1 or args.max_chunks < args.min_chunks:
        p.error("need 1 <= min-chunks <= max-chunks")
    return args


def main() -> None:
    args = parse_args()
    if args.measure_prefill:
        measure_prefill(args)
        return
    record = run(args)
    summary = {name: s["summary"] for name, s in record["systems"].items()}
    add_ratios(summary)
    record["summary"] = summary
    record["stamp"] = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")  # the file holds the latest run
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "pressure.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    print()
    print(
        f"TTFT (last chunk -> first token) under prefill KV pressure: {MODEL}, {args.sessions} sessions/system at "
        f"{args.qps} sessions/s, delay x{args.delay_multiplier}, prefill KV {record['prefill_kv_blocks']} blocks; "
        f"x = {BASELINE} / system (>1 = faster than the non-streaming baseline)"
    )
    print(table(summary))
    print(f"saved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
