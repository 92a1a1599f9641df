"""The answer protocol on a prefill replica's session API (prefill/handoff.py), without an engine.

A real `PrefillServer` with its real parts and sessions; only the engine is faked: its tokenizer (the local
model's, when `python -m local_models.llm` has made it), its limits, and `prefill`, the hand-off, which is
scripted.
Sessions start on `on_end_only`, so no input is streamed to the engine before the hand-off.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from core.config import AppConfig
from core.placement import new_session_id
from core.scheduler_config import SchedulerSettings
from decode.client import DecodeClient
from local_models.llm import DEFAULT_DIR
from prefill import handoff
from prefill.answer import Answer
from prefill.errors import overloaded
from prefill.server import PrefillServer
from prefill.session import Session, SessionLimits, SessionState, StartPolicy
from prefill.store import SessionStore

REPLICA = "replica1"
KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-1",
    "remote_block_ids": [3, 4, 5],
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
}
USAGE = {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26}
RESPONSE = {"id": "chatcmpl-1", "created": 1_700_000_000, "model": "local:tiny-llama"}


class FakeTokenizer:
    """Whitespace-separated tokens with character offsets, and a ChatML-like template."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False, **_: Any) -> Any:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return self(text)["input_ids"] if tokenize else text

    def __call__(self, text: str, **_: Any) -> dict[str, list[Any]]:
        spans = [m.span() for m in re.finditer(r"\S+\s*", text)]
        return {"input_ids": [hash(text[a:b]) % 1000 for a, b in spans], "offset_mapping": spans}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if (DEFAULT_DIR / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(DEFAULT_DIR)
    return FakeTokenizer()


class FakeEngine:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_num_seqs = 8
        self.max_model_len = 4096


class Server(PrefillServer.func_or_class):  # type: ignore[name-defined,misc]
    """A prefill replica (the deployment and its parts, as it wires them) whose hand-offs (`prefill`) are
    scripted: no engine is started, and nothing runs in the background (the sweep is the test's to run)."""

    def __init__(
        self,
        tokenizer: Any,
        replica: str = REPLICA,
        store: SessionStore | None = None,
        decode: DecodeClient | None = None,
    ) -> None:
        self.engine = FakeEngine(tokenizer)
        self.config = AppConfig()
        self.config.prefill.scheduler = SchedulerSettings(admission_timeout_s=2.0)
        # Every answer handed off, however short its input (the hand-off is what these tests are about; a short
        # input's answer computed by decode: `test_a_short_inputs_answer_is_computed_by_decode`).
        self.config.router.disaggregation.min_session_prompt_tokens = 0
        self.decode = decode
        self.replica, self.app_name, self.deployment = replica, "app", "prefill"
        self.store = store
        self._scheduler_stats: dict[str, Any] = {}
        self._wire()
        self.results: list[dict[str, Any] | BaseException] = []  # one per hand-off; then successes
        self.calls: list[dict[str, Any]] = []  # the hand-off requests, as `prefill` got them
        self.gate: asyncio.Event | None = None  # while set to an unset event, hand-offs wait for it

    def __del__(self) -> None:  # (the deployment's drains the replica's sessions: there is no replica here)
        pass

    async def prefill(self, endpoint: str, body: dict[str, Any], streaming: Any) -> dict[str, Any]:
        self.calls.append({**body, "endpoint": endpoint})
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.results:
            result = self.results.pop(0)
            if isinstance(result, BaseException):
                raise result
            return result
        return {"kv_transfer_params": {**KV, "handoff": len(self.calls)}, "prompt_tokens": 21}

    def open_session(self, request: dict[str, Any] | None = None, **limits: float) -> Session:
        """What `create_session` does, less validating the request with vLLM's models (a heavy import)."""
        session_id = new_session_id(self.replica)
        request = request if request is not None else {"model": "local:tiny-llama", "messages": []}
        endpoint = "chat" if "messages" in request else "completion"
        policy = StartPolicy(type="on_end_only")
        session = Session(
            session_id, endpoint, request, policy, SessionLimits(**limits), self.table.streaming(session_id)
        )
        self.sessions[session_id] = session
        return session

    async def end_input(self, session: Session, text: str) -> dict[str, Any]:
        """The last chunk of a turn: the hand-off starts."""
        reply = await self.session_chunk(
            session_id=session.id, sequence_id=session.next_seq, payload=text, end_of_input=True
        )
        assert "error" not in reply, reply
        return reply

    async def ready(self, session: Session, text: str = "What is a KV cache?") -> Answer:
        """End the input and wait for its hand-off to be made."""
        await self.end_input(session, text)
        answer = session.answers[-1]
        assert answer.task is not None
        await asyncio.wait_for(asyncio.shield(answer.task), 2)
        return answer


@pytest.fixture
def server(tokenizer: Any) -> Server:
    return Server(tokenizer)


def completed(text: str) -> dict[str, Any]:
    return {"status": "completed", "text": text, "finish_reason": "stop", "usage": USAGE, "response": RESPONSE}


async def wait_until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


# --- claiming ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("include_usage", [False, True])
async def test_claim_returns_the_decode_request_exactly_once(server: Server, include_usage: bool) -> None:
    request: dict[str, Any] = {"model": "local:tiny-llama", "messages": [], "max_tokens": 16}
    if include_usage:
        request["stream_options"] = {"include_usage": True}
    session = server.open_session(request)
    session.conversation.instructions = "Be brief."
    reply = await server.end_input(session, "What is a KV cache?")
    assert reply["started"] and reply["state"] == "answering"

    claim = await server.session_claim(session_id=session.id)

    assert claim["turn"] == 0 and claim["endpoint"] == "chat"
    assert claim["include_usage"] is include_usage
    decode = claim["request"]
    assert decode["kv_transfer_params"] == {**KV, "handoff": 1}
    assert decode["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    assert decode["max_tokens"] == 16 and decode["stream"] is True
    # The owner always asks decode for usage (it learns the answer's usage from the router's report).
    assert decode["stream_options"] == {"include_usage": True}
    assert decode["request_id"] == f"{session.id}-t0-h1"
    assert abs(claim["last_chunk_time"] - time.time()) < 5
    assert len(server.calls) == 1 and server.calls[0]["endpoint"] == "chat"
    assert session.answers[0].status == "streaming"

    second = await server.session_claim(session_id=session.id)
    assert "request" not in second
    assert second["turn"] == 0 and second["answer"]["status"] == "streaming"
    assert len(server.calls) == 1


async def test_claim_waits_for_an_answer_that_starts_later(server: Server) -> None:
    session = server.open_session()
    await server.session_chunk(session_id=session.id, sequence_id=0, payload="Hello ")
    claim_task = asyncio.create_task(server.session_claim(session_id=session.id))
    await asyncio.sleep(0.05)
    assert not claim_task.done()  # no answer yet: the claim waits for one

    await server.end_input(session, "world")
    claim = await asyncio.wait_for(claim_task, 2)

    assert claim["turn"] == 0
    assert claim["request"]["messages"] == [{"role": "user", "content": "Hello world"}]


async def test_claim_wait_is_bounded_and_the_router_asks_again(server: Server, monkeypatch: Any) -> None:
    """A reader waiting for input to end holds one of the replica's request slots only a short while (1,024
    such readers once exhausted the replica), and only a few may wait on one session."""
    monkeypatch.setattr(handoff, "WAIT_POLL_S", 0.2)
    session = server.open_session()
    await server.session_chunk(session_id=session.id, sequence_id=0, payload="no end yet")
    started = time.monotonic()
    assert await server.session_claim(session_id=session.id) == {"pending": True}
    assert time.monotonic() - started < 1.0
    waiting = [asyncio.ensure_future(server.session_claim(session_id=session.id)) for _ in range(handoff.MAX_WAITERS)]
    await asyncio.sleep(0.05)
    refused = await server.session_claim(session_id=session.id)
    assert refused["error"]["code"] == 429
    assert all(r == {"pending": True} for r in await asyncio.gather(*waiting))
    assert session.waiters == 0


async def test_claim_on_an_unknown_session_is_a_404(server: Server) -> None:
    claim = await server.session_claim(session_id=new_session_id(REPLICA))
    assert set(claim) == {"error"}
    assert claim["error"]["code"] == 404 and claim["error"]["type"] == "NotFoundError"
    assert claim["error"]["param"] == "session_id"
    # A session of another replica, with no journal anywhere (tests/unit/prefill/test_failover.py has the rest).
    elsewhere = await server.session_claim(session_id=new_session_id("other"))
    assert elsewhere["error"]["code"] == 404


async def test_respond_overrides_shape_the_decode_request(server: Server) -> None:
    session = server.open_session()
    session.conversation.instructions = "Be brief."
    await server.session_message(session_id=session.id, role="user", content="Hi")
    reply = await server.session_respond(
        session_id=session.id, overrides={"max_tokens": 3, "instructions": "Answer in French."}
    )
    assert reply["answer"]["status"] == "preparing"
    claim = await server.session_claim(session_id=session.id, turn=0)
    assert claim["request"]["max_tokens"] == 3
    assert claim["request"]["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert "instructions" not in claim["request"]
    assert session.conversation.instructions == "Be brief."  # for this response only

    refused = await server.session_respond(session_id=session.id, overrides={"n": 2})
    assert refused["error"]["code"] == 409  # one response at a time
    await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("Salut"))
    refused = await server.session_respond(session_id=session.id, overrides={"n": 2})
    assert refused["error"]["code"] == 400 and refused["error"]["param"] == "n"


# --- the router's report ---------------------------------------------------------------------------------
async def test_answer_done_joins_the_conversation_and_is_idempotent(server: Server) -> None:
    session = server.open_session()
    await server.ready(session, "What is a KV cache?")
    await server.session_claim(session_id=session.id)

    done = await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("Attention state."))

    assert done["status"] == "completed" and done["text"] == "Attention state."
    assert done["usage"] == USAGE and done["response"] == RESPONSE and done["finish_reason"] == "stop"
    assert session.request["messages"] == [
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Attention state."},
    ]
    assert session.state == SessionState.OPEN and not session.answering
    assert session.answers[0].request is None  # the hand-off is spent

    again = await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("Something else."))
    assert again == done
    assert len(session.request["messages"]) == 2
    result = await server.session_result(session_id=session.id, turn=0)
    assert result["state"] == "open" and result["answer"] == done

    # The conversation goes on: the next turn's hand-off carries the answer.
    await server.ready(session, "And then?")
    claim = await server.session_claim(session_id=session.id)
    assert claim["turn"] == 1 and claim["request"]["request_id"] == f"{session.id}-t1-h1"
    assert [m["role"] for m in claim["request"]["messages"]] == ["user", "assistant", "user"]
    replay = await server.session_claim(session_id=session.id, turn=0)
    assert replay["answer"] == done


async def test_answer_done_refuses_bad_reports(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    bad_status = await server.session_answer_done(session_id=session.id, turn=0, outcome={"status": "streaming"})
    assert bad_status["error"]["code"] == 400 and bad_status["error"]["param"] == "status"
    bad_turn = await server.session_answer_done(session_id=session.id, turn=1, outcome=completed("x"))
    assert bad_turn["error"]["code"] == 404 and bad_turn["error"]["param"] == "turn"
    assert session.answers[0].status == "ready"


async def test_result_waits_for_the_report(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    await server.session_claim(session_id=session.id)
    waiting = asyncio.create_task(server.session_result(session_id=session.id))
    await asyncio.sleep(0.02)
    assert not waiting.done()
    await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("Done."))
    result = await asyncio.wait_for(waiting, 2)
    assert result["answer"]["status"] == "completed" and result["answer"]["text"] == "Done."


# --- failures, staleness, cancellation -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("outcome", "code"),
    [(overloaded(1), 429), (TimeoutError(), 429), (RuntimeError("engine died"), 500)],
    ids=["refused", "timeout", "crash"],
)
async def test_a_failed_hand_off_fails_the_answer_and_reopens_the_session(
    server: Server, outcome: dict[str, Any] | BaseException, code: int
) -> None:
    server.results.append(outcome)
    session = server.open_session()
    await server.end_input(session, "Hello")

    claim = await server.session_claim(session_id=session.id)

    assert "request" not in claim
    summary = claim["answer"]
    assert summary["status"] == "failed" and summary["error"]["code"] == code and summary["text"] == ""
    if code == 429:
        assert summary["error"]["retry_after"] == 1
    assert session.state == SessionState.OPEN and not session.answering
    assert session.request["messages"] == [{"role": "user", "content": "Hello"}]  # no assistant turn
    # The session takes input again, and the next end of input hands off.
    await server.ready(session, "Hello again")
    assert (await server.session_claim(session_id=session.id))["request"]["kv_transfer_params"]["handoff"] == 2


async def test_retrying_finish_after_a_refused_hand_off_hands_off_again(server: Server) -> None:
    server.results.append(overloaded(1))
    session = server.open_session()
    await server.session_chunk(session_id=session.id, sequence_id=0, payload="Hello")
    await server.session_finish(session_id=session.id)
    failed = await server.session_claim(session_id=session.id)
    assert failed["answer"]["status"] == "failed"

    retried = await server.session_finish(session_id=session.id)
    assert retried["answer"]["status"] == "preparing"
    assert "request" in await server.session_claim(session_id=session.id)


@pytest.mark.parametrize("at_the_limit", [False, True])
async def test_a_short_inputs_answer_is_computed_by_decode(server: Server, at_the_limit: bool) -> None:
    """An input under `router.disaggregation.min_session_prompt_tokens`: no hand-off request, the decode request
    is the whole prompt with no `kv_transfer_params` (decode computes it), and a claim long after makes none either
    (no KV waits here to go stale). An input of the limit's length is handed off as ever."""
    session = server.open_session({"model": "local:tiny-llama", "messages": [], "max_tokens": 16})
    await server.session_chunk(session_id=session.id, sequence_id=0, payload="What is a KV cache?")
    session.commit_buffer()  # (the input as the end of input leaves it, to count it)
    tokens = len(session.stable_tokens(server.engine.tokenizer))
    server.config.router.disaggregation.min_session_prompt_tokens = tokens if at_the_limit else tokens + 1
    await server.end_input(session, "")
    answer = session.answers[-1]
    await asyncio.wait_for(asyncio.shield(answer.task), 2)  # type: ignore[arg-type]
    assert answer.status == "ready" and answer.local is not at_the_limit
    assert answer.handed_off_at is not None
    answer.handed_off_at -= 60  # (a handed-off KV this old is handed off again at claim time)

    claim = await server.session_claim(session_id=session.id)

    decode = claim["request"]
    assert decode["messages"] == [{"role": "user", "content": "What is a KV cache?"}]
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    if at_the_limit:
        assert "kv_transfer_params" in decode and len(server.calls) == 2
    else:
        assert "kv_transfer_params" not in decode and server.calls == []
        assert decode["request_id"] == f"{session.id}-t0-h1"


@pytest.mark.parametrize(("age_s", "handoffs"), [(5.0, 1), (25.0, 2)])
async def test_a_stale_hand_off_is_made_again_at_claim_time(server: Server, age_s: float, handoffs: int) -> None:
    assert server.config.kv_transfer.lease_s == 30  # stale past max(lease / 2, lease - 10) = 20 s
    session = server.open_session()
    answer = await server.ready(session)
    assert answer.handoffs == 1
    assert answer.handed_off_at is not None
    answer.handed_off_at -= age_s

    claim = await server.session_claim(session_id=session.id)

    assert answer.handoffs == handoffs and len(server.calls) == handoffs
    assert claim["request"]["kv_transfer_params"]["handoff"] == handoffs
    assert claim["request"]["request_id"] == f"{session.id}-t0-h{handoffs}"
    assert answer.status == "streaming"
    assert (time.monotonic() - answer.handed_off_at < 1) is (handoffs == 2)


async def test_a_stale_hand_off_refused_at_claim_time_fails_the_answer(server: Server) -> None:
    session = server.open_session()
    answer = await server.ready(session)
    assert answer.handed_off_at is not None
    answer.handed_off_at -= 60
    server.results.append(overloaded(1))
    claim = await server.session_claim(session_id=session.id)
    assert claim["answer"]["status"] == "failed" and claim["answer"]["error"]["code"] == 429
    assert session.state == SessionState.OPEN


async def test_cancel_before_any_claim_cancels_the_hand_off(server: Server) -> None:
    server.gate = asyncio.Event()  # the hand-off's prefill does not finish
    session = server.open_session()
    await server.end_input(session, "Hello")
    await wait_until(lambda: len(server.calls) == 1)
    answer = session.answers[0]
    assert answer.status == "preparing"

    done = await server.session_answer_done(session_id=session.id, turn=0, outcome={"status": "cancelled"})

    assert done["status"] == "cancelled"
    assert answer.task is not None and answer.task.done()
    assert session.state == SessionState.OPEN and not session.answering
    claim = await server.session_claim(session_id=session.id)
    assert "request" not in claim and claim["answer"]["status"] == "cancelled"
    assert len(server.calls) == 1


async def test_cancel_of_a_ready_unclaimed_answer(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    done = await server.session_answer_done(session_id=session.id, turn=0, outcome={"status": "cancelled"})
    assert done["status"] == "cancelled" and session.answers[0].request is None
    assert (await server.session_claim(session_id=session.id))["answer"]["status"] == "cancelled"


async def test_cancel_during_a_claim_time_hand_off_is_kept(server: Server) -> None:
    session = server.open_session()
    answer = await server.ready(session)
    assert answer.handed_off_at is not None
    answer.handed_off_at -= 60
    server.gate = asyncio.Event()
    claim_task = asyncio.create_task(server.session_claim(session_id=session.id))
    await wait_until(lambda: len(server.calls) == 2)  # the claim is making the hand-off again

    done = await server.session_answer_done(session_id=session.id, turn=0, outcome={"status": "cancelled"})
    assert done["status"] == "cancelled"
    server.gate.set()
    claim = await asyncio.wait_for(claim_task, 2)

    assert answer.status == "cancelled" and not session.answering
    assert "request" not in claim


async def test_closing_the_session_cancels_a_hand_off_in_progress(server: Server) -> None:
    server.gate = asyncio.Event()
    session = server.open_session()
    await server.end_input(session, "Hello")
    await wait_until(lambda: len(server.calls) == 1)
    await server.table.close(session, "deleted")
    answer = session.answers[0]
    assert answer.task is not None
    await asyncio.wait_for(asyncio.shield(answer.task), 2)
    assert answer.status == "cancelled" and session.state == SessionState.CLOSED
    claim = await server.session_claim(session_id=session.id)
    assert claim["answer"]["status"] == "cancelled"


# --- expiry --------------------------------------------------------------------------------------------
async def test_an_unclaimed_ready_answer_expires_after_the_idle_timeout(server: Server) -> None:
    session = server.open_session(idle_timeout_s=5, answer_timeout_s=50)
    assert server.handoffs.expire_answer(session, time.monotonic()) is None  # no answer
    await server.ready(session)
    now = time.monotonic()
    assert server.handoffs.expire_answer(session, now + 4) is None
    why = server.handoffs.expire_answer(session, now + 6)
    assert why == "no reader claimed the answer"

    assert why is not None
    await server.handoffs.give_up_answer(session, why)

    answer = session.answers[0]
    assert answer.status == "failed" and answer.error is not None and answer.error["code"] == 408
    assert session.state == SessionState.OPEN and not session.answering
    assert server.handoffs.expire_answer(session, now + 1000) is None  # over: nothing more to give up on
    claim = await server.session_claim(session_id=session.id)
    assert claim["answer"]["status"] == "failed"


async def test_a_streaming_answer_expires_after_the_answer_timeout(server: Server) -> None:
    session = server.open_session(idle_timeout_s=5, answer_timeout_s=50)
    await server.ready(session)
    await server.session_claim(session_id=session.id)
    now = time.monotonic()
    assert server.handoffs.expire_answer(session, now + 10) is None  # past the idle timeout, but being read
    why = server.handoffs.expire_answer(session, now + 51)
    assert why == "the answer's reader never reported its end"

    assert why is not None
    await server.handoffs.give_up_answer(session, why)
    assert session.answers[0].status == "failed" and session.state == SessionState.OPEN
    # The router's report, arriving after the owner gave up, changes nothing.
    late = await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("late"))
    assert late["status"] == "failed" and late["error"]["code"] == 408
    assert session.request["messages"] == [{"role": "user", "content": "What is a KV cache?"}]


async def test_a_released_answer_waits_for_its_next_reader(server: Server) -> None:
    """A REST reader that left before any output releases the answer: the next claim streams it (no new
    hand-off while the first is fresh), and the session stays answering meanwhile."""
    session = server.open_session({"model": "local:tiny-llama", "messages": [], "max_tokens": 8})
    await server.end_input(session, "Tell me about NIXL.")
    first = await server.session_claim(session_id=session.id)
    assert "request" in first

    released = await server.session_answer_done(session_id=session.id, turn=0, outcome={"status": "released"})
    assert released["status"] == "ready" and session.answering

    again = await server.session_claim(session_id=session.id)
    assert again["request"]["kv_transfer_params"] == first["request"]["kv_transfer_params"]
    assert len(server.calls) == 1
    done = await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("NIXL moves KV."))
    assert done["status"] == "completed" and not session.answering


async def test_a_session_answers_only_the_key_that_created_it(server: Server) -> None:
    """With API keys, a session belongs to its key's id: every other caller gets 404, as if it did not exist."""
    session = server.open_session()
    session.tenant = "key-a"
    ok = await server.session_chunk(session_id=session.id, sequence_id=0, payload="Hello ", tenant="key-a")
    assert "error" not in ok
    for intruder in ("key-b", ""):
        for call in (
            server.session_chunk(session_id=session.id, sequence_id=1, payload="x", tenant=intruder),
            server.session_info(session_id=session.id, tenant=intruder),
            server.session_claim(session_id=session.id, tenant=intruder),
            server.session_delete(session_id=session.id, tenant=intruder),
        ):
            refused = await call
            assert refused["error"]["code"] == 404, refused
    assert session.next_seq == 1 and session.id in server.sessions  # nothing applied, nothing deleted


async def test_each_key_holds_at_most_its_sessions(server: Server) -> None:
    server.config.limits.max_sessions_per_key = 2
    spec = {"request": {"model": "local:tiny-llama", "messages": []}}
    made = [await server.create_session({**spec, "tenant": "key-a"}) for _ in range(2)]
    assert all("session_id" in m for m in made)
    refused = await server.create_session({**spec, "tenant": "key-a"})
    assert refused["error"]["code"] == 429 and "this API key" in refused["error"]["message"]
    assert "session_id" in await server.create_session({**spec, "tenant": "key-b"})  # another key has room
    assert "session_id" in await server.create_session(spec)  # without keys there is no per-key cap


async def test_the_sweep_outlives_a_close_that_raises_cancelled(tokenizer: Any) -> None:
    """A session's close that ends in CancelledError (a cancelled write it waited on, say) is that session's
    failure: the sweep goes on expiring the others, and still stops when it is itself cancelled."""
    server = Server(tokenizer)
    first, second = server.open_session(idle_timeout_s=0.1), server.open_session(idle_timeout_s=0.1)
    close = server.table.close

    async def flaky_close(session: Session, reason: str) -> None:
        if session is first:
            raise asyncio.CancelledError
        await close(session, reason)

    async def no_stats() -> None:
        return None

    server.table.close = flaky_close  # type: ignore[method-assign]
    server.sweeper.export_stats = no_stats
    sweep = asyncio.create_task(server.sweeper.run())
    await asyncio.sleep(1.3)
    assert not sweep.done()
    assert second.state == SessionState.CLOSED and first.state != SessionState.CLOSED
    sweep.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sweep


async def test_an_answer_records_where_its_hand_off_time_went(server: Server) -> None:
    server.gate = asyncio.Event()  # the hand-off's prefill takes as long as the test says
    session = server.open_session()
    await server.end_input(session, "Hello")
    await asyncio.sleep(0.05)
    server.gate.set()
    claim = await server.session_claim(session_id=session.id)
    assert "request" in claim
    timing = session.answers[0].summary()["timing"]
    assert set(timing) == {"input_settle_ms", "handoff_ms"}
    assert timing["handoff_ms"] >= 50 and 0 <= timing["input_settle_ms"] < timing["handoff_ms"]
