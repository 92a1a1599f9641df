"""Router admission control (router/admission/gate.py) on fake routing stats: new sessions and plain requests wait in
the
router's queue, then are refused (429 with Retry-After) past the expected-wait bound, when every replica is full or
when this router's adaptive limit, driven by first-token latency and the prefill queues, is reached; unknown state
admits; admitted sessions' calls are never refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from core.config import AdmissionConfig, AppConfig
from core.protocol import error_body, error_headers, error_status
from prefill.client import PrefillClient
from prefill.errors import overloaded
from router.admission.gate import (
    Admission,
    Refusal,
    Ticket,
    decode_saturated,
    prefill_busy,
    session_room,
)
from router.admission.latency_limit import LatencyLimit, quantile
from router.sessions import rest as sessions

CONFIG = AdmissionConfig(max_session_fill=0.9, max_queue_per_replica=8, min_kv_free_fraction=0.1, retry_after_s=3)


def prefill(open_: int = 0, capacity: int = 10, free: int = 100, waiting: int = 0) -> dict[str, Any]:
    return {
        "open_sessions": open_,
        "session_capacity": capacity,
        "kv_blocks_free": free,
        "kv_blocks_total": 100,
        "queue_waiting": waiting,
    }


def admission(prefills: list[dict[str, Any]] | None, decodes: list[dict[str, Any]] | None, **kw: Any) -> Admission:
    pools = {"prefill": prefills, "decode": decodes}
    return Admission(CONFIG.model_copy(update=kw), decode_capacity=4, stats=lambda name: pools[name])


@pytest.mark.parametrize(
    ("stats", "room"),
    [
        (prefill(open_=8), True),  # 8 < 0.9 * 10
        (prefill(open_=9), False),  # at the fill ratio
        (prefill(open_=0, free=9), False),  # KV under 10 % free
        (prefill(open_=0, free=10), True),
        ({}, True),  # no figures yet: the replica's own limit still holds
    ],
)
def test_session_room(stats: dict[str, Any], room: bool) -> None:
    assert session_room(stats, CONFIG) is room


def test_busy_and_saturated() -> None:
    assert not prefill_busy(prefill(waiting=7), CONFIG)
    assert prefill_busy(prefill(waiting=8), CONFIG)
    assert prefill_busy(prefill(free=5), CONFIG)
    assert not decode_saturated({"active_streams": 3}, 4)
    assert decode_saturated({"active_streams": 4}, 4)
    assert not decode_saturated({"active_streams": 400}, None)  # no known capacity: never saturated
    assert decode_saturated({"active_streams": 2, "stream_capacity": 2}, None)  # the replica's own figure wins


def admitted(decision: Refusal | Ticket) -> bool:
    return isinstance(decision, Ticket)


def issued(decision: Refusal | Ticket) -> Ticket:
    assert isinstance(decision, Ticket), decision
    return decision


def refused(decision: Refusal | Ticket) -> Refusal:
    assert isinstance(decision, Refusal), decision
    return decision


def test_a_session_is_admitted_while_any_prefill_replica_has_room() -> None:
    assert admitted(admission([prefill(open_=9), prefill(open_=3)], []).session())
    full = refused(admission([prefill(open_=9), prefill(open_=10)], []).session())
    assert full.reason == "sessions_full"
    assert "9/10" in full.message  # the least full replica's figures, to explain it
    assert refused(admission([prefill(free=1), prefill(free=2)], []).session()).reason == "kv_low"


def test_refusal_is_429_with_retry_after() -> None:
    refused = admission([prefill(open_=10)], []).session()
    assert isinstance(refused, Refusal)
    payload = refused.payload()
    assert error_status(payload) == 429
    assert payload["error"]["type"] == "RateLimitError"
    assert error_headers(payload) == {"Retry-After": "3"}


def test_a_plain_request_is_refused_only_when_prefill_and_decode_are_both_full() -> None:
    busy, idle = prefill(waiting=9), prefill(waiting=0)
    full, free = {"active_streams": 4}, {"active_streams": 1}
    assert refused(admission([busy, busy], [full, full]).request()).reason == "saturated"
    assert admitted(admission([busy, idle], [full, full]).request())  # one prefill queue has room
    assert admitted(admission([busy, busy], [full, free]).request())  # decode can prefill it itself
    assert admitted(admission([busy], [{"active_streams": 9}], max_streams_per_decode=10).request())  # config wins


def test_unknown_state_and_disabled_admit() -> None:
    assert admitted(admission(None, None).session())  # no request router in this process yet
    assert admitted(admission([], []).request())  # no replica running
    assert admitted(admission([prefill(open_=10)], [], enabled=False).session())
    assert admitted(admission([prefill(waiting=99)], [{"active_streams": 99}], enabled=False).request())


def test_the_config_has_it() -> None:
    config = AppConfig.model_validate({"router": {"admission": {"max_session_fill": 0.5, "retry_after_s": 7}}})
    assert config.router.admission.max_session_fill == 0.5 and config.router.admission.enabled
    with pytest.raises(ValueError):
        AppConfig.model_validate({"router": {"admission": {"max_session_fil": 0.5}}})


# The adaptive limit (`LatencyLimit`), on a fake clock: windows of 1 s and at least 5 samples.
LIMITS = AdmissionConfig(
    target_first_token_s=1.0, latency_tolerance=4.0, min_sessions=4, max_in_flight=100, max_queue_waiting=8,
    backoff=0.5, growth=0.1, window_s=1.0, min_samples=5,
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limited(clock: Clock, waiting: int = 0, **kw: Any) -> tuple[Admission, dict[str, Any]]:
    stats = prefill(capacity=1000, waiting=waiting)
    return Admission(LIMITS.model_copy(update=kw), stats=lambda name: [stats], clock=clock), stats


def window(gate: Admission, clock: Clock, latency_s: float, n: int = 5) -> None:
    """One window of `n` answers, each `latency_s` from end of input to first token."""
    clock.now += 1.0
    for _ in range(n):
        gate.observe_first_token(latency_s)


def test_quantile() -> None:
    assert quantile([float(i) for i in range(1, 11)], 0.9) == 9.0 and quantile([3.0], 0.1) == 3.0


def test_the_limit_shrinks_under_slow_answers_and_grows_back_under_fast_ones() -> None:
    clock = Clock()
    gate, _ = limited(clock)
    assert gate.limit == 100  # no evidence yet: open
    tickets = [gate.session() for _ in range(40)]
    assert all(admitted(t) for t in tickets) and gate.in_flight == 40
    window(gate, clock, 0.2)  # fast: the baseline (P10) is 0.2 s, the target max(1.0, 4 * 0.2) = 1.0 s
    assert gate.limit == 100 and gate.limiter.target == 1.0
    window(gate, clock, 3.0)  # slow: from what is in flight, not from the old limit
    assert gate.limit == 20
    window(gate, clock, 3.0)  # still slow, but too soon: that window's answers were admitted before the cut
    assert gate.limit == 20
    clock.now += 3.0
    window(gate, clock, 3.0)  # one latency later, still slow: down again
    assert gate.limit == 10
    for _ in range(10):
        window(gate, clock, 3.0)
        clock.now += 3.0
    assert gate.limit == 4  # never under min_sessions
    for t in tickets[10:]:
        t.release()
    for _ in range(3):  # fast again and the limit binds (10 in flight, limit 4): it grows
        window(gate, clock, 0.3)
    assert gate.limit == 7
    for t in tickets[:10]:
        t.release()
    window(gate, clock, 0.3)
    assert gate.limit == 7  # idle: a limit that does not bind does not grow
    for _ in range(100):  # clients take every room the limit gives, answers stay fast
        while admitted(gate.session()):
            pass
        window(gate, clock, 0.3)
    assert gate.limit == 100 and gate.in_flight == 100  # never over max_in_flight


def test_the_further_over_target_the_deeper_the_cut() -> None:
    for latency_s, limit in ((1.05, 36), (1.6, 25), (9.0, 20)):  # x0.9, x target/latency, x0.5 at most
        clock = Clock()
        gate, _ = limited(clock, backoff=0.9)
        _ = [gate.session() for _ in range(40)]
        window(gate, clock, 0.1)
        window(gate, clock, latency_s)
        assert gate.limit == limit, latency_s


def test_refusals_past_the_limit_give_retry_after_and_admitted_tickets_free_room() -> None:
    clock = Clock()
    gate, _ = limited(clock)
    tickets = [gate.session() for _ in range(10)]
    window(gate, clock, 0.2)
    window(gate, clock, 5.0)
    assert gate.limit == 5 and gate.in_flight == 10
    no = refused(gate.session())
    assert no.reason == "latency" and "P90 5.00 s" in no.message
    assert error_status(no.payload()) == 429 and error_headers(no.payload()) == {"Retry-After": "2"}
    issued(gate.request()).release()  # plain requests are not bounded by it (the engines queue them)
    for t in tickets[:6]:
        assert isinstance(t, Ticket)
        t.release()
        t.release()  # idempotent: every way out of a session may release it
    assert gate.in_flight == 4 and admitted(gate.session()) and gate.in_flight == 5
    assert refused(gate.session()).reason == "latency"


def test_retry_after_grows_while_refusals_outpace_releases_and_shrinks_back() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=1, max_in_flight=2, max_retry_after_s=10)
    held = [gate.session(), gate.session()]
    waits = []
    for _ in range(4):  # 20 refusals a window, nothing released: the backlog grows, so does Retry-After
        clock.now += 1.0
        waits.append(max(refused(gate.session()).retry_after for _ in range(20)))
    assert waits == [2, 4, 8, 10]  # doubling at most per window, up to max_retry_after_s
    for ticket in held:
        assert isinstance(ticket, Ticket)
        ticket.release()
    for _ in range(4):  # no refusals: back down to retry_after_s
        clock.now += 1.0
        ticket = gate.session()
        assert isinstance(ticket, Ticket)
        ticket.release()
    assert gate.retry_after == 2.0


def test_the_prefill_queue_is_an_early_signal() -> None:
    clock = Clock()
    gate, stats = limited(clock)
    tickets = [gate.session() for _ in range(20)]
    stats["queue_waiting"] = 8  # answers still fast, but the engine queues: shrink before the latency shows it
    clock.now += 1.0
    gate.observe_first_token(0.1)  # (the queue signal needs no full window of samples)
    assert gate.limit == 10
    assert refused(gate.session()).message.endswith("(10; queued)")
    stats["queue_waiting"] = 0
    for _ in range(3):
        window(gate, clock, 0.1)
    assert gate.limit > 10 and len(tickets) == 20


def test_the_target_follows_the_no_queue_latency() -> None:
    clock = Clock()
    gate, _ = limited(clock)
    _ = [gate.session() for _ in range(50)]
    for _ in range(3):
        window(gate, clock, 1.5)  # a slow machine: 1.5 s with no queue is its best
    assert gate.limiter.target == 6.0 and gate.limit == 100  # 4 x 1.5 s: not overloaded
    window(gate, clock, 7.0)
    assert gate.limit == 25


def test_a_ticket_never_released_stops_counting_after_max_hold() -> None:
    clock = Clock()
    gate = Admission(LIMITS, stats=lambda name: [], clock=clock, max_hold_s=60.0)
    gate.session()
    clock.now += 30.0
    gate.session()
    clock.now += 31.0
    gate.session()
    assert gate.in_flight == 2  # the first one expired


class FakePrefill:
    """The prefill pool's handle: each call recorded, answered by `replies` (method -> reply) or {}."""

    def __init__(self, replies: dict[str, dict[str, Any]] | None = None) -> None:
        self.calls: list[str] = []
        self.replies = replies or {}

    def options(self, **options: Any) -> FakePrefill:  # (the prefill client's handle options)
        return self

    def __getattr__(self, method: str) -> Any:
        calls, replies = self.calls, self.replies

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                calls.append(method)

                async def reply() -> dict[str, Any]:
                    if method == "create_session":
                        return {"session_id": f"sess_r1_{len(calls)}", **replies.get(method, {})}
                    return replies.get(method, {})

                return reply()

        return Method()


def sessions_client(gate: Admission, prefill: FakePrefill, config: AppConfig | None = None) -> httpx.AsyncClient:
    ingress = SimpleNamespace(
        config=config or AppConfig(), prefill=PrefillClient(prefill), admission=gate, check_model=lambda body: None,
        check_max_tokens=lambda body: None, read_body=lambda request: request.json(),
    )  # fmt: skip
    app = FastAPI()
    app.include_router(sessions.api)
    app.state.ingress = ingress
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


BASE = "/v1/streaming_input/sessions"


async def test_an_admitted_sessions_calls_are_never_refused() -> None:
    """Past the limit a new REST session gets 429, while the calls on one admitted before all pass; deleting it
    frees its room."""
    clock = Clock()
    gate, _ = limited(clock, min_sessions=1, max_in_flight=1, max_wait_s=0)  # (refused at once, not queued)
    prefill = FakePrefill()
    async with sessions_client(gate, prefill) as client:
        made = await client.post(BASE, json={"messages": []})
        assert made.status_code == 201 and gate.in_flight == 1
        session_id = made.json()["session_id"]
        again = await client.post(BASE, json={"messages": []})
        assert again.status_code == 429 and again.headers["retry-after"] == "2"
        chunk = {"sequence_id": 0, "payload": "hi", "end_of_input": True}
        assert (await client.post(f"{BASE}/{session_id}/chunks", json=chunk)).status_code == 202
        assert (await client.post(f"{BASE}/{session_id}/finish")).status_code == 202
        assert (await client.delete(f"{BASE}/{session_id}")).status_code == 200
        assert gate.in_flight == 0
        assert (await client.post(BASE, json={"messages": []})).status_code == 201
    assert prefill.calls.count("create_session") == 2 and "session_chunk" in prefill.calls


async def test_a_rest_session_closed_by_its_owner_frees_its_room() -> None:
    """A REST session left without a DELETE (its client vanished) is closed by its owner at its idle timeout: the
    router's ticket goes with it, and is kept while calls come; a call that finds the session gone (404) frees it
    at once."""
    clock = Clock()
    gate, _ = limited(clock, min_sessions=2, max_in_flight=2, max_wait_s=0)
    gone = error_body(404, "session not found", "session_id")
    prefill = FakePrefill({"create_session": {"expires_in": 4.0}, "session_info": gone})
    async with sessions_client(gate, prefill) as client:
        first = (await client.post(BASE, json={"messages": []})).json()["session_id"]
        second = (await client.post(BASE, json={"messages": []})).json()["session_id"]
        assert gate.in_flight == 2 and (await client.post(BASE, json={"messages": []})).status_code == 429
        clock.now += 3.0
        chunk = {"sequence_id": 0, "payload": "hi"}
        assert (await client.post(f"{BASE}/{first}/chunks", json=chunk)).status_code == 202  # active again
        clock.now += 3.0  # the second one idle 6 s > 4 s (+ grace): closed by its owner
        assert (await client.post(BASE, json={"messages": []})).status_code == 201
        assert gate.in_flight == 2 and second not in gate._sessions and first in gate._sessions
        assert (await client.get(f"{BASE}/{first}")).status_code == 404  # found gone
        assert gate.in_flight == 1


def test_the_config_has_the_limits_fields() -> None:
    config = AppConfig.model_validate({"router": {"admission": {"target_first_token_s": 0.2, "min_sessions": 2}}})
    assert config.router.admission.target_first_token_s == 0.2 and config.router.admission.min_sessions == 2
    with pytest.raises(ValueError):
        AdmissionConfig(backoff=1.5)
    assert LatencyLimit(AdmissionConfig()).limit == AdmissionConfig().max_in_flight


def test_answers_feed_the_limit_from_their_last_chunk_or_else_from_their_request() -> None:
    import time

    from router.sessions.answers import AnswerReader

    seen: list[float] = []
    reader = AnswerReader(SimpleNamespace(admission=SimpleNamespace(observe_first_token=seen.append)), "s")
    reader._observe_first_token()  # Realtime: no last chunk time; the reader was made at response.create
    reader.claim = {"last_chunk_time": time.time() - 2.0}
    reader._observe_first_token()
    assert 0 <= seen[0] < 1 and 1.9 < seen[1] < 5


class SlowCreate(FakePrefill):
    """A prefill pool whose `create_session` answers only when the test lets it."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    def __getattr__(self, method: str) -> Any:
        if method != "create_session":
            return super().__getattr__(method)
        calls, answer = self.calls, self.answer

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                calls.append(method)

                async def reply() -> dict[str, Any]:
                    await answer.wait()
                    return {"session_id": "sess_r1_made"}

                return reply()

        return Method()


async def test_a_client_that_leaves_while_its_session_is_made_leaves_nothing_counted_or_open() -> None:
    """The client goes (its request cancelled) while the owner is still making its session: the router's ticket
    is released at once, and the session made meanwhile is deleted (behind HAProxy, NDJSON bodies dropped early
    in the disconnect storm left a ticket each, until the router refused new sessions)."""
    gate, _ = limited(Clock(), min_sessions=4, max_in_flight=4)
    prefill = SlowCreate()
    async with sessions_client(gate, prefill) as client:
        creating = asyncio.ensure_future(client.post(BASE, json={"messages": []}))
        for _ in range(50):
            await asyncio.sleep(0)
        assert prefill.calls == ["create_session"] and gate.in_flight == 1
        creating.cancel()
        await asyncio.gather(creating, return_exceptions=True)
        assert gate.in_flight == 0
        prefill.answer.set()
        for _ in range(50):
            await asyncio.sleep(0)
        assert prefill.calls == ["create_session", "session_delete"]


# The queue (router/admission/queue.py): past the limit new work waits, first come first served, within max_wait_s.


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def warm(gate: Admission, clock: Clock, hold_s: float = 0.5, n: int = 4, kind: str = "session") -> None:
    """Work seen leaving: `n` tickets each held `hold_s` (the hold the queue's expected wait is taken from)."""
    for _ in range(n):
        ticket = issued(await gate.admit(kind))
        clock.now += hold_s
        ticket.release()


async def test_past_the_limit_new_work_waits_and_is_admitted_in_order_as_room_frees() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=2, max_in_flight=2, max_wait_s=5)
    await warm(gate, clock)
    held = [await gate.admit("session"), await gate.admit("session")]
    waiting = [asyncio.ensure_future(gate.admit("session")) for _ in range(3)]
    await settle()
    assert not any(w.done() for w in waiting) and gate.state()["waiting"] == 3 and gate.in_flight == 2
    held[0].release()
    await settle()
    assert waiting[0].done() and not waiting[1].done()  # the first come, and only one: one room freed
    assert issued(waiting[0].result()).kind == "session" and gate.in_flight == 2
    assert issued(await gate.admit("request"))  # (plain requests: not bounded by the sessions' limit)
    held[1].release()
    waiting[0].result().release()
    gate._open.clear()  # (the plain request above too)
    await settle()
    assert all(isinstance(w.result(), Ticket) for w in waiting[1:]) and gate.state()["waiting"] == 0


async def test_a_newcomer_does_not_overtake_the_queue() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=1, max_in_flight=1, max_wait_s=5)
    await warm(gate, clock)
    ticket = issued(await gate.admit("session"))
    first = asyncio.ensure_future(gate.admit("session"))
    await settle()
    ticket.release()  # room for one: the waiter's, though the newcomer asks in the same turn of the loop
    second = asyncio.ensure_future(gate.admit("session"))
    await settle()
    assert first.done() and issued(first.result()) and not second.done()
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)


async def test_work_whose_expected_wait_is_past_the_bound_is_refused_at_once_with_that_wait() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=2, max_in_flight=2, max_wait_s=3, max_retry_after_s=60)
    await warm(gate, clock, hold_s=4.0)  # two holders of 4 s: room frees every 2 s
    held = [await gate.admit("session") for _ in range(2)]
    one = asyncio.ensure_future(gate.admit("session"))  # expected 1 x 4 / 2 = 2 s: it waits
    await settle()
    assert not one.done()
    no = refused(await gate.admit("session"))  # behind it: (1 + 1) x 4 / 2 = 4 s > 3 s
    assert no.reason == "queued" and "expected wait 4.0 s" in no.message and no.retry_after == 4
    assert error_headers(no.payload()) == {"Retry-After": "4"} and gate.state()["waiting"] == 1
    held[0].release()
    await settle()
    assert issued(one.result())


async def test_a_waiter_that_waits_the_bound_out_is_refused_and_leaves_the_queue() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=1, max_in_flight=1, max_wait_s=0.2)
    await warm(gate, clock, hold_s=0.05)  # one waiter expects 0.05 s
    held = issued(await gate.admit("session"))
    no = refused(await gate.admit("session"))  # nothing released in 0.2 s (real time)
    assert no.reason == "wait_timeout" and "not admitted within 0.2 s" in no.message and no.retry_after >= 1
    assert gate.state()["waiting"] == 0 and gate.in_flight == 1
    held.release()
    assert issued(await gate.admit("session"))


async def test_a_client_that_leaves_while_it_waits_leaves_nothing_counted() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=1, max_in_flight=1, max_wait_s=5)
    await warm(gate, clock)
    held = issued(await gate.admit("session"))
    waiting = asyncio.ensure_future(gate.admit("session"))
    await settle()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert gate.state()["waiting"] == 0 and gate.in_flight == 1
    # Admitted and cancelled in the same turn of the loop: the ticket it was handed goes back.
    waiting = asyncio.ensure_future(gate.admit("session"))
    await settle()
    held.release()
    gate._pump()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert gate.in_flight == 0 and gate.state()["waiting"] == 0


async def test_a_full_pool_holds_back_its_own_kind_only() -> None:
    """Sessions wait while every prefill replica is full; plain requests (decode can prefill them) go past."""
    pools: dict[str, Any] = {"prefill": [prefill(open_=2)], "decode": []}
    clock = Clock()
    config = CONFIG.model_copy(update={"max_wait_s": 5})
    gate = Admission(config, decode_capacity=4, stats=lambda name: pools[name], clock=clock)
    await warm(gate, clock)  # sessions have been ending here
    talking = issued(await gate.admit("session"))
    pools["prefill"] = [prefill(open_=10)]
    session = asyncio.ensure_future(gate.admit("session"))
    await settle()
    assert not session.done() and issued(await gate.admit("request"))
    pools["prefill"] = [prefill(open_=2)]  # a session ended elsewhere: the stats say so, no release here
    await asyncio.sleep(0.4)  # (the queue polls the stats)
    assert session.done() and issued(session.result()).kind == "session"
    talking.release()


async def test_with_the_room_held_elsewhere_new_work_is_refused_at_once() -> None:
    """Every prefill replica full of sessions opened through other routers, none through this one: no wait can be
    promised, so none is made (Retry-After: the paced one)."""
    pools: dict[str, Any] = {"prefill": [prefill(open_=10)], "decode": []}
    gate = Admission(CONFIG.model_copy(update={"max_wait_s": 5}), stats=lambda name: pools[name], clock=Clock())
    no = refused(await asyncio.wait_for(gate.admit("session"), 0.5))
    assert no.reason == "sessions_full" and no.message.endswith("no session has ended here lately")
    assert no.retry_after == 3


async def test_a_kind_none_of_which_ended_lately_is_refused_at_once() -> None:
    clock = Clock()
    gate, _ = limited(clock, min_sessions=2, max_in_flight=2, max_wait_s=3)
    await warm(gate, clock, hold_s=0.1, kind="request")  # (requests ending says nothing of sessions)
    held = [issued(await gate.admit("session")) for _ in range(2)]
    no = refused(await asyncio.wait_for(gate.admit("session"), 0.5))
    assert no.message.endswith("no session has ended here lately") and no.retry_after == 2
    held[0].release()
    held[0] = issued(await gate.admit("session"))
    clock.now += 10.0  # sessions held 10 s so far, one of 0 s ended: room frees every 10 / 2 = 5 s > 3 s
    no = refused(await asyncio.wait_for(gate.admit("session"), 0.5))
    assert "expected wait 5.0 s" in no.message and no.retry_after == 5
    clock.now += 61.0  # that release is no longer recent
    assert refused(await asyncio.wait_for(gate.admit("session"), 0.5)).message.endswith("ended here lately")
    for ticket in held:
        ticket.release()


async def test_plain_requests_wait_only_while_every_pool_is_saturated() -> None:
    clock = Clock()
    busy, full = prefill(waiting=8), {"active_streams": 4}
    pools: dict[str, Any] = {"prefill": [busy], "decode": [full]}
    config = CONFIG.model_copy(update={"max_wait_s": 5})
    gate = Admission(config, decode_capacity=4, stats=lambda name: pools[name], clock=clock)
    pools["decode"] = [{"active_streams": 0}]
    await warm(gate, clock, kind="request")
    answering = issued(await gate.admit("request"))
    pools["decode"] = [full]
    waiting = asyncio.ensure_future(gate.admit("request"))
    await settle()
    assert not waiting.done() and gate.state()["waiting"] == 1
    pools["decode"] = [{"active_streams": 3}]  # a stream ended on decode
    await asyncio.sleep(0.4)
    assert issued(waiting.result()).kind == "request"
    answering.release()


async def test_rest_sessions_ended_through_another_router_stop_counting_here() -> None:
    """A REST session made through this router, then deleted or answered through another one, stops counting here
    once it has been quiet here and its owner says so (the chaos run, two routers: 21 left counted); one that
    is only quiet, its answer not over, still counts."""
    clock = Clock()
    gate, _ = limited(clock, min_sessions=10, max_in_flight=10, max_wait_s=0)
    prefill = FakePrefill()
    async with sessions_client(gate, prefill) as client:
        made = [(await client.post(BASE, json={"messages": []})).json()["session_id"] for _ in range(3)]
    assert gate.in_flight == 3 and gate.quiet_sessions(10.0) == []  # (not quiet yet)
    statuses = {
        made[0]: error_body(404, "session not found", "session_id"),  # deleted elsewhere
        made[1]: {"state": "open", "answer_status": "completed"},  # answered elsewhere, the next turn not begun
        made[2]: {"state": "answering", "answer_status": "streaming"},  # still answering: still counts
    }
    ingress = SimpleNamespace(admission=gate, prefill=SimpleNamespace())

    async def status(ingress: Any, session_id: str, tenant: str) -> dict[str, Any]:
        return statuses[session_id]

    clock.now += 11.0
    original = sessions.session_status
    sessions.session_status = status
    try:
        reconciling = asyncio.ensure_future(sessions.reconcile_sessions(ingress, period_s=0.01))
        await asyncio.sleep(0.1)
        reconciling.cancel()
        await asyncio.gather(reconciling, return_exceptions=True)
    finally:
        sessions.session_status = original
    assert gate.in_flight == 1 and list(gate._sessions) == [made[2]]
    assert gate.quiet_sessions(10.0) == []  # (asked just now: not again before it is quiet again)


class FullThenFree(FakePrefill):
    """A prefill pool whose replica is found full (its own 429) `full` times, then makes the session."""

    def __init__(self, full: int) -> None:
        super().__init__()
        self.full = full

    def __getattr__(self, method: str) -> Any:
        if method != "create_session":
            return super().__getattr__(method)
        pool = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                pool.calls.append(method)

                async def reply() -> dict[str, Any]:
                    if pool.calls.count(method) <= pool.full:
                        return overloaded(1, "96 sessions open, the replica's limit")
                    return {"session_id": "sess_r1_made"}

                return reply()

        return Method()


async def test_a_replica_found_full_is_asked_again_within_the_wait_not_refused_at_once() -> None:
    """Admission's stats are up to a second old: a replica full when the session is made (its own 429) is asked
    again as room frees, within `max_wait_s` (the disconnect storm at 1,000 clients: 278 such 429s)."""
    gate, _ = limited(Clock(), min_sessions=10, max_in_flight=10, max_wait_s=5)
    prefill = FullThenFree(full=2)
    async with sessions_client(
        gate, prefill, AppConfig.model_validate({"router": {"admission": {"max_wait_s": 5}}})
    ) as client:
        made = await client.post(BASE, json={"messages": []})
    assert made.status_code == 201 and prefill.calls.count("create_session") == 3
    prefill = FullThenFree(full=99)
    async with sessions_client(
        gate, prefill, AppConfig.model_validate({"router": {"admission": {"max_wait_s": 0}}})
    ) as client:
        refused_now = await client.post(BASE, json={"messages": []})
    assert refused_now.status_code == 429 and prefill.calls.count("create_session") == 1
