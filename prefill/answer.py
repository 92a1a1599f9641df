"""One answer of a session, as its owner prefill replica tracks it.

The owner never sees the answer's tokens: it prepares the hand-off (the session's KV, left for decode to pull
over NIXL, and the decode request that points at it), a router claims it and streams it from decode straight
to the client, then reports the final text and usage so that the conversation can go on.

    preparing ──▶ ready ──▶ streaming ──▶ completed | cancelled | failed
        │           ▲             │
        │           └─ released ──┘   (its reader left before any text: the next reader streams it)
        └──────────┴────────────┴──────▶ failed | cancelled (hand-off refused or cancelled, reader vanished)

Closing the session cancels a hand-off in progress; an answer a router is streaming runs to its end. A cancel
(`POST .../cancel`) ends an unclaimed answer at once; one being streamed is stopped on its decode replica, which
its reader registered (`decode`), and its reader then reports it cancelled.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from core.protocol import Endpoint
    from prefill.streaming import StreamingPrefill

Status = Literal["preparing", "ready", "streaming", "completed", "cancelled", "failed"]
DONE: frozenset[str] = frozenset({"completed", "cancelled", "failed"})


@dataclass
class Answer:
    turn: int
    status: Status = "preparing"
    # The decode request (the session's whole input, `kv_transfer_params` pointing at this replica's KV).
    request: dict[str, Any] | None = None
    include_usage: bool = False  # whether the client asked for the usage frame
    overrides: dict[str, Any] = field(default_factory=dict)  # this response's settings (realtime response.create)
    handed_off_at: float | None = None  # monotonic; NIXL frees an unread hand-off after the lease
    claimed_at: float | None = None
    alive_at: float | None = None  # its reader's last sign of life (claim, registration, progress reports)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # the calls it made (chat), whole
    # The response's `id`, `created` and `model`, as decode wrote them (for replays and /result).
    response: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.monotonic)
    preparing_at: float | None = None  # monotonic: its hand-off began (at end of input, or again for a stale one)
    input_done_at: float | None = None  # monotonic: the session's streamed input settled, the hand-off request sent
    timing: dict[str, float] = field(default_factory=dict)  # where its preparation went (ms), see `mark_handed_off`
    handoffs: int = 0  # decode requests made for it (a stale hand-off is made again; each has its own request id)
    local: bool = False  # decode computes its prompt (a short input): no KV waits here for it to read
    task: asyncio.Task[None] | None = field(default=None, repr=False)  # the hand-off in progress
    # Where its reader streams it from: {"consumer", "stream_id", "replica"} (what decode's `stop` takes).
    decode: dict[str, Any] | None = None
    cancel_requested: bool = False
    # A preemptive answer that became this one (prefill/preemptive.py): the decode stream a router adopts,
    # {"replica", "parked", "stream_id", "request_id"}; `request` is then that stream's request.
    adopt: dict[str, Any] | None = None

    def mark_handed_off(self) -> None:
        """The KV is ready for decode: record how long the streamed input's last chunk took to settle (a chunk in
        flight waited for) and how long the hand-off request's prefill took, behind what else the engine ran."""
        self.handed_off_at = now = time.monotonic()
        began = self.preparing_at or self.created_at
        settled = self.input_done_at or began
        self.timing = {"input_settle_ms": (settled - began) * 1e3, "handoff_ms": (now - settled) * 1e3}

    @property
    def done(self) -> bool:
        return self.status in DONE

    def finish(self, status: Status, error: dict[str, Any] | None = None) -> None:
        self.status = status
        if error is not None:
            self.error = error
        self.request = None  # the hand-off is spent

    def summary(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "status": self.status,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "error": self.error,
            "response": self.response,
            "tool_calls": self.tool_calls,
            "timing": {k: round(v, 1) for k, v in self.timing.items()},
        }

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Answer:
        answer = cls(turn=summary["turn"], status=summary["status"], text=summary.get("text", ""))
        answer.finish_reason, answer.usage = summary.get("finish_reason"), summary.get("usage")
        answer.error, answer.response = summary.get("error"), summary.get("response") or {}
        answer.tool_calls = summary.get("tool_calls") or None
        return answer


class Prefill(Protocol):
    """The replica's prefill of a whole prompt (prefill/server.py `PrefillServer.prefill`), which makes an answer's
    hand-off: `{"kv_transfer_params", "prompt_tokens"}` or `{"error": ...}`."""

    async def __call__(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        session: StreamingPrefill | None = None,
        preemptive: bool = False,
    ) -> dict[str, Any]: ...
