"""Preemptive answers on a prefill replica's session API (prefill/preemptive.py), without engines: the hand-off
is scripted (tests/unit/prefill/test_handoff.py's `Server`) and decode is a recording fake."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from decode.client import DecodeClient
from prefill.preemptive import RETRY_MAX_S
from prefill.session import Session
from tests.unit.prefill.test_handoff import Server, tokenizer  # noqa: F401  (the fixture)

IDLE_MS = 20


class Method:
    """A deployment method: records each call's kwargs, answers `reply`."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.calls: list[dict[str, Any]] = []
        self.called_at: list[float] = []
        self.reply = reply

    async def remote(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        self.called_at.append(time.monotonic())
        return self.reply


class FakeDecode:
    def __init__(self) -> None:
        self.start = Method({"replica": "d1"})
        self.stop = Method({"tokens": 5})  # what a stopped parked stream had made
        self.release = Method({})
        self.started, self.stopped, self.released = self.start.calls, self.stop.calls, self.release.calls

    def options(self, **options: Any) -> FakeDecode:  # (the decode client's handle options)
        return self


class PreemptiveServer(Server):
    def __init__(self, tokenizer: Any) -> None:  # noqa: F811
        decode_pool = FakeDecode()  # (the calls the server's decode client makes)
        super().__init__(tokenizer, decode=DecodeClient(decode_pool))
        self.decode_pool = decode_pool
        self.cancelled: list[str] = []  # hand-offs cancelled while made (their engine requests aborted)

    async def prefill(
        self, endpoint: str, body: dict[str, Any], streaming: Any, preemptive: bool = False
    ) -> dict[str, Any]:
        try:
            return await super().prefill(endpoint, {**body, "preemptive": preemptive}, streaming)
        except asyncio.CancelledError:
            self.cancelled.append(body.get("request_id"))
            raise

    def open_preemptive(self, **options: Any) -> Session:
        from core.config import PreemptiveOptions
        from prefill.preempt_state import PreemptState

        session = self.open_session()
        session.preempt = PreemptState(PreemptiveOptions(after_idle_ms=IDLE_MS, **options))
        return session

    async def chunk(self, session: Session, text: str, end: bool = False) -> dict[str, Any]:
        reply = await self.session_chunk(
            session_id=session.id, sequence_id=session.next_seq, payload=text, end_of_input=end
        )
        assert "error" not in reply, reply
        return reply


@pytest.fixture
def server(tokenizer: Any) -> PreemptiveServer:  # noqa: F811
    return PreemptiveServer(tokenizer)


async def idle() -> None:
    await asyncio.sleep(3 * IDLE_MS / 1000)


async def test_an_unchanged_turn_is_answered_by_its_preemptive_answer(server: PreemptiveServer) -> None:
    session = server.open_preemptive()
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    assert [c["request_id"] for c in server.calls] == [f"{session.id}-t0-p1"]
    assert server.calls[0]["preemptive"] is True  # ranked below all other work by the prefill scheduler
    (started,) = server.decode_pool.started
    assert started["consumer"].startswith("preempt:") and started["park_tokens"] == 64
    assert started["body"]["priority"] == 1 and started["body"]["kv_transfer_params"]["handoff"] == 1

    ended_at = time.monotonic()
    await server.chunk(session, "", end=True)  # the turn ends: nothing new
    claim = await server.session_claim(session_id=session.id)
    assert len(server.calls) == 1  # no hand-off after end of input
    assert claim["adopt"] == {"replica": "d1", "parked": started["consumer"], "stream_id": started["stream_id"]}
    assert claim["request"]["kv_transfer_params"]["handoff"] == 1
    assert session.describe()["preemptive"]["delivered"] == 1 and not server.decode_pool.stopped
    timing = session.answers[0].summary()["timing"]
    # Started on decode before the turn ended, by as long as it ran there (not a fixed figure: timers slip under load).
    assert timing["preempted_ms"] >= (ended_at - server.decode_pool.start.called_at[0]) * 1e3 > 0
    assert timing["handoff_ms"] < 5


async def test_new_input_discards_the_preemptive_answer_and_the_turn_is_handed_off_as_usual(
    server: PreemptiveServer,
) -> None:
    session = server.open_preemptive()
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    await server.chunk(session, "And a block table? ", end=True)
    claim = await server.session_claim(session_id=session.id)
    await asyncio.sleep(0.01)
    assert "adopt" not in claim and claim["request"]["request_id"] == f"{session.id}-t0-h1"
    (stopped,) = server.decode_pool.stopped  # stopped on decode
    assert stopped["stream_id"] == server.decode_pool.started[0]["stream_id"]
    assert session.describe()["preemptive"]["discarded"] == 1
    assert session.describe()["preemptive"]["discarded_tokens"] == 5  # what it had made on decode


async def test_a_preemptive_answer_waits_out_a_busy_engine_and_stops_at_max_attempts(server: PreemptiveServer) -> None:
    session = server.open_preemptive(max_attempts=2)
    server._scheduler_stats["queue_waiting"] = 3
    await server.chunk(session, "one ")
    await asyncio.sleep(0.4)
    assert server.calls == []  # not while the engine has work queued (and never queued itself)
    server._scheduler_stats["queue_waiting"] = 0  # the load passed, the user still pauses: it starts, no new input
    for _ in range(int(2 * RETRY_MAX_S / 0.05)):
        if server.calls:
            break
        await asyncio.sleep(0.05)
    assert [c["request_id"].rsplit("-", 1)[1] for c in server.calls] == ["p1"]
    for text in ("two ", "three ", "four "):
        await server.chunk(session, text)
        await idle()
    assert [c["request_id"].rsplit("-", 1)[1] for c in server.calls] == ["p1", "p2"]  # max_attempts
    await server.table.close(session, "test")
    await asyncio.sleep(0.01)
    assert len(server.decode_pool.stopped) == 2  # both given up: the last when the session closed


async def test_a_turn_ending_while_the_preemptive_hand_off_waits_is_handed_off_as_complete_work(
    server: PreemptiveServer,
) -> None:
    """The preemptive hand-off ranks below all other work: a turn that ends before it was made does not wait
    for it (the ordinary hand-off, ranked complete, goes on from what it computed)."""
    session = server.open_preemptive()
    server.gate = asyncio.Event()  # the preemptive hand-off's prefill does not finish
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    assert [c["request_id"] for c in server.calls] == [f"{session.id}-t0-p1"]
    await server.chunk(session, "", end=True)
    server.gate.set()  # (now: the ordinary hand-off goes through, and the preemptive one, given up, is released)
    claim = await server.session_claim(session_id=session.id)
    assert "adopt" not in claim and claim["request"]["request_id"] == f"{session.id}-t0-h1"
    assert server.decode_pool.started == []  # decode never started it
    assert session.describe()["preemptive"]["discarded"] == 1


async def test_a_hand_off_made_for_an_answer_given_up_is_released_on_decode(server: PreemptiveServer) -> None:
    """Given up while its hand-off is made, a preemptive answer's hand-off is not cancelled: an engine request that
    had finished meanwhile would keep its KV for decode, unread, for the whole NIXL lease (its engine stepping every
    millisecond: measured, the prefill worker at ~50% of a core through four-voice runs). It goes on, and decode is
    told to release what it made."""
    session = server.open_preemptive()
    server.gate = asyncio.Event()
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    await server.chunk(session, "", end=True)  # given up: its hand-off was not made yet
    server.gate.set()
    claim = await server.session_claim(session_id=session.id)
    await asyncio.sleep(0.01)
    assert [c["request_id"] for c in server.calls] == [f"{session.id}-t0-p1", f"{session.id}-t0-h1"]
    assert server.decode_pool.started == []
    (released,) = server.decode_pool.released  # the preemptive hand-off's KV, not the answer's
    assert "handoff" in released["kv_transfer_params"]
    assert released["kv_transfer_params"] is not claim["request"]["kv_transfer_params"]
    assert released["request_id"].startswith(f"{session.id}-t0-p1")


async def test_a_hand_off_given_up_that_is_not_made_in_time_is_aborted(
    server: PreemptiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued below all other work, a given-up hand-off would keep its place in the engine's queue up to the
    admission timeout: past `GIVEN_UP_WAIT_S` it is aborted as before, and nothing is released."""
    monkeypatch.setattr("prefill.preemptive.GIVEN_UP_WAIT_S", 0.4)
    session = server.open_preemptive()
    server.gate = asyncio.Event()  # never made
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    await server.chunk(session, "And a block table? ")  # given up
    await asyncio.sleep(0.01)
    assert server.cancelled == []  # still being made
    await asyncio.sleep(0.6)
    assert server.cancelled == [f"{session.id}-t0-p1"] and server.decode_pool.released == []


async def test_a_commit_that_changes_nothing_keeps_the_preemptive_answer(server: PreemptiveServer) -> None:
    """Realtime: `input_text_buffer.commit` turns the typed text into a message, the same request."""
    session = server.open_preemptive()
    await server.session_buffer(session_id=session.id, op="append", text="What is a KV cache?")
    await idle()
    assert len(server.decode_pool.started) == 1
    await server.session_buffer(session_id=session.id, op="commit")
    await server.session_finish(session_id=session.id)
    claim = await server.session_claim(session_id=session.id)
    assert claim["adopt"]["stream_id"] == server.decode_pool.started[0]["stream_id"] and not server.decode_pool.stopped


async def test_a_reader_of_the_whole_answer_gets_an_ordinary_hand_off(server: PreemptiveServer) -> None:
    session = server.open_preemptive()
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    await server.chunk(session, "", end=True)
    claim = await server.session_claim(session_id=session.id, adopts=False)
    await asyncio.sleep(0.01)
    assert "adopt" not in claim and claim["request"]["request_id"] == f"{session.id}-t0-h1"
    assert len(server.decode_pool.stopped) == 1  # the parked stream nobody will adopt was stopped


async def test_each_turn_has_its_own_attempts(server: PreemptiveServer) -> None:
    session = server.open_preemptive(max_attempts=1)
    await server.chunk(session, "First question? ")
    await idle()
    await server.chunk(session, "", end=True)
    claim = await server.session_claim(session_id=session.id)
    await server.session_answer_done(session_id=session.id, turn=0, outcome={"status": "completed", "text": "A."})
    assert "adopt" in claim
    await server.chunk(session, "Second question? ")
    await idle()
    assert len(server.decode_pool.started) == 2  # the second turn's own attempt


async def test_a_pause_asks_for_the_preemptive_answer_at_once_and_idleness_alone_starts_none(
    server: PreemptiveServer,
) -> None:
    """Voice (`after_idle_ms: null`): transcripts arriving as the user speaks start nothing however long the gaps
    between them; a pause (`session_preempt`) starts the answer at once, past `max_attempts` too, and the turn that
    ends unchanged is answered by it."""
    session = server.open_preemptive(max_attempts=1)
    session.preempt.options.after_idle_ms = None
    for words in ("What is ", "a KV ", "cache? "):
        await server.session_buffer(session_id=session.id, op="append", text=words)
        await idle()
    assert server.calls == []  # idle gaps start nothing
    for attempt in (1, 2):  # each pause with new input: its own answer (the first given up), max_attempts or not
        reply = await server.session_preempt(session_id=session.id)
        assert reply["preempting"] is True
        assert (await server.session_preempt(session_id=session.id))["preempting"] is True  # the same input: no new one
        await asyncio.sleep(0.01)
        assert [c["request_id"].rsplit("-", 1)[1] for c in server.calls][-1] == f"p{attempt}"
        assert len(server.decode_pool.started) == attempt
        if attempt == 1:
            await server.session_buffer(session_id=session.id, op="replace", text="caches? ", offset=12)
    await asyncio.sleep(0.01)
    assert len(server.decode_pool.stopped) == 1  # the first, made from the old input
    await server.session_buffer(session_id=session.id, op="commit")
    await server.session_finish(session_id=session.id)
    claim = await server.session_claim(session_id=session.id)
    assert claim["adopt"]["stream_id"] == server.decode_pool.started[1]["stream_id"]
    assert session.describe()["preemptive"]["delivered"] == 1


async def test_a_pause_starts_its_answer_while_the_engine_has_work_queued_up_to_the_cap(
    server: PreemptiveServer,
) -> None:
    """A spoken pause's answer is due within the VAD's window: work queued on the engine (other sessions' input,
    read from stats up to 1 s old) does not defer it past the turn's end, as it defers an answer the input's
    idling started; it runs at the lowest priority, and `max_preemptive_in_flight` still bounds it."""
    server._scheduler_stats["queue_waiting"] = 3
    session = server.open_preemptive()
    session.preempt.options.after_idle_ms = None
    await server.session_buffer(session_id=session.id, op="append", text="What is a KV cache?")
    assert (await server.session_preempt(session_id=session.id))["preempting"] is True
    await asyncio.sleep(0.01)
    assert [c["request_id"].rsplit("-", 1)[1] for c in server.calls] == ["p1"]
    server.settings.max_preemptive_in_flight = 1  # (that one is in flight: the next session's is at the cap)
    other = server.open_preemptive()
    other.preempt.options.after_idle_ms = None
    await server.session_buffer(session_id=other.id, op="append", text="And a block?")
    assert (await server.session_preempt(session_id=other.id))["preempting"] is False
    await server.table.close(other, "test")
    await server.table.close(session, "test")


async def test_a_pause_on_a_session_without_preemptive_answers_starts_nothing(server: PreemptiveServer) -> None:
    session = server.open_session()
    await server.session_buffer(session_id=session.id, op="append", text="What is a KV cache?")
    assert (await server.session_preempt(session_id=session.id))["preempting"] is False
    assert server.calls == []


async def test_preemptive_false_turns_them_off(server: PreemptiveServer) -> None:
    session = server.open_preemptive()
    await server.session_update(session_id=session.id, preemptive=False)
    assert session.preempt is None and "preemptive" not in session.describe()
    await server.chunk(session, "What is a KV cache? ")
    await idle()
    assert server.calls == []


async def test_options_are_checked_in_full(server: PreemptiveServer) -> None:
    bad_options = (({"after_idle_ms": -1}, "preemptive.after_idle_ms"), ({"stream": "yes please"}, "preemptive.stream"))
    for bad, param in bad_options:
        spec = {"request": {"model": "local:tiny-llama", "messages": []}, "preemptive": bad}
        result = await server.create_session(spec)
        assert result["error"]["code"] == 400 and result["error"]["param"] == param, result
    assert not server.sessions  # nothing was made
