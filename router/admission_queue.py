"""The router's admission queue: new work that admission cannot take now waits here, first come first served,
while its expected wait stays under the config's bound (`router.admission.max_wait_s`), instead of being refused.

A plain server queues every request in its engine and serves them all, only later; refusing the same request with
a 429 is worse for the client unless waiting would be worse than a retry. So the router refuses only when the
expected wait is past the bound (at once, with that wait as Retry-After) or when a waiter has waited the bound out.

The expected wait follows Little's law: each of the `in_flight` holders frees its room after the mean time admitted
work has been held lately, so room frees every `hold / in_flight` seconds, and the newcomer has the waiters ahead of
it plus one to wait for. Before any release the holders' mean age stands in for the hold (a lower bound); with
nothing in flight here (the room is held elsewhere: sessions of other routers) no wait can be promised, and the
newcomer is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

HOLDS_KEPT = 256  # the mean hold is taken over this many recent releases
POLL_S = 0.25  # while anyone waits, admission is tried again this often (the replicas' stats change on their own)


@dataclass(order=True)
class Waiter:
    """One queued piece of work: served in `seq` order; `kind` picks the rule it is admitted by."""

    seq: int
    kind: str = field(compare=False)
    future: asyncio.Future = field(compare=False, repr=False)
    since: float = field(compare=False, default=0.0)


class WaitQueue:
    """Waiters in arrival order, the release rate they are served at, and the expected wait of a newcomer."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.waiters: deque[Waiter] = deque()
        self.holds: deque[float] = deque(maxlen=HOLDS_KEPT)  # how long recently released work was held
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.waiters)

    def released(self, held_s: float) -> None:
        self.holds.append(held_s)

    def expected_wait(self, in_flight: int, ages: list[float], ahead: int | None = None) -> float:
        """Seconds until a newcomer (or the waiter with `ahead` others before it) is likely admitted, with
        `in_flight` holders whose ages are `ages`: infinite when none holds room here."""
        if in_flight <= 0:
            return math.inf
        ahead = len(self.waiters) if ahead is None else ahead
        samples = self.holds or ages
        hold = sum(samples) / len(samples) if samples else math.inf
        return (ahead + 1) * hold / in_flight

    def push(self, kind: str) -> Waiter:
        waiter = Waiter(next(self._seq), kind, asyncio.get_running_loop().create_future(), self.clock())
        self.waiters.append(waiter)
        return waiter

    def remove(self, waiter: Waiter) -> None:
        with contextlib.suppress(ValueError):  # (already admitted, or gone)
            self.waiters.remove(waiter)


def retry_after(seconds: float, floor: int, ceiling: int) -> int:
    """A Retry-After in whole seconds, within the config's bounds."""
    return min(ceiling, max(floor, math.ceil(seconds)))
