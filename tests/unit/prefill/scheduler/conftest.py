from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefill.scheduler import core
from tests.unit.prefill.scheduler.harness import FakeClock, Harness


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(core, "time", fake)
    return fake


@pytest.fixture
def make(clock: FakeClock) -> Callable[..., Harness]:
    """`make(policy=..., eviction=..., num_blocks=..., budget=..., swap_slots=...)` -> a Harness."""

    def build(**kwargs: Any) -> Harness:
        return Harness(clock, **kwargs)

    return build
