"""The soak run: an hour of mixed traffic at about 70 % of capacity on the default config; nothing may grow.

1. Start the app (configs/config.yaml, as `make run` serves it, on its own Ray cluster and port) and answer one of
   each kind to warm it.
2. Calibrate: open-loop (Poisson) arrivals of the mix (bench/soak_traffic.py: streamed chats, REST sessions of
   several chunks, realtime text sessions, NDJSON bodies, spoken turns) at rising rates, `--calib-step-s` each.
   A rate holds when no answer fails (a 429 / 1013 counts), the answers are served at >= 90 % of the offered rate
   (measured to the last one's end) and the text answers' TTFT P90 is within max(3x, +1 s) of the first step's.
   Capacity is the highest rate that held (one bisection between it and the first that did not).
3. Soak: Poisson arrivals at `--load` (0.7) x capacity for `--duration-s`, sampling every `--sample-s` each
   process's RSS, fds and threads (bench/soak_probe.py) and the app's state; a line per sample on the terminal.
4. Stop, let the app settle, sample it idle; then judge (bench/soak_report.py): every series flat after
   `--warmup-s`, everything back to 0 once idle, the last `--window-s` of latency at most 10 % over the first window
   after the warm-up, no errors. Writes bench/results/soak.{json,md} and soak_*.png.

    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/soak.py            # the hour
    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/soak.py --quick    # 4 minutes, a sample every 15 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import record as record_io
import soak_plots
import soak_probe
import soak_report
import systems
import yaml
from soak_traffic import MIX, TEXT_KINDS, Answer, Traffic
from token_path import machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=3600)
    parser.add_argument("--sample-s", type=float, default=60)
    parser.add_argument("--warmup-s", type=float, default=600, help="left out of the slopes")
    parser.add_argument("--window-s", type=float, default=600, help="latency: first window after warm-up vs last")
    parser.add_argument("--load", type=float, default=0.7, help="the soak's rate as a share of capacity")
    parser.add_argument("--rate", type=float, default=None, help="skip calibration: this capacity (arrivals/s)")
    parser.add_argument("--calib-start", type=float, default=1.0, help="calibration's first rate (arrivals/s)")
    parser.add_argument("--calib-factor", type=float, default=1.5)
    parser.add_argument("--calib-step-s", type=float, default=60)
    parser.add_argument("--calib-max-steps", type=int, default=10)
    parser.add_argument("--settle-s", type=float, default=60, help="after the traffic, wait this long to be idle")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--port", type=int, default=8981)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "config.yaml")
    parser.add_argument("--name", default="soak", help="result files: <name>.json, <name>.md, <name>_*.png")
    parser.add_argument("--quick", action="store_true", help="4 minutes, a sample every 15 s, 1 minute of warm-up")
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.sample_s, args.warmup_s, args.window_s = 240, 15, 60, 60
        args.calib_step_s, args.settle_s = 20, 45
    return args


# --- calibration ---------------------------------------------------------------------------------------
def step_figures(rate: float, answers: list[Answer], started: float, step_s: float) -> dict[str, Any]:
    ok = [a for a in answers if a.sample.error is None]
    end = max((a.done for a in answers), default=started + step_s)
    text = soak_report.latency([a for a in answers if a.kind in TEXT_KINDS])
    return {
        "rate": round(rate, 3),
        "arrivals": len(answers),
        "offered_per_s": len(answers) / step_s,
        "served_per_s": len(ok) / max(end - started, step_s),
        "errors": soak_report.errors(answers),
        "ttft_p50_ms": text["ttft_p50_ms"],
        "ttft_p90_ms": text["ttft_p90_ms"],
        "drain_s": max(0.0, end - started - step_s),
    }


def holds(step: dict[str, Any], base_p90: float | None) -> str | None:
    """Why the step shows overload, or None."""
    if step["errors"]:
        return f"errors {step['errors']}"
    if step["served_per_s"] < 0.9 * step["offered_per_s"]:
        return f"served {step['served_per_s']:.2f}/s of {step['offered_per_s']:.2f}/s offered"
    p90 = step["ttft_p90_ms"]
    if base_p90 is not None and p90 is not None and p90 > max(3 * base_p90, base_p90 + 1000):
        return f"TTFT P90 {p90:.0f} ms against {base_p90:.0f} ms at the first step"
    return None


async def calibrate(traffic: Traffic, args: argparse.Namespace, app: str) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    base_p90, passed, failed, bisected = None, None, None, False
    rate = args.calib_start
    for _ in range(args.calib_max_steps):
        started = traffic.now()
        step = step_figures(rate, await traffic.run(rate, args.calib_step_s), started, args.calib_step_s)
        base_p90 = base_p90 if base_p90 is not None else step["ttft_p90_ms"]
        step["overload"] = holds(step, base_p90)
        steps.append(step)
        print(
            f"  calibration {rate:6.2f}/s: served {step['served_per_s']:.2f}/s, TTFT P50/P90 "
            f"{_ms(step['ttft_p50_ms'])}/{_ms(step['ttft_p90_ms'])} ms, drain {step['drain_s']:.0f} s"
            f"{', OVERLOAD: ' + step['overload'] if step['overload'] else ''}",
            flush=True,
        )
        await asyncio.to_thread(wait_idle, app, args.settle_s)
        if step["overload"] is None:
            passed = rate
        else:
            failed = rate if failed is None else min(failed, rate)
        if failed is None:
            rate *= args.calib_factor
            continue
        if passed is None or bisected:
            break
        bisected, rate = True, math.sqrt(passed * failed)  # one step between the last that held and the first not
    capacity = passed if passed is not None else args.calib_start / args.calib_factor
    return {"steps": steps, "capacity_per_s": capacity, "held": passed is not None, "first_overload_per_s": failed}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


# --- sampling ------------------------------------------------------------------------------------------
def take_sample(app: str, t: float, phase: str) -> dict[str, Any]:
    procs = soak_probe.process_figures(soak_probe.processes(app))
    return {"t": round(t, 1), "phase": phase, "procs": procs, "state": soak_probe.app_state(app)}


def wait_idle(app: str, timeout_s: float) -> dict[str, float]:
    """Until every state gauge reads 0 (or the timeout); the last reading."""
    deadline = time.monotonic() + timeout_s
    while any((state := soak_probe.app_state(app)).values()) and time.monotonic() < deadline:
        time.sleep(2)
    return state


def progress(sample: dict[str, Any], traffic: Traffic, since: float) -> str:
    recent = [a for a in traffic.answers if since <= a.done and a.done > 0]
    text = soak_report.latency([a for a in recent if a.kind in TEXT_KINDS])
    errors = sum(a.sample.error is not None for a in traffic.answers)
    procs, st = sample["procs"], sample["state"]
    rss = {k: v["rss_mib"] for k, v in procs.items()}
    main = " ".join(f"{k.split()[0][:7]}={rss[k]:.0f}" for k in ("router", "prefill", "decode", "speech") if k in rss)
    kv = f"{st.get('prefill_kv_blocks_used', 0):.0f}/{st.get('decode_kv_blocks_used', 0):.0f}"
    return (
        f"t={sample['t']:6.0f}s done {len(recent):4d} err {errors:3d} TTFT P50/P90 {_ms(text['ttft_p50_ms'])}/"
        f"{_ms(text['ttft_p90_ms'])} ms | sessions {st.get('sessions_open', 0):.0f} KV p/d {kv} journal "
        f"{st.get('journal_records', 0)} | RSS MiB {main} all={sum(rss.values()):.0f} | fds "
        f"{sum(v['fds'] for v in procs.values())} threads {sum(v['threads'] for v in procs.values())}"
    )


async def soak(traffic: Traffic, rate: float, args: argparse.Namespace, app: str) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    traffic.t0 = time.perf_counter()  # the soak's clock starts here; calibration's answers are not its
    traffic.answers.clear()
    done = asyncio.Event()

    async def sampler() -> None:
        last = 0.0
        while True:
            sample = await asyncio.to_thread(take_sample, app, traffic.now(), "load")
            samples.append(sample)
            print(progress(sample, traffic, last), flush=True)
            last = sample["t"]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), args.sample_s - (traffic.now() - last))
                return

    task = asyncio.create_task(sampler())
    await traffic.run(rate, args.duration_s)
    done.set()
    await task
    return samples


# --- the run -------------------------------------------------------------------------------------------
async def drive(base: str, model: str, args: argparse.Namespace, app: str) -> dict[str, Any]:
    quiet()
    traffic = Traffic(base, model, args.max_tokens, args.seed)
    try:
        for kind in MIX:  # the first answers are slow (the engines' first batches): warm each path once
            answer = await traffic.single(kind)
            print(
                f"  warm-up {kind}: {answer.sample.error or 'ok'} in {answer.done - answer.arrived:.1f} s", flush=True
            )
        t0 = time.perf_counter()
        if args.rate is None:
            calibration = await calibrate(traffic, args, app)
        else:
            calibration = {"steps": [], "capacity_per_s": args.rate, "held": True, "given": True}
        calibration["took_s"] = time.perf_counter() - t0
        rate = args.load * calibration["capacity_per_s"]
        print(
            f"capacity {calibration['capacity_per_s']:.2f} arrivals/s; soak at {rate:.2f}/s ({args.load:.0%})",
            flush=True,
        )
        samples = await soak(traffic, rate, args, app)
        await asyncio.to_thread(wait_idle, app, args.settle_s)
        samples.append(await asyncio.to_thread(take_sample, app, traffic.now(), "idle"))
        return {
            "calibration": calibration,
            "rate": rate,
            "samples": samples,
            "answers": traffic.answers,
        }
    finally:
        await traffic.close()


def quiet() -> None:
    """Library log lines off the terminal (Serve sets its logger's level when it starts: call after)."""
    for name in ("ray", "ray.serve", "httpx", "httpcore", "websockets"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main() -> None:
    args = parse_args()
    quiet()
    app_args: dict[str, Any] = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    systems.PORTS["app"] = args.port
    started = datetime.now(timezone.utc)
    print(f"starting the app ({record_io.relative(str(args.config))}) on port {args.port} ...", flush=True)
    with systems.app(app_args) as system:
        run = asyncio.run(drive(system.base, system.model, args, systems.APP_NAME))
    record = judge(run, args, started)
    write(record, run, args)


def judge(run: dict[str, Any], args: argparse.Namespace, started: datetime) -> dict[str, Any]:
    samples, answers = run["samples"], run["answers"]
    start, end = args.warmup_s, args.duration_s
    rows = soak_report.verdicts(samples, args.warmup_s)
    idle = next((s for s in samples if s["phase"] == "idle"), None)
    lat = soak_report.latency_windows(answers, start, end, args.window_s)
    errors = soak_report.errors(answers)
    record = {
        "timestamp": started.strftime("%Y%m%dT%H%M%SZ"),
        "command": record_io.command(),
        "machine": machine(),
        "quick": args.quick,
        "settings": record_io.portable(vars(args))
        | {
            "mix": MIX,
            "floors": soak_report.FLOORS,
            "rel_bound": soak_report.REL_BOUND,
            "latency_bound": soak_report.LATENCY_BOUND,
        },
        "calibration": run["calibration"],
        "capacity_per_s": run["calibration"]["capacity_per_s"],
        "rate_per_s": run["rate"],
        "arrivals": len(answers),
        "errors": errors,
        "restarts": soak_report.restarts(samples),
        "by_kind": soak_report.by_kind(answers),
        "latency": lat,
        "slopes": rows,
        "idle": soak_report.idle_checks(idle, args.settle_s),
    }
    record["verdict"] = {
        "flat": all(r["flat"] for r in rows),
        "idle": all(c["ok"] for c in record["idle"]),
        "latency": all(c["ok"] for c in lat["checks"]),
        "no_errors": not errors and not record["restarts"],
    }
    return record


def write(record: dict[str, Any], run: dict[str, Any], args: argparse.Namespace) -> None:
    import soak_markdown

    edges = [s["t"] for s in run["samples"] if s["phase"] == "load"] + [args.duration_s]
    rows = soak_report.buckets(run["answers"], edges)
    plots = soak_plots.all_plots(soak_report.series(run["samples"]), rows, RESULTS, args.name, args.warmup_s)
    record["plots"] = [record_io.relative(str(p)) for p in plots]
    record["intervals"], record["samples"] = rows, run["samples"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    text = soak_markdown.markdown(record)
    (RESULTS / f"{args.name}.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
