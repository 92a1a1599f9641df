"""A session's preemptive answers, as records: the live one (its hand-off and parked decode stream), the
session's counts, and the fingerprint of the input each was made from (prefill/preemptive.py makes them)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from core.config import PreemptiveOptions


@dataclass
class Preemption:
    """One preemptive answer: its hand-off and its parked decode stream."""

    turn: int
    attempt: int
    fingerprint: str  # the ordinary request it answers (the session's whole input then)
    parked: str  # the decode consumer it streams to (nobody reads it until a router adopts it)
    stream_id: str
    request: dict[str, Any] = field(default_factory=dict)  # the decode request, once the hand-off is made
    replica: str | None = None  # the decode replica, once started
    task: asyncio.Task[None] | None = None  # the hand-off and decode start in progress
    started_at: float = field(default_factory=time.monotonic)
    state: PreemptState | None = None  # its session's (where discarded tokens are counted)
    start_call: asyncio.Future[Any] | None = None  # decode's `start`, once called
    ids: str = "strip"  # whether the client asked for token ids (decode's `ids` mode for its frames)


@dataclass
class PreemptState:
    options: PreemptiveOptions
    attempts: int = 0  # this turn's
    timer: asyncio.TimerHandle | None = None
    fingerprint: str = ""  # the request the session's input made when it last changed
    live: Preemption | None = None
    delivered: int = 0  # preemptive answers that became the answer
    discarded: int = 0  # preemptive answers given up (new input came, or the turn ended changed)
    discarded_tokens: int = 0  # tokens those had made on decode

    def summary(self) -> dict[str, Any]:
        return {
            **self.options.model_dump(),
            "attempts": self.attempts,
            "delivered": self.delivered,
            "discarded": self.discarded,
            "discarded_tokens": self.discarded_tokens,
            "live": self.live is not None,
            "input": input_tag(self.fingerprint),  # (a realtime connection releases a held answer made from it)
        }


def fingerprint(request: dict[str, Any]) -> str:
    return json.dumps(request, sort_keys=True, separators=(",", ":"))


def input_tag(fingerprint: str) -> str:
    """A short name for a fingerprint: a router compares the input its last call left with the input a held
    preemptive answer was made from (router/sessions/provisional.py `release_input`)."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest() if fingerprint else ""
