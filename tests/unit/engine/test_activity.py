"""An idle engine's figures are not read again: `Engine.activity` names what may have changed them, and the replicas'
periodic exports (prefill's every second, decode's every five) skip the read, a round trip that wakes the engine
core, while it stays the same."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.metrics.stats import SchedulerStats

from core.config import AppConfig
from decode.server import DecodeServer
from engine.llm import Engine
from engine.stats import TotalsStatLogger
from prefill.server import PrefillServer


class EngineCore:
    """The engine core's side of utility calls: counts them, answers `rtpd_compute_stats` with a scheduler's."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        return {"scheduler": {"queue_waiting": 0}} if method == "rtpd_compute_stats" else None


def engine() -> tuple[Engine, EngineCore, SimpleNamespace]:
    core, processor = EngineCore(), SimpleNamespace(unfinished=0)
    eng = Engine(AppConfig(), "prefill")
    eng.client = SimpleNamespace(
        engine_core=core, output_processor=SimpleNamespace(get_num_unfinished_requests=lambda: processor.unfinished)
    )
    return eng, core, processor


def test_activity_changes_with_a_step_a_request_or_a_call_that_is_not_a_read() -> None:
    eng, _, processor = engine()
    logger = TotalsStatLogger(None, 0, eng.totals, {"role": "prefill"})  # type: ignore[arg-type]
    idle = eng.activity()
    asyncio.run(eng.compute_stats())  # a read changes nothing
    assert eng.activity() == idle
    logger.record(SchedulerStats(), None)  # a step
    assert eng.activity() != idle
    after_step = eng.activity()
    processor.unfinished = 1  # a request added (or, back to 0, ended without a step: an abort)
    assert eng.activity() != after_step
    after_request = eng.activity()
    asyncio.run(eng.utility("rtpd_input_ended", "s1"))
    assert eng.activity() != after_request


def test_prefills_export_reads_the_engine_once_per_change() -> None:
    eng, core, processor = engine()
    server = SimpleNamespace(engine=eng, replica="r1", _scheduler_stats={}, _stats_read_at=None)
    export = PrefillServer.func_or_class._export_scheduler_stats

    def reads() -> int:
        asyncio.run(export(server))
        return core.calls.count("rtpd_compute_stats")

    assert reads() == 1  # the first export reads
    assert (reads(), reads()) == (1, 1)  # idle: none more
    processor.unfinished = 1
    assert (reads(), reads()) == (2, 2)  # once for the change, then idle again
    assert server._scheduler_stats == {"queue_waiting": 0}


def test_a_failed_read_is_tried_again_though_the_engine_stayed_idle() -> None:
    """Stale figures must not stay: prefill refuses new work on its last `queue_waiting` without asking the engine,
    so a read that failed once, with the engine then idle, would refuse work for good."""
    eng, core, _ = engine()
    failures = 1

    async def flaky(method: str, *args: Any) -> Any:
        nonlocal failures
        core.calls.append(method)
        if failures:
            failures -= 1
            raise TimeoutError("the engine core did not answer")
        return {"scheduler": {"queue_waiting": 0}}

    core.call_utility_async = flaky  # type: ignore[method-assign]
    server = SimpleNamespace(engine=eng, replica="r1", _scheduler_stats={"queue_waiting": 99}, _stats_read_at=None)
    export = PrefillServer.func_or_class._export_scheduler_stats
    asyncio.run(export(server))  # fails: the old figures stay for now
    assert server._scheduler_stats == {"queue_waiting": 99}
    asyncio.run(export(server))  # nothing happened since, but the last read failed: read again
    assert server._scheduler_stats == {"queue_waiting": 0}
    assert core.calls.count("rtpd_compute_stats") == 2


def test_decodes_export_reads_the_engine_only_after_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    import decode.server as decode_server

    eng, core, processor = engine()
    ticks = 0

    async def sleep(_s: float) -> None:  # one export round per tick; a request comes before the fourth
        nonlocal ticks
        ticks += 1
        if ticks == 4:
            processor.unfinished = 1
        if ticks == 7:
            raise asyncio.CancelledError

    monkeypatch.setattr(decode_server.asyncio, "sleep", sleep)
    server = SimpleNamespace(engine=eng, replica="d1", _stats={})
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(DecodeServer.func_or_class._export_stats(server))
    assert core.calls.count("rtpd_compute_stats") == 2  # the first round's, and the one after the change


def test_the_sweepers_session_gauges_are_set_only_when_a_count_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill replica's sweep, every half second: one Ray metrics call per state only when the counts moved."""
    import prefill.sweep as sweep
    from prefill.session import SessionState

    sessions: dict[str, Any] = {}
    set_gauge: list[tuple[str, int]] = []
    ticks = 0

    async def sleep(_s: float) -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 4:
            sessions["s1"] = SimpleNamespace(state=SessionState.CLOSED, closed_at=None, lock=asyncio.Lock())
        if ticks == 7:
            raise asyncio.CancelledError

    async def nothing(*_args: Any) -> None:
        return None

    monkeypatch.setattr(sweep.asyncio, "sleep", sleep)
    monkeypatch.setattr(sweep.metrics, "set_gauge", lambda name, value, *a, state: set_gauge.append((state, value)))
    table = SimpleNamespace(sessions=sessions, promote_buffered=nothing, connections_alive=dict)
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(sweep.Sweeper(table, SimpleNamespace(), nothing).run())  # type: ignore[arg-type]
    states = len(SessionState)
    assert len(set_gauge) == 2 * states  # the first tick's, and the tick after the session came
    assert set_gauge[states:] == [(s.value, int(s == SessionState.CLOSED)) for s in SessionState]
