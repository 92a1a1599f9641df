"""Work accounting on the real scheduler: every prompt token the prefill engine computes is counted by what it
was for (a session's streamed input, its hand-off, a whole prompt), per replica and per session."""

from __future__ import annotations

from engine.scheduler import work_kind


def test_request_ids_name_their_kind_of_work() -> None:
    assert work_kind("sess_r_abc-stream2") == "streamed"
    assert work_kind("chatcmpl-sess_r_abc-t0-h1-prefill-9f3a") == "handoff"
    assert work_kind("cmpl-4b1d2e") == "whole"


def test_computed_tokens_are_counted_by_kind_and_session(make) -> None:
    h = make(policy="fcfs", num_blocks=64, budget=256)
    first = h.tokens(40)
    h.add("sess_a-stream1", first, session="sess_a")  # streamed input
    h.run()
    h.add("sess_a-t0-h1", [*first, *h.tokens(8)], resumable=False, session="sess_a")  # the hand-off
    h.add("cmpl-1", 24, resumable=False)  # a whole prompt
    h.run()
    stats = h.sched.compute_stats("sess_a")
    by_kind = stats["prompt_tokens_computed_by_kind"]
    # The hand-off computes only what the prefix cache could not give back: past the session's full blocks.
    assert by_kind["streamed"] == 40 and 8 <= by_kind["handoff"] <= 8 + 16
    assert stats["prompt_tokens_computed"] == by_kind["streamed"] + by_kind["handoff"]
    replica = h.sched.compute_stats()
    assert replica["prompt_tokens_computed_by_kind"]["whole"] == 24
    assert replica["scheduler"]["computed_streamed"] == 40
