"""A streaming request's appended input hits the prefix cache, as a new request's input does (vLLM looks a
request up once, on arrival; a session that already has KV would compute its cached chunks again)."""

from __future__ import annotations

import torch

from tests.unit.prefill.scheduler.harness import BLOCK


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


def test_a_hand_off_gets_a_copy_of_its_sessions_partial_last_block(make) -> None:
    """vLLM hits whole blocks only: the hand-off would compute the session's last, partial block again. It gets a
    copy of that block instead and computes only what the session never streamed."""
    h = make(policy="fcfs", num_blocks=32, budget=256, swap_slots=4)  # (swap_slots: the harness's KV tensors)
    streamed = h.tokens(2 * BLOCK + 8)
    h.add("sess_a-stream1", streamed, session="sess_a")
    h.run()
    session_blocks = h.blocks("sess_a-stream1")
    h.add("sess_a-t0-h1", [*streamed, *h.tokens(6)], resumable=False, session="sess_a")
    out = h.step()
    assert out.num_scheduled_tokens == {"sess_a-t0-h1": 6}  # not 8 + 6
    assert ("rtpd_copy_blocks", ([session_blocks[2]], [out.scheduled_new_reqs[0].block_ids[0][2]])) in h.executor.calls
    copied = out.scheduled_new_reqs[0].block_ids[0]
    assert copied[:2] == session_blocks[:2]  # the full blocks: shared through the prefix cache
    mine, theirs = h.block_contents([copied[2]]), h.block_contents([session_blocks[2]])
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert h.counters()["partial_block_shared_tokens"] == 8
    h.run()
    assert h.sched.compute_stats("sess_a")["prompt_tokens_computed_by_kind"]["handoff"] == 6


def test_a_hand_off_that_leaves_the_session_inside_its_last_block_shares_what_is_the_same(make) -> None:
    h = make(policy="fcfs", num_blocks=32, budget=256, swap_slots=4)
    streamed = h.tokens(2 * BLOCK + 8)
    h.add("sess_b-stream1", streamed, session="sess_b")
    h.run()
    rewritten = [*streamed[: 2 * BLOCK + 3], *h.tokens(10)]  # the input changed 3 tokens into the partial block
    h.add("sess_b-t0-h1", rewritten, resumable=False, session="sess_b")
    assert h.step().num_scheduled_tokens == {"sess_b-t0-h1": 10}
    h.run()
    # Diverging inside a block the session filled: the same, from a copy of that block.
    h.add("sess_b-t0-h2", [*streamed[: BLOCK + 4], *h.tokens(20)], resumable=False, session="sess_b")
    assert h.step().num_scheduled_tokens == {"sess_b-t0-h2": 20}
    assert h.counters()["partial_block_shared_tokens"] == 3 + 4
