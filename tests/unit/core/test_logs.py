"""core/logs.py: the project's lines (and Serve's own) reach a replica's Serve log file even after vLLM has
applied its logging config, which closes every handler of the process (a non-incremental `dictConfig`)."""

from __future__ import annotations

import logging
import logging.config
import logging.handlers
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.serve._private.logging_utils import configure_component_logger
from ray.serve.schema import LoggingConfig

from core import logs

SERVE = "ray.serve"


@pytest.fixture
def replica_log(tmp_path: Path) -> Iterator[Path]:
    """The `ray.serve` logger as Serve sets it up in a replica (no Ray needed): returns the log file."""
    loggers = {name: logging.getLogger(name) for name in (SERVE, *logs.PACKAGES)}
    saved = {name: (lg.handlers[:], lg.propagate, lg.level) for name, lg in loggers.items()}
    configure_component_logger(
        component_name="app_prefill",
        component_id="t1",
        logging_config=LoggingConfig(logs_dir=str(tmp_path)),
        max_bytes=1 << 20,
        backup_count=1,
    )
    logging.getLogger(SERVE).info("Started initializing replica.")
    (path,) = tmp_path.glob("*.log")
    yield path
    for name, (handlers, propagate, level) in saved.items():
        logger = loggers[name]
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.handlers[:], logger.propagate, logger.level = handlers, propagate, level


def vllm_configures_logging() -> None:
    """What vLLM does while an engine is built (vllm/logger.py `_configure_vllm_root_logger`): a dictConfig
    that is not incremental, so `logging.config._clearExistingHandlers` closes every handler there is."""
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})


def test_lines_reach_the_file_after_the_engine_reconfigured_logging(replica_log: Path) -> None:
    logs.setup()  # in the constructor, before the engine
    vllm_configures_logging()  # the engine's start

    logging.getLogger("prefill.server").info("session s1 adopted")
    logging.getLogger(SERVE).info("GET /v1/chat/completions 200 3.1ms")  # as Serve's access lines go

    text = replica_log.read_text()
    assert "Started initializing replica." in text
    assert "session s1 adopted" in text
    assert "GET /v1/chat/completions 200" in text
    (memory,) = [h for h in logging.getLogger(SERVE).handlers if isinstance(h, logging.handlers.MemoryHandler)]
    assert memory.buffer == []  # written, not piling up in memory


def test_setup_is_idempotent(replica_log: Path) -> None:
    logs.setup()
    logs.setup()
    vllm_configures_logging()
    logging.getLogger("decode.server").info("resumed r1")
    assert replica_log.read_text().count("resumed r1") == 1
    (memory,) = [h for h in logging.getLogger(SERVE).handlers if isinstance(h, logging.handlers.MemoryHandler)]
    assert sum(isinstance(f, logs._KeepTarget) for f in memory.filters) == 1
