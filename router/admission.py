"""Overload admission: past the pools' capacity, new work is refused at once so that admitted work keeps its latency.

The input is what every replica last pushed in its routing stats (once a second; router/placement.py `pool_stats`):
a prefill replica reports `open_sessions`, `session_capacity`, `kv_blocks_free`, `kv_blocks_total` and
`queue_waiting`; a decode replica `active_streams` (and `stream_capacity` if it knows it). The rules
(`router.admission` in the config):

- a new **session** is admitted while some prefill replica has room for it: open sessions under
  `max_session_fill` of its capacity, and at least `min_kv_free_fraction` of its KV blocks free;
- a new **plain request** is refused only when no prefill replica can take it (each has `max_queue_per_replica`
  requests waiting or too little KV free) *and* every decode replica is saturated (`max_streams_per_decode`
  streams): with either free, it is served (decode prefills what prefill cannot).

Calls on an admitted session (chunks, responses, answers) never come here. Unknown state (no stats yet, a key
missing) admits: the replicas keep their own hard limits (prefill answers 429 past its session capacity or queue).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.placement import pool_stats
from serve_app import metrics
from serve_app.config import AdmissionConfig
from serve_app.protocol import error_body

Stats = dict[str, Any]
OVERLOADED = "server_overloaded"  # the Realtime `error` event's code for a refusal


@dataclass(frozen=True)
class Refusal:
    """Why new work was refused: `reason` for metrics and the Realtime error's code, `message` for the client."""

    reason: str
    message: str
    retry_after: int

    def payload(self) -> dict[str, Any]:
        """The OpenAI error JSON: 429, `Retry-After` from `retry_after` (serve_app/protocol.py)."""
        body = error_body(429, f"{self.message}; retry in {self.retry_after} s")
        body["error"]["retry_after"] = self.retry_after
        return body


def kv_low(stats: Stats, config: AdmissionConfig) -> bool:
    total, free = stats.get("kv_blocks_total"), stats.get("kv_blocks_free")
    if not isinstance(total, int) or not isinstance(free, int) or total <= 0:
        return False
    return free < config.min_kv_free_fraction * total


def session_room(stats: Stats, config: AdmissionConfig) -> bool:
    """Whether a prefill replica can take one more session."""
    capacity, open_ = stats.get("session_capacity"), stats.get("open_sessions")
    if isinstance(capacity, int) and isinstance(open_, int) and open_ >= config.max_session_fill * capacity:
        return False
    return not kv_low(stats, config)


def prefill_busy(stats: Stats, config: AdmissionConfig) -> bool:
    """Whether a prefill replica would queue a new whole prompt behind too many others (or evict for it)."""
    waiting = stats.get("queue_waiting")
    return (isinstance(waiting, int) and waiting >= config.max_queue_per_replica) or kv_low(stats, config)


def decode_saturated(stats: Stats, limit: int | None) -> bool:
    limit = stats.get("stream_capacity") or limit
    streams = stats.get("active_streams")
    return isinstance(limit, int) and isinstance(streams, int) and streams >= limit


class Admission:
    """The router replica's admission control; `stats(deployment)` gives each running replica's routing stats."""

    def __init__(
        self,
        config: AdmissionConfig,
        decode_capacity: int | None = None,
        stats: Callable[[str], list[Stats] | None] = pool_stats,
    ) -> None:
        self.config = config
        self.decode_capacity = config.max_streams_per_decode or decode_capacity
        self.stats = stats

    def _refuse(self, kind: str, reason: str, message: str) -> Refusal:
        metrics.inc(metrics.ADMISSIONS, 1, "router admission decisions", kind=kind, outcome="refused", reason=reason)
        return Refusal(reason, message, self.config.retry_after_s)

    def _admit(self, kind: str) -> None:
        metrics.inc(metrics.ADMISSIONS, 1, "router admission decisions", kind=kind, outcome="admitted", reason="")

    def session(self) -> Refusal | None:
        """None if a new session may be created now; otherwise why not."""
        if not self.config.enabled:
            return None
        prefill = self.stats("prefill") or []
        if prefill and not any(session_room(s, self.config) for s in prefill):
            if all(kv_low(s, self.config) for s in prefill):
                return self._refuse("session", "kv_low", "the server is overloaded: no prefill replica has KV free")
            best = min(prefill, key=lambda s: s.get("open_sessions", 0))
            sessions = f"{best.get('open_sessions')}/{best.get('session_capacity')}"
            message = f"the server is overloaded: every prefill replica is full ({sessions} sessions open at best)"
            return self._refuse("session", "sessions_full", message)
        self._admit("session")
        return None

    def request(self) -> Refusal | None:
        """None if a new plain (whole-prompt) request may start now; otherwise why not."""
        if not self.config.enabled:
            return None
        prefill, decode = self.stats("prefill") or [], self.stats("decode") or []
        prefill_full = bool(prefill) and all(prefill_busy(s, self.config) for s in prefill)
        decode_full = bool(decode) and all(decode_saturated(s, self.decode_capacity) for s in decode)
        if prefill_full and decode_full:
            message = "the server is overloaded: every prefill queue is full and every decode replica saturated"
            return self._refuse("request", "saturated", message)
        self._admit("request")
        return None
