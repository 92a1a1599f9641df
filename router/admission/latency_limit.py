"""The router's adaptive limit on admitted work in flight (router/admission/gate.py uses it), driven by the latency from
end of input to first token: AIMD on a latency percentile, as Netflix's concurrency-limits and Envoy's adaptive
concurrency do. The target is `target_first_token_s` or `latency_tolerance` times the latency seen with no queue
(the best recent windows' P10), whichever is larger: the same defaults fit a GPU (tens of ms) and a 2-core CPU."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

from core.config import AdmissionConfig

logger = logging.getLogger("router.admission.gate")  # (its lines go where admission's go: the router's Serve log)
LOG_EVERY_S = 10.0  # the limit's state in the router's log at most this often (and at every decrease)


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile (nearest rank): no interpolation needed at these sample counts."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class LatencyLimit:
    """An AIMD limit on admitted work in flight, driven by end-of-input to first-token latency.

    Samples are taken in windows (at least `window_s` long and `min_samples` samples; or at once when the queue
    signal fires). A window whose `latency_percentile` is over the target, or with the prefill engines' mean
    waiting queue at `max_queue_waiting`, shrinks the limit to what was in flight (not the old limit, which may
    be far above it) times `backoff`, or times target/latency if that is less (not under half), at most once
    per the latency just seen: the sessions admitted before a decrease make the answers of the next one. A
    window under target grows it by `growth` of itself (at least 1) while the limit binds (in flight at 3/4 of
    it or more): an idle router's limit does not grow unbounded.
    """

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.limit = float(config.max_in_flight)  # no evidence yet: the replicas' own capacity rules
        self.samples: list[float] = []
        self.window_started = clock()
        self.hold_until = 0.0  # no second decrease before the last one could show in the latency
        self.floors: deque[float] = deque(maxlen=config.baseline_windows)  # recent windows' P10
        self.p90: float | None = None  # the last window's percentile (for messages and the log)
        self.queue: float = 0.0
        self._logged = 0.0

    @property
    def baseline(self) -> float | None:
        """The latency with no queue: the best recent window's P10."""
        return min(self.floors) if self.floors else None

    @property
    def target(self) -> float:
        baseline = self.baseline
        relative = self.config.latency_tolerance * baseline if baseline is not None else 0.0
        return max(self.config.target_first_token_s, relative)

    def observe(self, seconds: float) -> None:
        self.samples.append(max(0.0, seconds))

    def update(self, in_flight: int, queue_waiting: float | None) -> bool:
        """Close the window if it is complete and adapt the limit; whether it did."""
        now = self.clock()
        self.queue = queue_waiting or 0.0
        queued = queue_waiting is not None and queue_waiting >= self.config.max_queue_waiting
        if now - self.window_started < self.config.window_s or (
            len(self.samples) < self.config.min_samples and not queued
        ):
            return False
        samples, self.samples, self.window_started = self.samples, [], now
        over = queued
        if len(samples) >= self.config.min_samples:
            self.p90 = quantile(samples, self.config.latency_percentile)
            self.floors.append(quantile(samples, 0.1))  # (the first window is judged against its own P10)
            over = over or self.p90 > self.target
        config = self.config
        if over:
            if now >= self.hold_until:
                # The further over, the deeper the cut (a gradient, as Netflix's Gradient2): down to half at most.
                factor = max(0.5, min(config.backoff, self.target / self.p90 if self.p90 else 1.0))
                before, self.limit = self.limit, max(float(config.min_sessions), min(self.limit, in_flight) * factor)
                self.hold_until = now + max(config.window_s, self.p90 or 0.0)
                if self.limit < before:
                    self._log(in_flight, "decreased", now)
        elif in_flight >= 0.75 * self.limit:
            self.limit = min(float(config.max_in_flight), self.limit + max(1.0, config.growth * self.limit))
        if now - self._logged >= LOG_EVERY_S:
            self._log(in_flight, "at", now)
        return True

    def _log(self, in_flight: int, what: str, now: float) -> None:
        self._logged = now
        p90 = f"{self.p90:.3f}" if self.p90 is not None else "-"
        baseline = f"{self.baseline:.3f}" if self.baseline is not None else "-"
        logger.info(
            "admission limit %s %.1f: %d in flight, P90 first token %s s, target %.3f s (baseline %s s), "
            "prefill queue %.1f",
            what,
            self.limit,
            in_flight,
            p90,
            self.target,
            baseline,
            self.queue,
        )
