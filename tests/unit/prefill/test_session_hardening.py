"""Defects a hostile read of the session code found (issue #9), each shown on a real `PrefillServer` with real
sessions; only the engine is faked (tests/unit/prefill/test_handoff.py's `Server`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.placement import new_session_id
from prefill.session import Session, SessionLimits, StartPolicy
from tests.unit.prefill.test_handoff import Server, completed, tokenizer  # noqa: F401  (the fixture)


@pytest.fixture
def server(tokenizer: Any) -> Server:  # noqa: F811
    return Server(tokenizer)


def streaming_session(server: Server, request: dict[str, Any] | None = None) -> Session:
    """A session that streams its input to the engine on every chunk (`on_first_chunk`)."""
    session_id = new_session_id(server.replica)
    request = request or {"model": "local:tiny-llama", "messages": []}
    session = Session(session_id, "chat", request, StartPolicy(), SessionLimits(), server.table.streaming(session_id))
    server.sessions[session_id] = session
    return session


async def test_calls_on_one_session_apply_one_at_a_time(server: Server) -> None:
    """Two chunks arriving together: the second is applied only once the first has been prefilled."""
    session = streaming_session(server)
    seen: list[tuple[int, int]] = []  # (chunks applied when a prefill starts, when it ends)
    inside = 0

    async def slow_sync(tokens: list[int]) -> None:
        nonlocal inside
        inside += 1
        assert inside == 1, "two calls of one session prefill at once"
        start = session.next_seq
        await asyncio.sleep(0.05)
        seen.append((start, session.next_seq))
        inside -= 1

    session.streaming.sync = slow_sync  # type: ignore[method-assign]
    replies = await asyncio.gather(
        *(server.session_chunk(session_id=session.id, sequence_id=i, payload=f"word{i} ") for i in range(3))
    )
    assert all("error" not in r for r in replies), replies
    assert seen == [(1, 1), (2, 2), (3, 3)]  # each call's input stayed as it was while it prefilled


async def test_an_end_of_input_chunk_and_finish_together_start_one_answer(server: Server) -> None:
    session = server.open_session()
    server.gate = asyncio.Event()
    replies = await asyncio.gather(
        server.session_chunk(session_id=session.id, sequence_id=0, payload="Hello there", end_of_input=True),
        server.session_finish(session_id=session.id),
        server.session_finish(session_id=session.id),
    )
    server.gate.set()
    assert all("error" not in r for r in replies), replies
    assert len(session.answers) == 1 and len(server.calls) <= 1
    await asyncio.wait_for(asyncio.shield(session.answers[0].task), 2)  # type: ignore[arg-type]
    assert len(server.calls) == 1


async def test_far_future_sequence_ids_are_refused_so_held_chunks_stay_bounded(server: Server) -> None:
    session = server.open_session()
    limit = session.limits.max_pending_chunks
    for seq in range(1, limit):
        assert "error" not in await server.session_chunk(session_id=session.id, sequence_id=seq, payload="")
    for seq in (limit, 10**9):
        refused = await server.session_chunk(session_id=session.id, sequence_id=seq, payload="")
        assert refused["error"]["code"] == 400 and refused["error"]["param"] == "sequence_id"
    assert len(session.pending) == limit - 1


async def test_an_oversized_chunk_is_refused_whole_and_the_session_goes_on(server: Server) -> None:
    session = server.open_session(max_chunk_bytes=16)
    refused = await server.session_chunk(session_id=session.id, sequence_id=0, payload="x" * 17)
    assert refused["error"]["code"] == 413
    assert session.next_seq == 0 and session.buffer == "" and session.payload_bytes == 0
    assert "error" not in await server.session_chunk(session_id=session.id, sequence_id=0, payload="fine")
    assert session.buffer == "fine"


async def test_conversation_items_count_against_the_payload_cap(server: Server) -> None:
    session = server.open_session(max_payload_bytes=100)
    assert "error" not in await server.session_message(session_id=session.id, role="user", content="x" * 60)
    refused = await server.session_message(session_id=session.id, role="user", content="y" * 60)
    assert refused["error"]["code"] == 413
    assert session.request["messages"] == [{"role": "user", "content": "x" * 60}]  # nothing half-applied


async def test_a_replace_past_the_payload_cap_changes_nothing(server: Server) -> None:
    session = server.open_session(max_payload_bytes=10)
    await server.session_buffer(session_id=session.id, op="append", text="abcdef")
    refused = await server.session_buffer(session_id=session.id, op="replace", text="z" * 20, offset=2)
    assert refused["error"]["code"] == 413
    assert session.buffer == "abcdef" and session.payload_bytes == 6


async def test_clients_may_lower_limits_but_not_raise_them(server: Server) -> None:
    spec = {"request": {"model": "local:tiny-llama", "messages": []}}
    lowered = await server.create_session({**spec, "limits": {"idle_timeout_s": 5, "max_payload_bytes": 10}})
    assert "session_id" in lowered
    session = server.sessions[lowered["session_id"]]
    assert session.limits.idle_timeout_s == 5 and session.limits.max_payload_bytes == 10
    assert session.limits.max_session_s == server.config.limits.max_session_s  # the rest: the server's
    for asked in ({"idle_timeout_s": 10**6}, {"max_payload_bytes": 10**12}, {"gap_timeout_s": 10**4}, []):
        refused = await server.create_session({**spec, "limits": asked})
        assert refused["error"]["code"] == 400, asked
    assert len(server.sessions) == 1


async def test_max_tokens_beyond_the_server_limit_is_refused(server: Server) -> None:
    server.config.limits.max_tokens = 100
    refused = await server.create_session({"request": {"model": "local:tiny-llama", "prompt": "", "max_tokens": 101}})
    assert refused["error"]["code"] == 400 and refused["error"]["param"] == "max_tokens"
    session = server.open_session()
    await server.end_input(session, "Hi")  # the session's own answer is fine
    server.results.clear()
    answer = session.answers[-1]
    await asyncio.wait_for(asyncio.shield(answer.task), 2)  # type: ignore[arg-type]
    await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("Hello"))
    refused = await server.session_respond(session_id=session.id, overrides={"max_tokens": 1000})
    assert refused["error"]["code"] == 400 and len(session.answers) == 1
    refused = await server.session_update(session_id=session.id, params={"max_tokens": 1000})
    assert refused["error"]["code"] == 400 and "max_tokens" not in session.request
    assert not server.sessions.keys() - {session.id}


async def test_list_content_becomes_text_and_other_input_is_refused_with_nothing_left_behind(server: Server) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    made = await server.create_session(
        {
            "request": {"model": "local:tiny-llama", "messages": [{"role": "user", "content": parts}]},
            "start_policy": {"type": "on_end_only"},
        }
    )
    assert "session_id" in made, made
    assert server.sessions[made["session_id"]].request["messages"][0]["content"] == "Hello there"
    for request in (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": 42}]},
        {"messages": "hi"},
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3]},
    ):
        refused = await server.create_session({"request": {"model": "local:tiny-llama", **request}})
        assert refused["error"]["code"] == 400, (request, refused)
    assert list(server.sessions) == [made["session_id"]]


async def test_an_item_created_during_an_answer_follows_the_answer(server: Server) -> None:
    session = server.open_session()
    answer = await server.ready(session, "What is a KV cache?")
    assert "error" not in await server.session_message(session_id=session.id, role="user", content="And NIXL?")
    assert session.request["messages"][-1]["content"] == "What is a KV cache?"  # not yet: the answer is first
    await server.session_claim(session_id=session.id, turn=answer.turn)
    await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("A cache of keys."))
    roles = [(m["role"], m["content"]) for m in session.request["messages"]]
    assert roles == [("user", "What is a KV cache?"), ("assistant", "A cache of keys."), ("user", "And NIXL?")]


async def test_an_empty_answer_keeps_the_turns_alternating(server: Server) -> None:
    session = server.open_session()
    await server.ready(session, "Say nothing.")
    await server.session_claim(session_id=session.id, turn=0)
    await server.session_answer_done(session_id=session.id, turn=0, outcome=completed(""))
    await server.end_input(session, "Now say something.")
    roles = [m["role"] for m in session.request["messages"]]
    assert roles == ["user", "assistant", "user"]


TEMPLATE = "{% for m in messages %}[[{{ m.role }}{{ suffix }}]]{{ m.content }}\n{% endfor %}"


async def test_stable_tokens_render_with_the_requests_template_tools_and_kwargs(server: Server) -> None:
    """The streamed prefix is what the hand-off renders, so that its KV is reused, not recomputed."""
    tok = server.engine.tokenizer
    if not hasattr(tok, "decode"):
        pytest.skip("needs the local model's tokenizer (python -m local_models.llm)")
    request = {
        "model": "local:tiny-llama",
        "messages": [{"role": "user", "content": "first turn"}],
        "chat_template": TEMPLATE,
        "chat_template_kwargs": {"suffix": "!"},
    }
    session = streaming_session(server, request)
    session.buffer = "a partial second"
    text = tok.decode(session.stable_tokens(tok))
    assert "[[user!]]first turn" in text


async def test_a_cancel_ends_an_unclaimed_answer_and_the_session_goes_on(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    cancelled = await server.session_cancel(session_id=session.id)
    assert cancelled["answer"]["status"] == "cancelled" and "stop" not in cancelled
    assert (await server.session_claim(session_id=session.id, turn=0))["answer"]["status"] == "cancelled"
    await server.end_input(session, "Another question?")  # the next turn
    assert len(session.answers) == 2
    assert (await server.session_cancel(session_id=session.id))["answer"]["status"] == "cancelled"
    refused = await server.session_cancel(session_id=session.id)
    assert refused["error"]["code"] == 409  # nothing in progress


async def test_a_cancel_of_a_streamed_answer_says_where_to_stop_it(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    await server.session_claim(session_id=session.id, turn=0)
    where = {"consumer": "router-1", "stream_id": "s1", "replica": "decode-1"}
    assert await server.session_streaming(session_id=session.id, turn=0, decode=where) == {}
    cancelled = await server.session_cancel(session_id=session.id)
    assert cancelled["stop"] == where and cancelled["answer"]["status"] == "streaming"
    # Its reader sees the stream stopped (decode's 499) and reports it: it ended cancelled, with its text.
    stopped = {"status": "failed", "text": "Par", "error": {"code": 499, "message": "stopped"}}
    summary = await server.session_answer_done(session_id=session.id, turn=0, outcome=stopped)
    assert summary["status"] == "cancelled" and summary["text"] == "Par" and summary["error"] is None


async def test_a_cancel_before_the_reader_registered_stops_it_when_it_does(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    await server.session_claim(session_id=session.id, turn=0)
    assert (await server.session_cancel(session_id=session.id))["stop"] is None
    where = {"consumer": "router-1", "stream_id": "s1", "replica": "decode-1"}
    assert await server.session_streaming(session_id=session.id, turn=0, decode=where) == {"stop": where}


async def test_a_negative_turn_is_refused(server: Server) -> None:
    session = server.open_session()
    await server.ready(session)
    for call in (server.session_claim, server.session_result):
        refused = await call(session_id=session.id, turn=-7)
        assert refused["error"]["code"] == 400 and refused["error"]["param"] == "turn"


async def test_a_retried_chunk_is_acknowledged_even_while_its_answer_runs(server: Server) -> None:
    session = server.open_session()
    await server.ready(session, "The last chunk")  # sequence 0, end of input: the answer runs
    again = await server.session_chunk(
        session_id=session.id, sequence_id=0, payload="The last chunk", end_of_input=True
    )
    assert again["duplicate"] is True and len(session.answers) == 1
    fresh = await server.session_chunk(session_id=session.id, sequence_id=1, payload="more")
    assert fresh["error"]["code"] == 409  # new input must wait for the answer


async def test_only_the_next_answer_may_be_waited_for(server: Server) -> None:
    session = server.open_session()
    for call in (server.session_claim, server.session_result):
        refused = await call(session_id=session.id, turn=17518)
        assert refused["error"]["code"] == 404 and refused["error"]["param"] == "turn"


async def test_a_streamed_answer_whose_reader_stopped_is_given_up_on(server: Server) -> None:
    """A reader that stops moving its answer (its client vanished and its router never noticed) does not keep
    the session answering, and holding its KV, until the answer timeout."""
    from prefill.handoff import READER_LEASE_S

    session = server.open_session()
    await server.ready(session)
    await server.session_claim(session_id=session.id, turn=0)
    now = session.answers[0].alive_at
    assert now is not None
    assert server.handoffs.expire_answer(session, now + READER_LEASE_S - 1) is None
    await server.session_alive(session_id=session.id, turn=0)  # a long answer, still being read
    alive = session.answers[0].alive_at
    assert alive is not None and alive >= now
    assert server.handoffs.expire_answer(session, alive + READER_LEASE_S - 1) is None
    assert "stopped" in (server.handoffs.expire_answer(session, alive + READER_LEASE_S + 1) or "")


async def test_a_session_created_to_close_after_its_answer_is_not_prefilled_again(server: Server) -> None:
    """`close_after_answer` (REST create): one turn only. When the answer ends the session closes, and its
    conversation is not prefilled again for a next turn (the re-prefill an open session gets)."""
    from router.sessions.rest import session_spec

    assert session_spec({"messages": [], "close_after_answer": True})["close_after_answer"] is True
    assert "close_after_answer" not in session_spec({"messages": [], "close_after_answer": True})["request"]
    session = server.open_session()
    session.close_after_answer = True
    synced: list[list[int]] = []

    async def sync(tokens: list[int]) -> None:
        synced.append(tokens)

    session.streaming.sync = sync  # type: ignore[method-assign]
    await server.ready(session)
    await server.session_claim(session_id=session.id, turn=0)
    await server.session_answer_done(session_id=session.id, turn=0, outcome=completed("Hi!"))
    assert session.state.value == "closed" and session.close_reason == "its answer ended"
    assert synced == []  # no re-prefill of the conversation
    # An ordinary session gets the re-prefill (its KV resident for the next turn).
    other = server.open_session()
    other.policy.type = "on_first_chunk"
    other.streaming.sync = sync  # type: ignore[method-assign]
    await server.ready(other)
    await server.session_claim(session_id=other.id, turn=0)
    await server.session_answer_done(session_id=other.id, turn=0, outcome=completed("Hi!"))
    assert other.state.value == "prefilling" and synced  # open, its conversation streaming again


async def test_a_one_request_session_ends_with_its_answer(server: Server) -> None:
    """An NDJSON body's session is closed by its owner when its answer ends, or when its one reader leaves
    before any output: its KV does not wait for the router's delete (which a vanished client may never cause)."""
    for outcome in (completed("Hi!"), {"status": "released"}):
        session = server.open_session()
        session.ephemeral = True
        await server.ready(session)
        await server.session_claim(session_id=session.id, turn=0)
        await server.session_answer_done(session_id=session.id, turn=0, outcome=outcome)
        assert session.state.value == "closed" and session.answers[0].done
