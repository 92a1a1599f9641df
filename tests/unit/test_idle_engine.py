"""serve_app/idle_engine.py: an engine whose only requests wait for decode to read their KV waits for input (up to
`POLL_S`) after an empty step instead of stepping again at once."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app import idle_engine


class Scheduler:
    def __init__(self, unfinished: int = 0, held: int = 0, finished: set[str] | None = None, push: bool = False):
        self.unfinished, self.finished_req_ids = unfinished, finished or set()
        self.requests = {f"r{i}": None for i in range(unfinished + held)}
        self.connector = SimpleNamespace(has_pending_push_work=lambda: push)

    def has_unfinished_requests(self) -> bool:
        return self.unfinished > 0

    def get_request_counts(self) -> tuple[int, int]:
        return self.unfinished, 0


@pytest.mark.parametrize(
    ("scheduler", "held"),
    [
        (Scheduler(held=1), True),
        (Scheduler(), False),  # (nothing at all: vLLM's loop blocks on its input by itself)
        (Scheduler(unfinished=1, held=1), False),
        (Scheduler(held=1, finished={"r0"}), False),  # (its finish goes to the worker in the next step)
        (Scheduler(held=1, push=True), False),
    ],
)
def test_only_held_kv(scheduler: Scheduler, held: bool) -> None:
    assert idle_engine.only_held_kv(scheduler) is held


class Core:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.handled: list[Any] = []

    def _handle_client_request(self, *request: Any) -> None:
        self.handled.append(request)


@pytest.fixture
def step(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(idle_engine, "_original", lambda core: False)  # (an empty step)
    monkeypatch.setattr(idle_engine, "POLL_S", 2.0)
    return idle_engine._step


def test_an_empty_step_with_kv_held_waits_for_input(step: Any) -> None:
    core = Core(Scheduler(held=1))
    started = time.perf_counter()
    step(core)
    assert time.perf_counter() - started >= 1.9 and core.handled == []


def test_input_that_comes_meanwhile_is_taken_at_once(step: Any) -> None:
    core = Core(Scheduler(held=1))
    threading.Timer(0.05, core.input_queue.put, args=(("ADD", "request"),)).start()
    started = time.perf_counter()
    step(core)
    assert time.perf_counter() - started < 1.5 and core.handled == [("ADD", "request")]


def test_other_work_steps_on(step: Any) -> None:
    core = Core(Scheduler(unfinished=1, held=1))
    started = time.perf_counter()
    step(core)
    assert time.perf_counter() - started < 1.0
