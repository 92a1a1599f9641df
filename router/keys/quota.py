"""Per-API-key token budgets: `limits.tokens_per_minute_per_key`, on each router replica.

A token bucket per key (the key's id, never the key): it holds at most a minute's tokens and refills
continuously. A request is admitted while its key's bucket is not empty and is charged, once it is over, the
tokens it really used (prompt + completion, from its usage); a bucket may go below zero, and its key then
waits (429 with `Retry-After`) until it has refilled. Admission looks at what was spent, not at what a
request may spend, as OpenAI's own rate limits do for streamed answers.
"""

from __future__ import annotations

import math
import time
from typing import Any


class TokenBudgets:
    def __init__(self, per_minute: int | None) -> None:
        self.per_minute = per_minute
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens left, when)

    @property
    def enabled(self) -> bool:
        return self.per_minute is not None

    def _level(self, key: str, now: float) -> float:
        assert self.per_minute is not None
        left, at = self._buckets.get(key, (float(self.per_minute), now))
        return min(float(self.per_minute), left + (now - at) * self.per_minute / 60.0)

    def retry_after(self, key: str) -> int | None:
        """None if `key` may start a request now; otherwise the seconds until it may."""
        if not self.enabled or not key:
            return None
        assert self.per_minute is not None
        level = self._level(key, time.monotonic())
        if level > 0:
            return None
        return max(1, math.ceil(-level * 60.0 / self.per_minute + 1e-9))

    def charge(self, key: str, usage: dict[str, Any] | None) -> None:
        """What a request used (its OpenAI `usage`), taken from its key's bucket."""
        if not self.enabled or not key or not isinstance(usage, dict):
            return
        tokens = usage.get("total_tokens")
        if not isinstance(tokens, int):
            tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        now = time.monotonic()
        self._buckets[key] = (self._level(key, now) - tokens, now)
        if len(self._buckets) > 100_000:  # full buckets carry no state: forget them
            self._buckets = {k: v for k, v in self._buckets.items() if self._level(k, now) < self.per_minute}
