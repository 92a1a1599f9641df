"""The router's admission queue: new work that admission cannot take now waits here, first come first served,
while its expected wait stays under the config's bound (`router.admission.max_wait_s`), instead of being refused.

A plain server queues every request in its engine and serves them all, only later; refusing the same request with
a 429 is worse for the client unless waiting would be worse than a retry. So the router refuses only when the
expected wait is past the bound (at once, with that wait as Retry-After) or when a waiter has waited the bound out.

The expected wait follows Little's law, per kind (sessions, plain requests): each of the kind's holders here frees
its room after the time the kind's work has been held (the mean over its releases of the last `HOLD_WINDOW_S`, or
the holders' mean age if longer: long sessions), so room frees every `hold / holders` seconds, and the newcomer has
the kind's waiters ahead of it plus one to wait for. With none of the kind released lately, or none held here (the
room is held elsewhere: sessions of other routers), no wait can be promised, and the newcomer is refused at once.
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

HOLDS_KEPT = 256  # the mean hold is taken over at most this many recent releases of a kind
HOLD_WINDOW_S = 60.0  # ... released no longer ago than this
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
        self.holds: dict[str, deque[tuple[float, float]]] = {}  # kind -> (released at, held for), recent ones
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.waiters)

    def released(self, kind: str, held_s: float) -> None:
        self.holds.setdefault(kind, deque(maxlen=HOLDS_KEPT)).append((self.clock(), held_s))

    def expected_wait(self, kind: str, ages: list[float]) -> float:
        """Seconds until a newcomer of `kind` is likely admitted, with the kind's holders here `ages` old:
        infinite when no wait can be promised."""
        holds, now = self.holds.get(kind, ()), self.clock()
        recent = [held for at, held in holds if now - at <= HOLD_WINDOW_S]
        if not ages or not recent:
            return math.inf
        hold = max(sum(recent) / len(recent), sum(ages) / len(ages))
        ahead = sum(1 for waiter in self.waiters if waiter.kind == kind)
        return (ahead + 1) * hold / len(ages)

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
