"""The project's own log lines in its replicas' Serve logs (`replica_<app>_<deployment>_<id>.log`).

Ray Serve configures only its own `ray.serve` logger; without this, the INFO lines of prefill/, decode/ and
router/ (sessions created, closed, adopted, drained; resumes; refusals) would be dropped. No line carries a
prompt, a chunk or a key (tests/integration/test_logs.py checks it).
"""

from __future__ import annotations

import logging

PACKAGES = ("prefill", "decode", "router", "serve_app")


def setup(level: int = logging.INFO) -> None:
    """Route the project's loggers to Serve's handlers (call it in each deployment's constructor)."""
    handlers = logging.getLogger("ray.serve").handlers
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = not handlers  # (outside a replica: the root logger's)
