"""A streaming request's appended input hits the prefix cache, as a new request's input does (vLLM looks a
request up once, on arrival; a session that already has KV would compute its cached chunks again)."""

from __future__ import annotations

from tests.unit.scheduler.harness import BLOCK


def test_an_appended_chunk_shares_the_blocks_a_whole_request_computed(make) -> None:
    # A turn sent in one piece: its hand-off computes it whole; the session's next request (the conversation
    # with the answer, streamed again) starts with a short piece and then gets the rest.
    h = make(policy="fcfs", num_blocks=32, budget=256)
    convo = h.tokens(5 * BLOCK + 6)
    h.add("sess_a-t0-h1", convo[: 4 * BLOCK + 6], resumable=False, session="sess_a")
    h.run()
    handoff_blocks = h.blocks("sess_a-t0-h1") if "sess_a-t0-h1" in h.sched.requests else None
    h.add("sess_a-stream1", convo[:3], session="sess_a")
    h.run()
    h.add("sess_a-stream1", convo[3:], session="sess_a")
    steps = h.run()
    # Only what follows the hand-off's four full blocks is computed (not the 4 * BLOCK before it).
    assert sum(s.get("sess_a-stream1", 0) for s in steps) == len(convo) - 4 * BLOCK
    assert h.counters()["append_cache_hit_tokens"] == 4 * BLOCK - 3
    stats = h.sched.compute_stats("sess_a")
    assert stats["prompt_tokens_computed_by_kind"]["streamed"] == 3 + len(convo) - 4 * BLOCK
    assert h.sched.requests["sess_a-stream1"].num_computed_tokens == len(convo)
    if handoff_blocks is not None:  # (freed already, or still held: the same blocks either way)
        assert h.blocks("sess_a-stream1")[:4] == handoff_blocks[:4]


def test_a_session_streaming_documents_another_streamed_computes_only_what_differs(make) -> None:
    h = make(policy="fcfs", num_blocks=48, budget=512)
    docs = [h.tokens(2 * BLOCK) for _ in range(3)]
    for piece in docs:
        h.add("sess_a-stream1", piece, session="sess_a")
        h.run()
    question = h.tokens(7)
    computed = []
    for piece in [*docs, question]:
        h.add("sess_b-stream1", piece, session="sess_b")
        computed.append(sum(s.get("sess_b-stream1", 0) for s in h.run()))
    # Each chunk ends on a block boundary: its last block is computed to sample from (as vLLM does for a whole
    # request that hits to its end); every other block of A's documents is shared, on arrival (vLLM's own
    # lookup) and on append. Without the append hits: [16, 32, 32, 7].
    assert computed == [BLOCK, BLOCK, BLOCK, 7], computed
    assert h.counters()["append_cache_hit_tokens"] == 2 * BLOCK
    assert h.sched.requests["sess_b-stream1"].num_computed_tokens == 6 * BLOCK + 7
    a, b = h.blocks("sess_a-stream1"), h.blocks("sess_b-stream1")
    assert [a[i] for i in (0, 2, 4)] == [b[i] for i in (0, 2, 4)]


def test_an_append_with_nothing_cached_keeps_its_blocks_and_computes_it(make) -> None:
    h = make(policy="fcfs", num_blocks=32, budget=256)
    convo = h.tokens(4 * BLOCK + 2)
    h.add("sess_a-stream1", convo[: BLOCK + 5], session="sess_a")
    h.run()
    before = h.blocks("sess_a-stream1")
    h.add("sess_a-stream1", h.tokens(9), session="sess_a")  # nothing cached follows
    assert sum(s.get("sess_a-stream1", 0) for s in h.run()) == 9
    assert h.blocks("sess_a-stream1")[:2] == before[:2]
    assert "append_cache_hit_tokens" not in h.counters()
