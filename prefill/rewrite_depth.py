"""How deep this replica's sessions rewrite their input: the prefix of a new version that is likely to survive.

Update-mode input (a vector search re-ranking its documents, a voice transcript revising its tail) keeps the top
of each version and rewrites the rest. Streaming the rewritten part is work not streaming never does: on the
update trace about half of it was the first version's tail, prefilled before any rewrite had been seen. This
replica-wide record of rewrites (the common prefix each kept, as a share of the version it replaced) gives a
session's sender the share of a fresh version that past rewrites almost always kept (`QUANTILE` of the recent
ones); the rest waits until the version has stood unchanged for the sender's quiet time, or for end of input,
when the hand-off computes it as `on_end_only` would. Sessions that append (the common case: a crawler, a
transcript growing) keep streaming everything: a session stops being held once it extends its input.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# A change that keeps all but this many of the previous version's tokens is an append (a chunk boundary that fell
# inside a word is re-tokenized), not a rewrite.
RETOKENIZED_TOKENS = 8
QUANTILE = 0.1  # the share of a version kept by all but the deepest tenth of recent rewrites
MIN_REWRITES = 8  # below this many recent rewrites nothing is held (no evidence yet)
WINDOW = 128  # rewrites remembered
MAX_AGE_S = 600.0  # and for this long: a replica whose traffic stopped rewriting stops holding


def is_rewrite(previous_len: int, lcp: int) -> bool:
    """Whether a version keeping `lcp` tokens of a `previous_len`-token one rewrote it (not merely extended it)."""
    return lcp < previous_len - RETOKENIZED_TOKENS


class RewriteDepth:
    """The kept share of recent rewrites on this replica; `hold_fraction` is what a fresh version may stream."""

    def __init__(
        self,
        window: int = WINDOW,
        quantile: float = QUANTILE,
        min_rewrites: int = MIN_REWRITES,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kept: deque[tuple[float, float]] = deque(maxlen=window)  # (when, kept share)
        self.quantile, self.min_rewrites, self.max_age_s, self.clock = quantile, min_rewrites, max_age_s, clock

    def record(self, previous_len: int, lcp: int) -> None:
        if previous_len > 0 and is_rewrite(previous_len, lcp):
            self.kept.append((self.clock(), lcp / previous_len))

    def hold_fraction(self) -> float:
        """The share of a version to stream before it has stood unchanged (1.0: all of it, no rewrites seen)."""
        cutoff = self.clock() - self.max_age_s
        while self.kept and self.kept[0][0] < cutoff:
            self.kept.popleft()
        if len(self.kept) < self.min_rewrites:
            return 1.0
        ordered = sorted(share for _, share in self.kept)
        return ordered[int(self.quantile * (len(ordered) - 1))]
