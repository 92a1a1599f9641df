"""The router's admission queue: new work that admission cannot take now waits here, first come first served,
while its expected wait stays under the config's bound (`router.admission.max_wait_s`), instead of being refused.

A plain server queues every request in its engine and serves them all, only later; refusing the same request with
a 429 is worse for the client unless waiting would be worse than a retry. So the router refuses only when the
expected wait is past the bound (at once, with that wait as Retry-After) or when a waiter has waited the bound out.

The expected wait follows Little's law: the waiters ahead plus one, over the rate at which admitted work has been
leaving (over the gaps between its releases in the last `RATE_WINDOW_S`). With fewer than two seen, work is not
leaving (every slot held by long sessions, say): the wait has no bound, and the newcomer is refused at once.
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

RATE_WINDOW_S = 30.0  # releases older than this no longer count in the rate
MIN_SPAN_S = 0.1  # (a burst of releases at once is not an infinite rate)
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
        self.releases: deque[float] = deque(maxlen=512)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.waiters)

    def released(self) -> None:
        self.releases.append(self.clock())

    def rate(self) -> float | None:
        """Releases per second lately: over the gaps between recent releases, and no more than one over the quiet
        since the last (None: fewer than two in the window)."""
        now = self.clock()
        while self.releases and now - self.releases[0] > RATE_WINDOW_S:
            self.releases.popleft()
        if len(self.releases) < 2:
            return None
        rate = (len(self.releases) - 1) / max(MIN_SPAN_S, self.releases[-1] - self.releases[0])
        quiet = now - self.releases[-1]
        return min(rate, 1 / quiet) if quiet > 0 else rate

    def expected_wait(self, ahead: int | None = None) -> float:
        """Seconds until a newcomer (or the waiter with `ahead` others before it) is likely admitted: infinite
        when work is not leaving."""
        ahead = len(self.waiters) if ahead is None else ahead
        rate = self.rate()
        return math.inf if rate is None else (ahead + 1) / rate

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
