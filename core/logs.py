"""The project's own log lines in its replicas' Serve logs (`replica_<app>_<deployment>_<id>.log`).

Ray Serve configures only its own `ray.serve` logger; without this, the INFO lines of prefill/, decode/ and
router/ (sessions created, closed, adopted, drained; resumes; refusals) would be dropped. No line carries a
prompt, a chunk or a key (tests/integration/test_logs.py checks it).

Serve writes a replica's file through a `MemoryHandler` whose target is the file's `RotatingFileHandler`
(ray/serve/_private/logging_utils.py, `configure_component_logger`). vLLM applies its logging config with
`logging.config.dictConfig` when an engine is built (`AsyncLLM.__init__` -> `configure_logging_if_needed`,
vllm/logger.py), and a non-incremental `dictConfig` closes every handler of the process
(`logging.config._clearExistingHandlers` -> `logging.shutdown`). Closing a `MemoryHandler` sets its target to
None for good: from then on it keeps every record in its buffer (which grows) and writes none. That is why the
prefill and decode replicas' files stopped at "Started initializing replica." (no access lines, none of ours)
while the router's, which builds no engine, were whole. A closed file handler reopens its file on the next
record; the memory handler needs its target back, which `setup` arranges (see `_KeepTarget`).
"""

from __future__ import annotations

import logging
import logging.handlers

PACKAGES = ("core", "engine", "prefill", "decode", "speech", "tts", "router", "serve_app")


class _KeepTarget(logging.Filter):
    """Give a `MemoryHandler` back the target that a close (vLLM's `dictConfig`) took from it.

    A filter of the handler itself, so it runs before every record the handler emits, whenever the close
    happened (during the engine's start, or any later reconfiguration); the records kept meanwhile are
    written with the next one. Always lets the record through."""

    def __init__(self, handler: logging.handlers.MemoryHandler, target: logging.Handler) -> None:
        super().__init__()
        self.handler, self.target = handler, target

    def filter(self, record: logging.LogRecord) -> bool:
        if self.handler.target is None:
            self.handler.setTarget(self.target)
        return True


def _keep_targets(handlers: list[logging.Handler]) -> None:
    for handler in handlers:
        if not isinstance(handler, logging.handlers.MemoryHandler) or handler.target is None:
            continue
        if not any(isinstance(f, _KeepTarget) for f in handler.filters):
            # First, so that it runs even for a record that Serve's own filters then drop.
            handler.filters.insert(0, _KeepTarget(handler, handler.target))


def setup(level: int = logging.INFO) -> None:
    """Route the project's loggers to Serve's handlers (call it in each deployment's constructor), and keep
    Serve's file handler working through the engine's start (vLLM closes every logging handler then)."""
    handlers = logging.getLogger("ray.serve").handlers
    _keep_targets(handlers)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = not handlers  # (outside a replica: the root logger's)
