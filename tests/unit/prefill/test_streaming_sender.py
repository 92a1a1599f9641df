"""A session's sender (prefill/streaming.py): what reaches the engine when versions of the input arrive faster
than they prefill. The engine is faked at its client (`generate` over the chunk stream, `utility`): each chunk
"prefills" until the test lets it finish, so what is in flight when new input comes is under the test's control.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prefill.rewrite_depth import MAX_AGE_S, MIN_REWRITES, RETOKENIZED_TOKENS, RewriteDepth
from prefill.streaming import StreamingPrefill


class Engine:
    """Records every chunk each engine request got, and which requests are open; a chunk is done when the
    test calls `finish()` (or at once with `instant`)."""

    def __init__(self, instant: bool = False) -> None:
        self.instant = instant
        self.chunks: list[tuple[str, list[int]]] = []
        self.open: set[str] = set()
        self.utility_calls: list[tuple[Any, ...]] = []
        self._done = asyncio.Event()
        self.in_flight = False
        self._cut = False
        self.client = self

    def finish(self) -> None:
        self._done.set()

    def generate(self, inputs: Any, params: Any, request_id: str) -> Any:
        async def outputs() -> Any:
            self.open.add(request_id)
            try:
                async for chunk in inputs:
                    self.chunks.append((request_id, list(chunk.prompt["prompt_token_ids"])))
                    if not self.instant:
                        self.in_flight = True
                        await self._done.wait()
                        self._done.clear()
                        self.in_flight = False
                        if self._cut:  # ended by a rewrite, between two steps: no output
                            self._cut = False
                            continue
                    yield type("Out", (), {"outputs": [type("C", (), {"token_ids": [0]})()]})()
            finally:
                self.open.discard(request_id)

        return outputs()

    async def utility(self, name: str, *args: Any) -> Any:
        self.utility_calls.append((name, *args))
        if name == "rtpd_invalidate":  # the request keeps exactly the common prefix; a chunk in flight ends
            ended = self.in_flight
            if ended:
                self._cut = True
                self._done.set()
                await asyncio.sleep(0)
            return [args[1], int(ended)]
        return True


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
def engine() -> Engine:
    return Engine()


async def test_versions_arriving_while_a_chunk_prefills_are_coalesced_into_one_chunk(engine: Engine) -> None:
    streaming = StreamingPrefill(engine, "sess_r_a", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync([1, 2, 3])
    await settle()
    for n in range(4, 9):  # five more versions while the first chunk is in flight
        await streaming.sync(list(range(1, n + 1)))
        await settle()
    assert engine.chunks == [("sess_r_a-stream1", [1, 2, 3])]  # nothing more in flight meanwhile
    engine.finish()
    await settle()
    assert engine.chunks[1] == ("sess_r_a-stream1", [4, 5, 6, 7, 8])  # only the latest, as one chunk
    engine.finish()
    await streaming.wait_computed()
    assert streaming.sent == list(range(1, 9)) and streaming.coalesced == 4
    await streaming.close()


async def test_a_rewrite_of_input_still_waiting_behind_the_chunk_in_flight_cuts_nothing(engine: Engine) -> None:
    """Appends that wait behind a chunk in flight, then rewritten before they were sent: nothing the engine holds
    changes, so nothing is cut (no rewrite counted); the replaced versions count as coalesced (what a session under
    pressure, its first chunk queued in the engine, shows: tests/integration/test_scheduler_pressure.py)."""
    streaming = StreamingPrefill(engine, "sess_r_w", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync([1, 2, 3])
    await settle()
    await streaming.sync([1, 2, 3, 4, 5, 6])  # waits: the first chunk is in flight
    await settle()
    await streaming.sync([1, 2, 3, 9, 9])  # rewrites what never reached the engine
    await settle()
    engine.instant = True
    engine.finish()
    await streaming.wait_computed()
    assert engine.chunks == [("sess_r_w-stream1", [1, 2, 3]), ("sess_r_w-stream1", [9, 9])]
    assert not [c for c in engine.utility_calls if c[0] == "rtpd_invalidate"]
    assert (streaming.rewrites, streaming.invalidated_tokens, streaming.coalesced) == (0, 0, 1)
    await streaming.close()


async def test_a_rewrite_cuts_the_chunk_in_flight_and_its_new_suffix_follows_at_once(engine: Engine) -> None:
    """Input goes in short chunks (`max_chunk_tokens`); a rewrite does not wait for the one in flight: the engine
    cuts the request to the common prefix between two steps, ending that chunk, and the latest version's suffix
    follows on the same request (nothing of the common prefix computed again)."""
    streaming = StreamingPrefill(engine, "sess_r_b", timeout=2, settle_s=0, rewrite_quiet_s=0, max_chunk_tokens=32)
    first = list(range(100))
    await streaming.sync(first)
    await settle()
    assert engine.chunks == [("sess_r_b-stream1", first[:32])]
    rewritten = first[:10] + [7] * 50
    await streaming.sync(rewritten)
    await settle()
    assert ("rtpd_invalidate", "sess_r_b", 10) in engine.utility_calls  # without waiting for the chunk
    assert engine.chunks[1] == ("sess_r_b-stream1", rewritten[10:42])
    assert streaming.chunks_cut == 1
    engine.instant = True
    engine.finish()
    await streaming.wait_computed()
    assert streaming.sent == rewritten and streaming.invalidated_tokens == 22
    assert [rid for rid, _ in engine.chunks] == ["sess_r_b-stream1"] * 3
    await streaming.close()
    assert not engine.open


async def test_a_rewrite_of_an_idle_request_cuts_it_in_place_and_appends_the_new_suffix() -> None:
    engine = Engine(instant=True)
    streaming = StreamingPrefill(engine, "sess_r_c", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync(list(range(40)))
    await streaming.wait_computed()
    await streaming.sync([*range(30), 9, 9, 9])
    await streaming.wait_computed()
    assert ("rtpd_invalidate", "sess_r_c", 30) in engine.utility_calls
    assert engine.chunks == [("sess_r_c-stream1", list(range(40))), ("sess_r_c-stream1", [9, 9, 9])]
    assert streaming.superseded_chunks == 0 and streaming.invalidated_tokens == 10
    await streaming.close()


async def test_wait_computed_waits_for_the_latest_version(engine: Engine) -> None:
    streaming = StreamingPrefill(engine, "sess_r_d", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync([1, 2])
    await settle()
    await streaming.sync([1, 2, 3, 4])
    waiting = asyncio.ensure_future(streaming.wait_computed())
    engine.finish()  # the first chunk only
    await settle()
    assert not waiting.done()
    engine.finish()
    await asyncio.wait_for(waiting, 2)
    await streaming.close()


async def test_nothing_reaches_the_engine_after_close(engine: Engine) -> None:
    streaming = StreamingPrefill(engine, "sess_r_e", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync([1, 2, 3])
    await settle()
    await streaming.close()
    await streaming.sync([1, 2, 3, 4, 5])
    await settle()
    assert engine.chunks == [("sess_r_e-stream1", [1, 2, 3])] and not engine.open


async def test_a_rewrite_right_behind_a_version_is_seen_before_that_version_is_prefilled(engine: Engine) -> None:
    """Update traces rewrite in bursts (~40 ms apart): a token is sent once it stood unchanged for settle_s, so
    the first version is never prefilled in full only to be cut at 10%; while rewrites keep coming only the prefix every
    version shares is prefilled, and the rest once they stop."""
    engine.instant = True
    streaming = StreamingPrefill(engine, "sess_r_f", timeout=2, settle_s=0.05, rewrite_quiet_s=0.3)
    first = list(range(100))
    await streaming.sync(first)
    await asyncio.sleep(0.01)
    await streaming.sync([*first[:10], *[7] * 90])  # rewritten from 10% on, 10 ms later
    await asyncio.sleep(0.01)
    await streaming.sync([*first[:10], *[8] * 90])  # and again
    await asyncio.sleep(0.15)  # settled: only the stable prefix was sent
    assert engine.chunks == [("sess_r_f-stream1", first[:10])]
    await asyncio.sleep(0.3)  # no rewrite for rewrite_quiet_s: the rest follows
    assert engine.chunks[-1] == ("sess_r_f-stream1", [8] * 90)
    assert sum(len(c) for _, c in engine.chunks) == 100  # nothing computed twice
    await streaming.close()


async def test_at_end_of_input_nothing_more_streams_and_a_useful_chunk_in_flight_is_waited_for(engine: Engine) -> None:
    streaming = StreamingPrefill(engine, "sess_r_g", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync(list(range(50)))
    await settle()
    await streaming.sync(list(range(80)))  # waits behind the chunk in flight
    finishing = asyncio.ensure_future(streaming.finish_input())
    await settle()
    assert not finishing.done()  # the chunk in flight holds the input's tokens: the hand-off will reuse them
    assert ("rtpd_input_ended", "sess_r_g") in engine.utility_calls
    engine.finish()
    await asyncio.wait_for(finishing, 2)
    await settle()
    assert engine.chunks == [("sess_r_g-stream1", list(range(50)))]  # the rest is the hand-off's, not streamed
    await streaming.close()


async def test_at_end_of_input_a_superseded_chunk_in_flight_is_aborted_not_waited_for(engine: Engine) -> None:
    streaming = StreamingPrefill(engine, "sess_r_h", timeout=2, settle_s=0, rewrite_quiet_s=10)
    await streaming.sync(list(range(5, 55)))
    await settle()
    streaming.target = [1, 2, 3]  # (the final input shares none of the chunk in flight)
    await asyncio.wait_for(streaming.finish_input(), 0.5)
    assert not engine.open and streaming.superseded_chunks == 1
    await streaming.close()


async def test_input_that_keeps_coming_flows_with_the_settle_lag(engine: Engine) -> None:
    """Appended input arriving faster than settle_s is not held back until it pauses: each token goes once it
    has stood for settle_s, while later ones keep coming."""
    engine.instant = True
    streaming = StreamingPrefill(engine, "sess_r_i", timeout=2, settle_s=0.05, rewrite_quiet_s=0.3)
    tokens: list[int] = []
    for i in range(30):  # 10 tokens every 10 ms for 300 ms
        await asyncio.sleep(0.01)
        tokens += list(range(10 * i, 10 * i + 10))
        await streaming.sync(tokens)
    sent_while_streaming = sum(len(c) for _, c in engine.chunks)
    assert 100 <= sent_while_streaming < 300  # what stood for 50 ms went; the newest waits
    await asyncio.sleep(0.1)
    assert [t for _, c in engine.chunks for t in c] == tokens  # in order, each once
    await streaming.close()


def rewriting_replica(kept: float) -> RewriteDepth:
    """A replica whose sessions' rewrites kept `kept` of each version."""
    depth = RewriteDepth()
    for _ in range(MIN_REWRITES):
        depth.record(1000, int(kept * 1000))
    return depth


def test_a_replica_holds_nothing_until_its_sessions_have_rewritten_and_appends_are_not_rewrites() -> None:
    depth = RewriteDepth()
    for _ in range(50):
        depth.record(1000, 1000 - RETOKENIZED_TOKENS)  # a chunk boundary inside a word, re-tokenized
        depth.record(0, 0)  # a first version
    assert depth.hold_fraction() == 1.0
    for kept in range(100, 900, 100):  # eight rewrites keeping 10%..80%
        depth.record(1000, kept)
    assert depth.hold_fraction() == 0.1  # what all but the deepest tenth kept


def test_a_replica_stops_holding_once_its_rewrites_are_old() -> None:
    now = [0.0]
    depth = RewriteDepth(clock=lambda: now[0])
    for _ in range(MIN_REWRITES):
        depth.record(1000, 300)
    assert depth.hold_fraction() == 0.3
    now[0] += MAX_AGE_S + 1
    assert depth.hold_fraction() == 1.0 and not depth.kept


async def test_a_fresh_version_streams_only_the_share_rewrites_keep_until_it_stands(engine: Engine) -> None:
    """On a replica whose sessions rewrite from half-way on, a first version's tail is not prefilled only to be
    rewritten: half streams at once, the rest once the version stood for rewrite_quiet_s; a rewrite inside the
    held tail then costs nothing."""
    engine.instant = True
    depth = rewriting_replica(0.5)
    streaming = StreamingPrefill(engine, "sess_r_j", timeout=2, settle_s=0, rewrite_quiet_s=1.0, depth=depth)
    first = list(range(100))
    await streaming.sync(first)
    await asyncio.sleep(0.1)
    assert [t for _, c in engine.chunks for t in c] == first[:50]
    await streaming.sync([*first[:70], *[7] * 30])  # rewritten from 70% on: nothing computed is dropped
    await asyncio.sleep(0.1)
    assert streaming.invalidated_tokens == 0 and len(depth.kept) == MIN_REWRITES + 1 and not streaming.prefilled
    await asyncio.sleep(1.2)  # the version stood: the rest follows
    assert [t for _, c in engine.chunks for t in c] == [*first[:70], *[7] * 30]
    await streaming.close()


async def test_a_session_that_appends_streams_every_version_whole_on_a_rewriting_replica(engine: Engine) -> None:
    engine.instant = True
    streaming = StreamingPrefill(
        engine, "sess_r_k", timeout=2, settle_s=0, rewrite_quiet_s=10, depth=rewriting_replica(0.2)
    )
    await streaming.sync(list(range(100)))
    await asyncio.sleep(0.05)
    assert sum(len(c) for _, c in engine.chunks) == 20  # a first version: maybe rewritten
    await streaming.sync(list(range(150)))  # it grows: an appending session
    await asyncio.sleep(0.05)
    assert [t for _, c in engine.chunks for t in c] == list(range(150)) and streaming.appends
    await streaming.close()


async def test_catch_up_sends_the_whole_input_now_and_waits_for_it(engine: Engine) -> None:
    """A hand-off about to be made while the input may still grow (a preemptive answer at a pause) first has the
    session's request compute the latest input, settling and rewrite holds notwithstanding: the hand-off then
    reuses it (the prefix cache and the partial block's copy), and the input is not computed twice, by the
    hand-off now and by the session's request once it settles."""
    engine.instant = True
    streaming = StreamingPrefill(engine, "sess_r_c", timeout=2, settle_s=10, rewrite_quiet_s=10)
    await streaming.sync(list(range(20)))
    await settle()
    assert engine.chunks == []  # (not settled yet)
    await asyncio.wait_for(streaming.catch_up(1.0), 1.0)
    assert engine.chunks == [("sess_r_c-stream1", list(range(20)))]
    await streaming.sync([*range(10), 7, 7])  # a rewrite: held (rewrite_quiet_s) ...
    await asyncio.wait_for(streaming.catch_up(1.0), 1.0)  # ... unless a hand-off is about to compute it
    assert streaming.sent == [*range(10), 7, 7] and engine.chunks[-1][1] == [7, 7]
    await settle()
    assert sum(len(c) for _, c in engine.chunks) == 22  # and the sender does not cut it back
    await streaming.close()


async def test_catch_up_is_bounded_and_leaves_the_input_streaming(engine: Engine) -> None:
    streaming = StreamingPrefill(engine, "sess_r_d2", timeout=2, settle_s=0, rewrite_quiet_s=0)
    await streaming.sync(list(range(8)))
    await settle()  # in flight, never finished by the engine
    assert not await streaming.catch_up(0.05)  # not computed in time: the caller goes on without it
    engine.finish()
    await settle()
    assert streaming.prefilled
    await streaming.close()
