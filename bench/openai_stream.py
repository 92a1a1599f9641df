"""Streaming chat, this app against a plain vLLM server: token_path.py restricted to those two systems.

Kept for its earlier results' command (bench/results/openai_stream.md); token_path.py is the benchmark (it adds
Ray Serve LLM's P/D app, 128 streams, router CPU and the session APIs). `--only app|plain` still works. The helpers
other benchmarks import from here (`pct_ms`, `wait_health`) live in clients.py and systems.py.

    .venv/bin/python bench/openai_stream.py [--max-tokens 128] [--concurrency 1 32] [--only app|plain]
"""

from __future__ import annotations

import sys

from clients import pct_ms
from systems import wait_health

__all__ = ["pct_ms", "wait_health"]


def token_path_argv(argv: list[str]) -> list[str]:
    """This script's arguments as token_path.py's: app and plain, 1 and 32 streams, no sessions."""
    argv = list(argv)
    if "--only" in argv:
        i = argv.index("--only")
        argv[i : i + 2] = ["--systems", argv[i + 1]]
    defaults = {"--systems": ["app", "plain"], "--concurrency": ["1", "32"], "--session-concurrency": []}
    for flag, values in defaults.items():
        if flag not in argv:
            argv += [flag, *values]
    return [*argv, "--tag", "openai_stream"]


if __name__ == "__main__":
    import token_path

    sys.argv[1:] = token_path_argv(sys.argv[1:])
    token_path.main()
