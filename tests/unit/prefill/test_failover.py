"""Sessions outliving their replica (prefill/failover.py, prefill/journal.py, prefill/store.py), on real
`PrefillServer`s sharing one session store; only the engines are faked (tests/unit/prefill/test_handoff.py's
`Server`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prefill.journal import Journal, create_record
from prefill.session import Session, StartPolicy
from prefill.store import MemorySessionStore
from tests.unit.prefill.test_handoff import Server, completed, tokenizer  # noqa: F401  (the fixture)


@pytest.fixture(autouse=True)
def no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input goes to the engine as soon as it comes (no wait for a burst of versions to settle)."""
    from prefill import streaming

    monkeypatch.setattr(streaming, "SETTLE_S", 0.0)


class Replica(Server):
    """A prefill replica of a pool whose replicas share `store`; `dead` lists the replicas that died."""

    def __init__(self, tok: Any, name: str, store: MemorySessionStore, dead: set[str]) -> None:
        super().__init__(tok, replica=name, store=store)
        self.dead = dead
        store.shared = True  # (one store object stands for the pool's shared one)
        self.failover.alive = self.alive  # type: ignore[method-assign]  (no Ray: the pool says who died)

    async def alive(self, replica: str) -> bool:
        return replica not in self.dead

    async def open_journaled(self, request: dict[str, Any] | None = None) -> Session:
        """What `create_session` does (less vLLM's validation): the session, its journal, its owner."""
        session = self.open_session(request)
        session.journal = Journal(self.store, session.id)
        await session.record("create", **create_record(session))
        await self.store.set_owner(session.id, self.replica)
        return session


@pytest.fixture
def pool(tokenizer: Any) -> tuple[Replica, Replica, set[str]]:  # noqa: F811
    store, dead = MemorySessionStore(), set()
    return Replica(tokenizer, "a", store, dead), Replica(tokenizer, "b", store, dead), dead


async def chunk(replica: Replica, session_id: str, seq: int, text: str, end: bool = False, **kw: Any) -> dict:
    reply = await replica.session_chunk(session_id=session_id, sequence_id=seq, payload=text, end_of_input=end, **kw)
    assert "error" not in reply, reply
    return reply


async def settle(session: Session) -> None:
    if session.answers and (task := session.answers[-1].task) is not None:
        await asyncio.wait_for(asyncio.shield(task), 2)


async def test_a_dead_owners_session_is_adopted_with_its_whole_input_and_answers_the_same(pool) -> None:
    a, b, dead = pool
    session = await a.open_journaled()
    await chunk(a, session.id, 0, "What is ")
    await chunk(a, session.id, 2, "cache?", end=True)  # held out of order, acknowledged: it must survive too
    dead.add("a")

    # The session's next call reaches b (the router's rendezvous choice): b adopts it from the journal.
    reply = await chunk(b, session.id, 1, "a KV ")
    assert reply["applied"] == [1, 2] and reply["started"]
    adopted = b.sessions[session.id]
    await settle(adopted)
    assert adopted.answers[-1].status == "ready"
    sent = b.calls[-1]
    assert sent["messages"] == [{"role": "user", "content": "What is a KV cache?"}]
    assert await b.store.owner(session.id) == "b"


async def test_a_multi_turn_conversation_is_replayed_exactly(pool) -> None:
    a, b, dead = pool
    session = await a.open_journaled({"model": "m", "messages": [], "max_tokens": 8})
    await a.session_update(session_id=session.id, instructions="Be brief.", params={"temperature": 0})
    await a.session_message(session_id=session.id, role="user", content="Hi.")
    await a.session_buffer(session_id=session.id, op="append", text="Tell me abut")
    await a.session_buffer(session_id=session.id, op="replace", text="about KV.", offset=8)
    await a.session_respond(session_id=session.id)
    await settle(session)
    claim = await a.session_claim(session_id=session.id)
    await a.session_answer_done(session_id=session.id, turn=claim["turn"], outcome=completed("KV is a cache."))
    await chunk(a, session.id, 0, "And then?")
    before = (session.full_request(), session.next_seq, session.payload_bytes, len(session.answers))
    dead.add("a")

    reply = await b.session_result(session_id=session.id, wait=False)
    assert reply["answer"]["text"] == "KV is a cache." and reply["answer"]["status"] == "completed"
    adopted = b.sessions[session.id]
    assert (adopted.full_request(), adopted.next_seq, adopted.payload_bytes, len(adopted.answers)) == before
    assert adopted.conversation.instructions == "Be brief." and adopted.request["temperature"] == 0


async def test_the_router_holding_a_sessions_connection_is_replayed(pool) -> None:
    """A client re-attached through another router replica: the adopter knows the new one holds its connection
    (an old one, dead, would make it close the session as orphaned)."""
    a, b, dead = pool
    session = await a.open_journaled()
    await a.session_attach(session_id=session.id, connection="SERVE_REPLICA::app#router#old")
    await a.session_attach(session_id=session.id, connection="SERVE_REPLICA::app#router#new")
    dead.add("a")
    await b.session_status(session_id=session.id)
    assert b.sessions[session.id].connection == "SERVE_REPLICA::app#router#new"


async def test_a_realtime_connections_own_settings_are_kept_for_its_reattach_and_replayed(pool) -> None:
    """`view` (the settings only a realtime router uses) is kept key by key as sent (`session_info` returns it),
    journaled for the session's next owner; one over the limit is not kept, and the update itself goes through."""
    a, b, dead = pool
    session = await a.open_journaled()
    await a.session_update(session_id=session.id, view={"given": {"output_modalities": ["audio"]}})
    await a.session_update(session_id=session.id, view={"voiced": "ash"})  # (merged: `given` stays)
    await a.session_update(session_id=session.id, params={"temperature": 0})  # (no view: it stays)
    view = {"given": {"output_modalities": ["audio"]}, "voiced": "ash"}
    assert session.view == view
    kept = await a.session_update(
        session_id=session.id, view={"given": {"x": "字" * 40_000}}, params={"temperature": 1}
    )
    assert "error" not in kept and session.view == view and session.request["temperature"] == 1
    dead.add("a")
    await b.session_status(session_id=session.id)
    assert b.sessions[session.id].view == view


async def test_an_answer_being_streamed_is_reported_to_the_adopter(pool) -> None:
    a, b, dead = pool
    session = await a.open_journaled()
    await chunk(a, session.id, 0, "Question?", end=True)
    await settle(session)
    claim = await a.session_claim(session_id=session.id)
    assert "request" in claim
    dead.add("a")
    # The router that streams it from decode reports the end; b adopts the session and takes the report.
    done = await b.session_answer_done(session_id=session.id, turn=0, outcome=completed("Answer."))
    assert done["status"] == "completed" and not b.calls, "no second hand-off: decode has the answer"
    assert b.sessions[session.id].request["messages"][-1] == {"role": "assistant", "content": "Answer."}


async def test_a_retried_call_is_not_applied_twice(pool) -> None:
    a, b, dead = pool
    session = await a.open_journaled()
    first = await a.session_buffer(session_id=session.id, op="append", text="one ", call_id="c1")
    assert first["payload_bytes"] == 4
    again = await a.session_buffer(session_id=session.id, op="append", text="one ", call_id="c1")
    assert again["payload_bytes"] == 4 and session.buffer == "one "
    dead.add("a")
    # The reply was lost with a: the router retries the same call on b, which knows it from the journal.
    retried = await b.session_buffer(session_id=session.id, op="append", text="one ", call_id="c1")
    assert retried["payload_bytes"] == 4 and b.sessions[session.id].buffer == "one "


async def test_one_replica_wins_the_claim_and_the_other_points_there(pool, tokenizer) -> None:  # noqa: F811
    a, b, dead = pool
    c = Replica(tokenizer, "c", a.store, dead)
    session = await a.open_journaled()
    await chunk(a, session.id, 0, "Hello there ")
    dead.add("a")
    replies = await asyncio.gather(
        b.session_result(session_id=session.id, wait=False), c.session_result(session_id=session.id, wait=False)
    )
    holders = [r for r in (b, c) if session.id in r.sessions]
    assert len(holders) == 1
    moved = [reply for reply in replies if "error" in reply]
    assert len(moved) == 1 and moved[0]["error"]["code"] == 503
    assert moved[0]["error"]["owner"] == holders[0].replica


async def test_a_session_of_a_live_replica_is_not_taken(pool) -> None:
    a, b, _ = pool
    session = await a.open_journaled()
    reply = await b.session_result(session_id=session.id, wait=False)
    assert reply["error"]["code"] == 503 and reply["error"]["owner"] == "a"
    assert session.id not in b.sessions


async def test_a_deleted_session_is_gone_everywhere(pool) -> None:
    a, b, dead = pool
    session = await a.open_journaled()
    await a.session_delete(session_id=session.id)
    dead.add("a")
    reply = await b.session_result(session_id=session.id, wait=False)
    assert reply["error"]["code"] == 404


async def test_drain_hands_every_session_over_and_calls_wait_for_it(pool) -> None:
    a, b, _ = pool
    sessions = [await a.open_journaled() for _ in range(5)]
    for s in sessions:
        await chunk(a, s.id, 0, "Some input ")
    journals = [await a.store.records(s.id) for s in sessions]
    for s in sessions:  # what `drain` does before the adoption call: calls reaching b now wait for it
        await a.store.set_owner(s.id, "b")
    waiting = asyncio.ensure_future(b.session_result(session_id=sessions[0].id, wait=False))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    adopted = await b.adopt_sessions(owner="a", journals=journals)
    assert sorted(adopted["adopted"]) == sorted(s.id for s in sessions)
    reply = await asyncio.wait_for(waiting, 2)
    assert "error" not in reply and reply["next_sequence_id"] == 1


async def test_a_caller_cancelled_while_its_record_is_written_does_not_cancel_the_write() -> None:
    """A client leaving mid-call cancels the owner's call while it waits for its record (the storm's
    `mid_prefill` clients): the record still lands, and a later flush (a DELETE's) neither fails nor hangs."""

    class SlowStore(MemorySessionStore):
        async def append(self, session_id: str, n: int, record: dict[str, Any]) -> None:
            await asyncio.sleep(0.05)
            await super().append(session_id, n, record)

    store = SlowStore()
    journal = Journal(store, "s1")

    async def call() -> None:
        await journal.write("chunk", seq=0)

    caller = asyncio.ensure_future(call())
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    after = journal.write("chunk", seq=1)
    await asyncio.wait_for(journal.flush(), 5)
    await after
    assert [r["seq"] for r in await store.records("s1")] == [0, 1]


class Requests:
    """An engine client that records the streaming requests started on it, and which of them are still open
    (what the engine would hold KV for)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.open: set[str] = set()

    def generate(self, inputs: Any, params: Any, request_id: str) -> Any:
        async def outputs() -> Any:
            self.started.append(request_id)
            self.open.add(request_id)
            try:
                async for _ in inputs:
                    yield type("Out", (), {"outputs": [type("C", (), {"token_ids": [0]})()]})()
            finally:
                self.open.discard(request_id)

        return outputs()


async def test_a_session_deleted_by_the_call_that_adopts_it_starts_no_engine_request(pool) -> None:
    """The first call to reach an adopter after its owner died may be a DELETE (a client leaving): the
    adoption's background re-prefill, queued behind it, must not start a request for the closed session (it
    would hold its KV on the engine for good: the idle request the faults test found on the survivor)."""
    a, b, dead = pool
    a.engine.client, b.engine.client = Requests(), Requests()
    session = a.open_session()
    session.policy = StartPolicy(type="on_first_chunk")  # input streams to the engine as it arrives
    session.journal = Journal(a.store, session.id)
    await session.record("create", **create_record(session))
    await a.store.set_owner(session.id, "a")
    await chunk(a, session.id, 0, "Some input that streams to the engine ")
    assert a.engine.client.started, "the input streamed on the owner"
    dead.add("a")

    reply = await b.session_delete(session_id=session.id)
    assert reply.get("deleted"), reply
    for _ in range(10):  # the adoption's re-prefill task runs (and must find the session over)
        await asyncio.sleep(0)
    assert b.engine.client.open == set(), b.engine.client.started
    assert session.id not in b.sessions
