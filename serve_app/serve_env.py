"""Ray Serve process settings this app is tuned for: environment variables every Serve process reads at start.

Serve's proxy hands each HTTP request to the router replica, and the router's answers back, over gRPC instead
of Ray object references (`RAY_SERVE_PROXY_USE_GRPC`); the router's own calls to prefill and decode do the same
through their handles (`_by_reference=False`, router/app.py). Measured with bench/token_path.py on this
machine: 1.7-1.9x the tokens/s at 32 and 128 streams and a third less TTFT at one stream, with the router and
proxy using half the CPU per token (bench/README.md).

`make run` and KubeRay manifests set them; set them yourself before `serve run` or `ray start`:

    export $(python -m serve_app.serve_env)
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    # By-value calls carry whole requests and answers (a session's conversation, a non-streaming answer with
    # logprobs): gRPC's default 4 MiB cap would refuse the large ones.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(512 * 2**20),
}


def apply() -> None:
    """Into this process's environment (before it starts Ray, whose processes inherit it), unless set."""
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)


if __name__ == "__main__":
    print(" ".join(f"{k}={v}" for k, v in SERVE_ENV.items()))
