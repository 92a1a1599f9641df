"""Decode's outbox under load: a router's frames leave a few engine steps at a time, never later than the bound."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from decode.feed import Coalesce, Outbox

JOINED = Coalesce(min_streams=3, frames=2, max_delay_s=5.0)


def _box(streams: int, coalesce: Coalesce = JOINED) -> Outbox:
    box = Outbox(coalesce)
    for i in range(streams):
        box.tasks[f"s{i}"] = None  # type: ignore[assignment]  # (running streams: only their number counts)
    return box


async def _ready(box: Outbox, wait_s: float = 0.05) -> Any:
    """The outbox's next item if it is due within `wait_s`, else None (and the take is abandoned)."""
    take = asyncio.ensure_future(box.take())
    done, _ = await asyncio.wait({take}, timeout=wait_s)
    if not done:
        take.cancel()
        return None
    return take.result()


def _step(box: Outbox, streams: int, n: int) -> None:
    for i in range(streams):
        box.put(f"s{i}", f"data: {n}\n\n")


def test_with_few_streams_each_frame_leaves_at_once() -> None:
    async def run() -> Any:
        box = _box(2)
        box.put("s0", "data: 1\n\n")
        return await _ready(box)

    assert asyncio.run(run()) == ({"s0": "data: 1\n\n"}, {}, {})


def test_under_load_a_step_waits_for_the_next_and_both_leave_in_one_write_per_stream() -> None:
    async def run() -> tuple[Any, Any]:
        box = _box(3)
        _step(box, 3, 1)
        held = await _ready(box)
        _step(box, 3, 2)
        return held, await _ready(box)

    held, joined = asyncio.run(run())
    assert held is None
    assert joined[0] == {f"s{i}": "data: 1\n\ndata: 2\n\n" for i in range(3)}


def test_under_load_a_streams_first_frame_leaves_at_once_and_the_others_wait() -> None:
    async def run() -> tuple[Any, Any, Any]:
        box = _box(6)
        _step(box, 3, 5)
        box.put("s3", "data: role\n\n", first=True)
        first = await _ready(box)
        box.end("s1")  # (an end leaves with the next item)
        held = await _ready(box)
        for sid in ("s0", "s2", "s3"):
            box.put(sid, "data: 6\n\n")
        return first, held, await _ready(box)

    first, held, rest = asyncio.run(run())
    assert first == ({"s3": "data: role\n\n"}, {}, {})
    assert held is None
    joined = {"s0": "data: 5\n\ndata: 6\n\n", "s1": "data: 5\n\n", "s2": "data: 5\n\ndata: 6\n\n"}
    assert rest[:2] == ({**joined, "s3": "data: 6\n\n"}, {"s1": None})


def test_a_held_frame_leaves_within_the_bound() -> None:
    async def run() -> tuple[Any, float]:
        box = _box(3, Coalesce(min_streams=3, frames=2, max_delay_s=0.03))
        start = time.monotonic()
        _step(box, 3, 1)
        item = await asyncio.wait_for(box.take(), 1.0)
        return item, time.monotonic() - start

    item, waited = asyncio.run(run())
    assert item[0] == {f"s{i}": "data: 1\n\n" for i in range(3)}
    assert 0.025 <= waited < 0.5


def test_a_stream_that_made_nothing_this_step_does_not_hold_the_others() -> None:
    async def run() -> Any:
        box = _box(4)  # s3 runs but makes nothing (waiting in the engine's queue)
        _step(box, 3, 1)
        _step(box, 3, 2)
        return await _ready(box)

    item = asyncio.run(run())
    assert item is not None and set(item[0]) == {"s0", "s1", "s2"}


def test_frames_put_back_by_a_feed_that_was_taken_over_are_not_held_again() -> None:
    async def run() -> Any:
        box = _box(3)
        box.restore(({"s0": "data: 1\n\n"}, {}, {}))
        return await _ready(box)

    assert asyncio.run(run()) == ({"s0": "data: 1\n\n"}, {}, {})


def test_never_joined_when_switched_off() -> None:
    async def run() -> Any:
        box = _box(50, Coalesce(min_streams=None))
        box.put("s0", "data: 1\n\n")
        return await _ready(box)

    assert asyncio.run(run()) is not None
