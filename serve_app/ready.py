"""Print one line when the app at `--url` is ready to serve (`make run` starts this beside `serve run`).

    python -m serve_app.ready --url http://127.0.0.1:8000 --watch-pid <pid of serve run>

Polls `/health` (503 until every engine answers: prefill, decode, speech, TTS) and exits once it is 200, or when the
watched process is gone, or after `--timeout` seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--watch-pid", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    while time.monotonic() - started < args.timeout and _alive(args.watch_pid):
        try:
            health = httpx.get(f"{args.url}/health", timeout=5)
            if health.status_code == 200:
                model = httpx.get(f"{args.url}/v1/models", timeout=5).json()["data"][0]["id"]
                waited = time.monotonic() - started
                print(f"realtime-pd ready: {args.url} serves {model} (up in {waited:.0f} s)", flush=True)
                return 0
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(args.interval)
    print(f"realtime-pd not ready at {args.url} (gave up after {time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
