"""Overload admission: past the pools' capacity, new work waits in the router's queue (router/admission/queue.py)
while it can be served in time, and is refused beyond, so that admitted work keeps its latency.

The input is what every replica last pushed in its routing stats (once a second; core/placement.py `pool_stats`;
only with `router.admission.pool_stats` on, off by default until the fault its comment names is fixed):
a prefill replica reports `open_sessions`, `session_capacity`, `kv_blocks_free`, `kv_blocks_total` and
`queue_waiting`; a decode replica `active_streams` (and `stream_capacity` if it knows it). The rules
(`router.admission` in the config):

- a new **session** is admitted while some prefill replica has room for it: open sessions under
  `max_session_fill` of its capacity, and at least `min_kv_free_fraction` of its KV blocks free;
- a new **plain request** waits only while no prefill replica can take it (each has `max_queue_per_replica`
  requests waiting or too little KV free) *and* every decode replica is saturated (`max_streams_per_decode`
  streams): with either free, it is served (decode prefills what prefill cannot), and the engines queue it as a
  plain vLLM server would.

Calls on an admitted session (chunks, responses, answers) never come here. Unknown state (no stats yet, a key
missing) admits: the replicas keep their own hard limits (prefill answers 429 past its session capacity or queue).

Capacity in slots is not capacity in latency: a replica with room for 96 sessions may serve them slowly. So each
router replica also keeps an **adaptive limit** on the sessions it admitted that are still open (`LatencyLimit`,
router/admission/latency_limit.py), as Netflix's concurrency-limits (AIMD on a latency percentile) and Envoy's adaptive
concurrency do: it observes the time from end of input to first token of every session answer it streams, and per
window of samples shrinks the limit multiplicatively while their P90 is over the target (or the prefill engines'
waiting queues are long: the early signal) and grows it additively while under, never under `min_sessions`.
Sessions hold KV between chunks and are what input latency is promised to; plain requests are not bounded by it
(cutting them could not make a session's answer faster: the engines' queues order them). Each admission returns
a `Ticket`, released when the session or request ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core import metrics
from core.config import AdmissionConfig
from core.placement import pool_stats
from core.protocol import error_body, error_status
from router.admission.latency_limit import LatencyLimit
from router.admission.queue import POLL_S, WaitQueue, retry_after

logger = logging.getLogger(__name__)

Stats = dict[str, Any]
OVERLOADED = "server_overloaded"  # the Realtime `error` event's code for a refusal
IDLE_GRACE_S = 1.0  # past a REST session's idle timeout, before its ticket here is dropped (its owner's sweep)


@dataclass(frozen=True)
class Why:
    """Why new work cannot be admitted now: `reason` for metrics and codes, `message` for the client."""

    reason: str
    message: str


@dataclass(frozen=True)
class Refusal:
    """Why new work was refused: `reason` for metrics and the Realtime error's code, `message` for the client."""

    reason: str
    message: str
    retry_after: int

    def payload(self) -> dict[str, Any]:
        """The OpenAI error JSON: 429, `Retry-After` from `retry_after` (core/protocol.py)."""
        body = error_body(429, f"{self.message}; retry in {self.retry_after} s")
        body["error"]["retry_after"] = self.retry_after
        return body


class Ticket:
    """One admitted session or request, counted in flight until `release()` (idempotent: every way out of a
    session or request may call it)."""

    def __init__(self, owner: Admission | None = None, kind: str = "") -> None:
        self.owner, self.kind = owner, kind
        self.admitted_at = time.monotonic()

    def release(self) -> None:
        if self.owner is not None:
            self.owner._release(self)
            self.owner = None


class HeldSession:
    """A REST session's ticket, with when a call on the session last came through this router, when the router
    last asked its owner about it, and its API key's id (to ask as)."""

    def __init__(self, ticket: Ticket, idle_timeout_s: float, clock: Callable[[], float], tenant: str = "") -> None:
        self.ticket, self.idle_timeout_s, self.tenant = ticket, idle_timeout_s, tenant
        self.seen_at = self.checked_at = clock()

    def idle(self, now: float) -> bool:
        return now - self.seen_at > self.idle_timeout_s + IDLE_GRACE_S


async def admit_session(ingress: Any) -> Refusal | Ticket:
    """The ingress's decision on a new session, after a wait in the queue if need be: a refusal, or the session's
    ticket (a no-op one where the ingress has no admission control, as in unit tests' fakes)."""
    admission = getattr(ingress, "admission", None)
    decided = await admission.admit("session") if admission is not None else None
    return decided if decided is not None else Ticket()


def release_session(ingress: Any, session_id: str) -> None:
    """A REST session's ticket, by id, when it ends here (deleted, or its answer read to its end)."""
    if (admission := getattr(ingress, "admission", None)) is not None and hasattr(admission, "release_session"):
        admission.release_session(session_id)


def bind_session(
    ingress: Any, session_id: str, ticket: Ticket, idle_timeout_s: float | None = None, tenant: str = ""
) -> None:
    """Keep a REST session's ticket until the session ends (its calls come one HTTP request at a time): deleted or
    answered here, found gone by a call, found ended by its owner when quiet here (deleted or answered through
    another router replica: router/sessions/rest.py `reconcile_sessions`), or idle past `idle_timeout_s`."""
    if (admission := getattr(ingress, "admission", None)) is not None and hasattr(admission, "bind_session"):
        admission.bind_session(session_id, ticket, idle_timeout_s, tenant)


def session_seen(ingress: Any, session_id: str, result: Any) -> None:
    """A call on a REST session came back: the session is active again, or (404) gone, its ticket with it."""
    if (admission := getattr(ingress, "admission", None)) is None or not hasattr(admission, "touch_session"):
        return
    if isinstance(result, dict) and isinstance(result.get("error"), dict) and error_status(result) == 404:
        admission.release_session(session_id)
    else:
        admission.touch_session(session_id)


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


def mean_queue_waiting(prefill: list[Stats]) -> float | None:
    """The prefill replicas' mean engine waiting queue (None: none reports one)."""
    queues = [s["queue_waiting"] for s in prefill if isinstance(s.get("queue_waiting"), int)]
    return sum(queues) / len(queues) if queues else None


class Admission:
    """The router replica's admission control; `stats(deployment)` gives each running replica's routing stats."""

    def __init__(
        self,
        config: AdmissionConfig,
        decode_capacity: int | None = None,
        stats: Callable[[str], list[Stats] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_hold_s: float = 3600.0,
    ) -> None:
        self.config = config
        self.decode_capacity = config.max_streams_per_decode or decode_capacity
        if stats is None:  # (the pools' stats only when the config says so: `router.admission.pool_stats`)
            stats = pool_stats if config.pool_stats else _no_stats
        self.stats = stats
        self.limiter = LatencyLimit(config, clock)
        self.clock = clock
        # A ticket never released (a REST session deleted through another router, or one that just expired) stops
        # counting after this long (the longest a session may live): a leak cannot shut the router.
        self.max_hold_s = max_hold_s
        self._open: dict[Ticket, float] = {}
        # Retry-After follows the backlog: refused clients come back after it, so while refusals outpace the room
        # that frees (tickets released), it grows, and it shrinks back to `retry_after_s` when they stop. Each
        # retry costs a handshake on the same cores: a fixed Retry-After lets the excess crowd out the admitted.
        self.retry_after = float(config.retry_after_s)
        self._refused = self._released = 0
        self._counted_at = clock()
        self._sessions: dict[str, HeldSession] = {}  # REST sessions' tickets by id
        self.queue = WaitQueue(clock)  # new work waiting to be admitted (router/admission/queue.py)
        self._poller: asyncio.Task | None = None
        self._replica = _replica_id()
        self._tag = {"replica": self._replica}
        if self._replica:
            _to_serve_log()

    @property
    def in_flight(self) -> int:
        return len(self._open)

    @property
    def sessions_in_flight(self) -> int:
        """What the adaptive limit bounds: sessions (plain requests wait in the engines' own queues, as on a
        plain vLLM server, and in the router's only when every pool is saturated)."""
        return sum(1 for ticket in self._open if ticket.kind == "session")

    @property
    def limit(self) -> int:
        return int(self.limiter.limit)

    def state(self) -> dict[str, Any]:
        """What is in flight here, by kind, and how many of the sessions are REST sessions (held between calls)."""
        self._expire()
        kinds = dict(Counter(ticket.kind for ticket in self._open))
        held = len(self._sessions)
        return {
            "in_flight": self.in_flight,
            "limit": self.limit,
            "kinds": kinds,
            "rest_sessions": held,
            "waiting": len(self.queue),
        }

    def observe_first_token(self, seconds: float) -> None:
        """An answer's end of input to first token (a plain request's admission to first token: not its wait in
        the queue, which a tighter limit would only lengthen)."""
        self.limiter.observe(seconds)
        self._adapt()

    def _adapt(self, prefill: list[Stats] | None = None) -> None:
        if prefill is None:
            prefill = self.stats("prefill") or []
        self._expire()
        self._pace_retries()
        if self.limiter.update(self.sessions_in_flight, mean_queue_waiting(prefill)):
            metrics.set_gauge(metrics.ADMISSION_LIMIT, self.limiter.limit, "router admission limit", **self._tag)
            metrics.set_gauge(metrics.ADMISSION_IN_FLIGHT, self.in_flight, "admitted work in flight", **self._tag)

    def _expire(self) -> None:
        now = self.clock()
        if self._open and (cutoff := now - self.max_hold_s) > next(iter(self._open.values())):
            for ticket in [t for t, at in self._open.items() if at < cutoff]:
                ticket.release()
        # A REST session with no call through here for its idle timeout is closed by its owner (or lives on through
        # another router): either way no longer this router's work in flight. (Those expired above go too.)
        for session_id in [s for s, held in self._sessions.items() if held.ticket.owner is None or held.idle(now)]:
            self._sessions.pop(session_id).ticket.release()

    def _ticket(self, kind: str) -> Ticket:
        ticket = Ticket(self, kind)
        self._open[ticket] = self.clock()
        metrics.inc(metrics.ADMISSIONS, 1, "router admission decisions", kind=kind, outcome="admitted", reason="")
        return ticket

    def _release(self, ticket: Ticket) -> None:
        if (admitted_at := self._open.pop(ticket, None)) is not None:
            self._released += 1
            self.queue.released(ticket.kind, self.clock() - admitted_at)
            if self.queue:
                self._wake_soon()

    def _pace_retries(self) -> None:
        """Once a window: Retry-After times refusals over releases (at most x2 or /2 a window), within bounds."""
        now = self.clock()
        if now - self._counted_at < self.config.window_s:
            return
        ratio = self._refused / max(self._released, 1)
        self._refused = self._released = 0
        self._counted_at = now
        paced = self.retry_after * min(2.0, max(0.5, ratio))
        self.retry_after = min(float(self.config.max_retry_after_s), max(float(self.config.retry_after_s), paced))

    def bind_session(
        self, session_id: str, ticket: Ticket, idle_timeout_s: float | None = None, tenant: str = ""
    ) -> None:
        if ticket.owner is self:
            held = HeldSession(ticket, idle_timeout_s or self.max_hold_s, self.clock, tenant)
            self._sessions[session_id] = held

    def quiet_sessions(self, after_s: float) -> list[tuple[str, str]]:
        """The REST sessions held here with no call through here, and not asked about, for `after_s`: (session
        id, tenant) to ask their owners about (each counts as asked now)."""
        now, quiet = self.clock(), []
        for session_id, held in self._sessions.items():
            if now - max(held.seen_at, held.checked_at) >= after_s:
                held.checked_at = now
                quiet.append((session_id, held.tenant))
        return quiet

    def touch_session(self, session_id: str) -> None:
        if (held := self._sessions.get(session_id)) is not None:
            held.seen_at = self.clock()

    def release_session(self, session_id: str) -> None:
        if (held := self._sessions.pop(session_id, None)) is not None:
            held.ticket.release()

    def _refuse(self, kind: str, reason: str, message: str, wait: float = 0.0) -> Refusal:
        """A refusal whose Retry-After is the paced one, or the expected wait if longer and known (within the
        bounds)."""
        metrics.inc(metrics.ADMISSIONS, 1, "router admission decisions", kind=kind, outcome="refused", reason=reason)
        self._refused += 1
        wait = max(self.retry_after, wait if math.isfinite(wait) else 0.0)
        return Refusal(reason, message, retry_after(wait, 1, self.config.max_retry_after_s))

    def _over_limit(self) -> Why | None:
        if self.sessions_in_flight < self.limiter.limit:
            return None
        p90 = self.limiter.p90
        seen = f"first token P90 {p90:.2f} s, target {self.limiter.target:.2f} s" if p90 is not None else "queued"
        return Why(
            "latency",
            f"the server is overloaded: {self.sessions_in_flight} sessions, this router's limit ({self.limit}; {seen})",
        )

    def session(self) -> Refusal | Ticket:
        """A ticket if a new session may be created now (release it when the session ends); otherwise why not."""
        if not self.config.enabled:
            return Ticket()
        return self._decide("session", self._session_check())

    def request(self) -> Refusal | Ticket:
        """A ticket if a new plain (whole-prompt) request may start now (release it when it ends); otherwise why
        not."""
        if not self.config.enabled:
            return Ticket()
        return self._decide("request", self._request_check())

    async def admit(self, kind: str) -> Refusal | Ticket:
        """A ticket for a new `kind` ("session" or "request"), now or after a wait in the queue (first come, first
        served); a refusal when the expected wait is past `max_wait_s`, or once a waiter has waited that long."""
        if not self.config.enabled:
            return Ticket()
        queued = any(waiter.kind == kind for waiter in self.queue.waiters)  # (first come, first served)
        why = None if queued else self._check(kind)
        if why is None and not queued:
            return self._ticket(kind)
        bound, expected = self.config.max_wait_s, self._expected_wait(kind)
        why = why or Why("queued", f"the server is overloaded: {len(self.queue)} waiting to be admitted")
        if expected > bound:
            wait = f"expected wait {expected:.1f} s" if expected < math.inf else f"no {kind} has ended here lately"
            return self._refuse(kind, why.reason, f"{why.message}; {wait}", wait=expected)
        waiter = self.queue.push(kind)
        self._wake_soon()
        try:
            await asyncio.wait({waiter.future}, timeout=bound)
        except asyncio.CancelledError:  # the client left while it waited
            self.queue.remove(waiter)
            if waiter.future.done():
                waiter.future.result().release()
            waiter.future.cancel()
            raise
        self.queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
            message = f"{why.message}; not admitted within {bound:g} s"
            return self._refuse(kind, "wait_timeout", message, wait=self._expected_wait(kind))
        waited = self.clock() - waiter.since
        metrics.observe(metrics.ADMISSION_WAIT, waited, "time new work waited for admission", kind=kind)
        return waiter.future.result()

    def _expected_wait(self, kind: str) -> float:
        now = self.clock()
        return self.queue.expected_wait(kind, [now - at for ticket, at in self._open.items() if ticket.kind == kind])

    def _check(self, kind: str) -> Why | None:
        return self._session_check() if kind == "session" else self._request_check()

    def _decide(self, kind: str, why: Why | None) -> Refusal | Ticket:
        return self._ticket(kind) if why is None else self._refuse(kind, why.reason, why.message)

    def _session_check(self) -> Why | None:
        prefill = self.stats("prefill") or []
        self._adapt(prefill)
        if prefill and not any(session_room(s, self.config) for s in prefill):
            if all(kv_low(s, self.config) for s in prefill):
                return Why("kv_low", "the server is overloaded: no prefill replica has KV free")
            best = min(prefill, key=lambda s: s.get("open_sessions", 0))
            sessions = f"{best.get('open_sessions')}/{best.get('session_capacity')}"
            return Why("sessions_full", f"the server is overloaded: every prefill replica is full ({sessions} open)")
        return self._over_limit()

    def _request_check(self) -> Why | None:
        prefill, decode = self.stats("prefill") or [], self.stats("decode") or []
        self._adapt(prefill)
        prefill_full = bool(prefill) and all(prefill_busy(s, self.config) for s in prefill)
        decode_full = bool(decode) and all(decode_saturated(s, self.decode_capacity) for s in decode)
        if prefill_full and decode_full:
            message = "the server is overloaded: every prefill queue is full and every decode replica saturated"
            return Why("saturated", message)
        return None

    def _wake_soon(self) -> None:
        """Admit waiters now if they fit, and keep trying while any wait (the stats change without a release)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a release outside the event loop: the poller catches up)
            return
        loop.call_soon(self._pump)
        if self.queue and (self._poller is None or self._poller.done()):
            self._poller = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while self.queue:
            await asyncio.sleep(POLL_S)
            self._pump()

    def _pump(self) -> None:
        """Admit waiters in arrival order while they fit: the first of a kind that does not fit holds back the rest
        of its kind, never the other kind (each has its own rules)."""
        blocked: set[str] = set()
        for waiter in list(self.queue.waiters):
            if waiter.future.done():
                self.queue.remove(waiter)
                continue
            if waiter.kind in blocked:
                continue
            why = self._check(waiter.kind)
            if why is None:
                self.queue.remove(waiter)
                waiter.future.set_result(self._ticket(waiter.kind))
            else:
                blocked.add(waiter.kind)
        metrics.set_gauge(metrics.ADMISSION_WAITING, len(self.queue), "new work waiting for admission", **self._tag)


def _no_stats(deployment: str) -> None:
    """No view of the pools: every stats-based rule admits (unknown state)."""
    return None


def _replica_id() -> str:
    """This router replica's id for the gauges' tag ("" outside a replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return ""


def _to_serve_log() -> None:
    """The limit's INFO lines in the router's Serve log (Ray Serve configures only its own logger)."""
    handlers = logging.getLogger("ray.serve").handlers
    for handler in handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if handlers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
