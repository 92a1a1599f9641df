"""Session logic without an engine: stable tokenisation, chunk ordering, limits, session ids."""

from __future__ import annotations

import random
import time

import pytest
from transformers import AutoTokenizer

from core.placement import new_session_id, owner_of
from local_models.llm import make_local_model
from prefill.session import Session, SessionError, SessionLimits, StartPolicy
from prefill.streaming import StreamingPrefill, common_prefix_len

TEXT = (
    "Retrieved document: prefill starts before the prompt is complete.\n\nIt keeps the KV resident "
    "between chunks; numbers like 12345 and punctuation (commas, dots...) must survive any split."
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(make_local_model())


def session(endpoint="chat", request=None, **limits) -> Session:
    request = request if request is not None else ({"messages": []} if endpoint == "chat" else {"prompt": ""})
    return Session(
        new_session_id("abc123"),
        endpoint,
        request,
        StartPolicy(),
        SessionLimits(**limits),
        StreamingPrefill(None, "x"),
    )


def final_tokens(s: Session, tokenizer) -> list[int]:
    """What vLLM's serving layer computes for the whole input (chat: template + generation prompt)."""
    request = s.full_request()
    if s.endpoint == "chat":
        text = tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(request["prompt"], add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("seed", range(8))
def test_stable_tokens_are_always_a_prefix_of_the_final_tokens(tokenizer, endpoint, seed):
    rng = random.Random(seed)
    s = session(endpoint, {"messages": [{"role": "system", "content": "Be brief."}]} if endpoint == "chat" else None)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 15))
    previous: list[int] = []
    for seq, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(TEXT)], strict=True)):
        s.add_chunk(seq, TEXT[a:b], end_of_input=False)
        stable = s.stable_tokens(tokenizer)
        # stable tokens only grow: what was streamed to the engine never has to be taken back
        assert stable[: len(previous)] == previous
        previous = stable
    final = final_tokens(s, tokenizer)
    assert final[: len(previous)] == previous
    # and they cover all but the last word or so: the hand-off computes a short tail only
    assert len(final) - len(previous) < 16


def test_stable_tokens_with_committed_messages(tokenizer):
    s = session()
    s.add_message("user", "first turn")
    s.add_message("assistant", "an answer")
    stable = s.stable_tokens(tokenizer)
    s.add_chunk(0, "second turn continues", end_of_input=False)
    assert s.stable_tokens(tokenizer)[: len(stable)] == stable
    assert final_tokens(s, tokenizer)[: len(stable)] == stable


def test_empty_session_streams_nothing(tokenizer):
    assert session().stable_tokens(tokenizer) == []
    assert session("completion").stable_tokens(tokenizer) == []


def test_chunks_apply_in_order_once():
    s = session()
    assert s.add_chunk(1, "b", False) == {"duplicate": False, "applied": [], "pending": [1]}
    assert s.add_chunk(1, "b", False)["duplicate"] is True
    assert s.add_chunk(0, "a", False)["applied"] == [0, 1]
    assert s.add_chunk(0, "a", False)["duplicate"] is True
    assert s.buffer == "ab"
    assert [c["sequence_id"] for c in s.chunk_log] == [0, 1]
    s.add_chunk(2, "c", True)
    assert s.input_ended


def test_payload_cap_and_gap_timeout():
    s = session(max_payload_bytes=10, gap_timeout_s=0.05)
    s.add_chunk(0, "12345", False)
    with pytest.raises(SessionError) as e:
        s.add_chunk(1, "123456", False)
    assert e.value.status == 413
    s.add_chunk(2, "x", False)
    assert s.expired_gap(time.monotonic()) is None
    assert s.expired_gap(time.monotonic() + 1) == 1


def test_start_policy():
    assert session().may_start(1)
    s = session()
    s.policy = StartPolicy(type="on_min_length", min_tokens=100)
    assert not s.may_start(99) and s.may_start(100)
    s.policy = StartPolicy(type="on_end_only")
    assert not s.may_start(10_000)


def test_session_ids_name_their_owner_and_are_unguessable():
    a, b = new_session_id("r1x"), new_session_id("r1x")
    assert a != b and owner_of(a) == "r1x" == owner_of(b)
    assert len(a.split("_", 2)[2]) >= 24
    assert owner_of("not-a-session") is None


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_replace_chunks_rewrite_the_turn_from_an_offset():
    s = session()
    s.add_chunk(0, "documents: alpha beta", False)
    s.add_chunk(1, "gamma delta", False, "replace", 11)
    assert s.buffer == "documents: gamma delta"
    assert s.payload_bytes == len(s.buffer.encode())  # the cap bounds the input held
    s.add_chunk(2, "everything new", False, "replace")  # offset 0: the whole turn
    assert s.buffer == "everything new"
    with pytest.raises(SessionError) as e:
        s.add_chunk(3, "x", False, "replace", 999)
    assert e.value.status == 400 and e.value.param == "offset" and s.next_seq == 3  # nothing applied


def test_replace_near_the_payload_cap_counts_what_it_replaces():
    s = session(max_payload_bytes=100)
    s.add_chunk(0, "a" * 90, False)
    s.add_chunk(1, "b" * 90, False, "replace", 0)  # 90 bytes held before and after: within the cap
    assert s.payload_bytes == 90
    s.clear_text()
    assert s.payload_bytes == 0


def test_a_held_replace_chunk_with_a_bad_offset_closes_the_session_when_its_turn_comes():
    s = session()
    s.add_chunk(1, "y", False, "replace", 500)  # held: chunk 0 is missing
    with pytest.raises(SessionError) as e:
        s.add_chunk(0, "short", False)
    assert e.value.close and e.value.status == 400 and "chunk 1" in e.value.message


def test_prefill_body_keeps_the_schedulers_keys_out_of_client_hands():
    from prefill.server import prefill_body

    body = {"prompt": "x", "vllm_xargs": {"rtpd_arrival": "0", "rtpd_session": "sess_other", "mine": 1}}
    assert prefill_body(body)["vllm_xargs"] == {"mine": 1}


def test_a_transcript_chunk_replaces_the_turns_last_transcript_after_the_typed_text():
    """REST audio chunks reach the owner as `mode: "transcript"`: the turn's transcript so far, each in place of
    the one before, after what the turn had when its audio began; a journal replay (or a held chunk) the same."""
    s = session()
    s.add_chunk(0, "Note: ", False)
    s.add_chunk(1, "what is", False, "transcript")
    s.add_chunk(2, "what time is it", False, "transcript")
    assert s.buffer == "Note: what time is it"
    s.add_chunk(4, "What time is it in Tokyo?", True, "transcript")  # held out of order, then applied
    s.add_chunk(3, "what time is it in", False, "transcript")
    assert s.buffer == "Note: What time is it in Tokyo?"
    assert s.payload_bytes == len(s.buffer.encode())
    s.commit_buffer()
    assert s.transcript_at is None
    s.input_ended = False
    s.add_chunk(5, "Goodbye.", False, "transcript")
    assert s.buffer == "Goodbye."


def test_truncating_the_last_answer_keeps_what_the_user_heard_and_replays_the_same():
    from prefill.journal import _apply

    s = session()
    s.add_message("user", "Tell me a story.")
    s.add_message("assistant", "Once upon a time there was")
    assert s.conversation.truncate_answer(9) and s.full_request()["messages"][-1]["content"] == "Once upon"
    assert not s.conversation.truncate_answer(50)  # (shorter already: nothing to cut)
    replayed = session()
    replayed.add_message("user", "Tell me a story.")
    replayed.add_message("assistant", "Once upon a time there was")
    _apply(replayed, {"op": "truncate", "chars": 9})
    assert replayed.full_request()["messages"] == s.full_request()["messages"]


def test_a_spoken_turn_refuses_typed_text_and_a_replace_over_its_transcript_starts_it_anew():
    s = session()
    s.add_chunk(0, "what is", False, "transcript", audio_start=True)
    with pytest.raises(SessionError) as refused:
        s.add_chunk(1, " typed", False)
    assert refused.value.status == 409 and s.buffer == "what is"
    s.add_chunk(1, "", False, "replace", 0)  # the client clears the lost turn's transcript (as the 409 says)
    s.add_chunk(2, "how far", False, "transcript", audio_start=True)  # a new speech turn: no 409
    assert s.buffer == "how far"


def test_preemptive_options_turned_off_replay_as_off():
    """`session_update(preemptive=False)` is journaled as False: the session's next owner has none either."""
    from core.config import PreemptiveOptions
    from prefill.journal import _apply
    from prefill.preempt_state import PreemptState

    s = session()
    _apply(s, {"op": "update", "instructions": None, "params": None, "preemptive": {"after_idle_ms": None}})
    assert isinstance(s.preempt, PreemptState) and s.preempt.options == PreemptiveOptions(after_idle_ms=None)
    _apply(s, {"op": "update", "instructions": None, "params": None, "preemptive": False})
    assert s.preempt is None


def test_a_session_whose_connection_died_with_its_router_is_orphaned_after_a_grace() -> None:
    """A realtime or NDJSON session's client connection was held by a router replica that died (SIGKILLed: no
    DELETE): after the grace for a reconnect, its owner closes it (the chaos run found one left, KV and all);
    a client re-attaching meanwhile (alive again) resets it; a session with no connection never is."""
    from prefill.session import ORPHAN_GRACE_S

    s = session()
    assert not s.orphaned(0.0, connection_alive=False)  # no connection recorded (a REST session)
    s.connection = "SERVE_REPLICA::app#router#abc"
    assert not s.orphaned(100.0, connection_alive=True)
    assert not s.orphaned(101.0, connection_alive=False)  # its router died: the grace starts
    assert not s.orphaned(101.0 + ORPHAN_GRACE_S - 1, connection_alive=False)
    assert not s.orphaned(101.0 + ORPHAN_GRACE_S, connection_alive=True)  # re-attached through a live one
    assert not s.orphaned(200.0, connection_alive=False)
    assert s.orphaned(200.0 + ORPHAN_GRACE_S + 1, connection_alive=False)
    assert Session.adopt(s.export(), StreamingPrefill(None, "x")).connection == s.connection  # (outlives its owner)
