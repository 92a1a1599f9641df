"""Residency control (prefill/session_table.py `room_to_stream`): a session streams its input to the engine only
while the KV of every streaming session fits `streaming_kv_fraction` of the cache; one that does not fit buffers
its input (as `on_end_only` does) and starts streaming once room frees (at its next chunk, or when the replica's
sweep finds room, whichever comes first). Real sessions and session API; the engine is faked at its client (what
was sent, and the cache's size)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from prefill.session import StartPolicy
from tests.unit.prefill.test_handoff import Server, tokenizer  # noqa: F401  (the fixture)

BLOCK = 16


@pytest.fixture(autouse=True)
def no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input goes to the engine as soon as it comes (no wait for a burst of versions to settle)."""
    from prefill import streaming

    monkeypatch.setattr(streaming, "SETTLE_S", 0.0)


class Client:
    def __init__(self, blocks: int) -> None:
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=BLOCK))
        self.started: list[str] = []

    def generate(self, inputs: Any, params: Any, request_id: str) -> Any:
        async def outputs() -> Any:
            self.started.append(request_id)
            async for _ in inputs:
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0])])

        return outputs()


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


async def test_a_session_that_does_not_fit_buffers_its_input_until_room_frees(tokenizer) -> None:  # noqa: F811
    server = Server(tokenizer)
    server.engine.client = client = Client(blocks=12)  # 9 blocks (0.75) for streaming sessions
    big, small = server.open_session(), server.open_session()
    for s in (big, small):
        s.policy = StartPolicy(type="on_first_chunk")

    await server.session_chunk(session_id=big.id, sequence_id=0, payload=words(50))
    assert len(big.stable_tokens(tokenizer)) > 6 * BLOCK, "the first session takes most of the room"
    await server.session_chunk(session_id=small.id, sequence_id=0, payload=words(30))
    await asyncio.sleep(0.01)
    assert [r.rsplit("-stream", 1)[0] for r in client.started] == [big.id]  # the second one waits, input kept
    info = small.describe()
    assert info["buffered"] and not info["streaming"] and info["state"] == "open"

    await server.session_delete(session_id=big.id)  # room frees
    await server.session_chunk(session_id=small.id, sequence_id=1, payload="and more ")
    await asyncio.sleep(0.01)
    assert client.started[-1].startswith(small.id) and small.describe()["streaming"]
    assert small.streaming.target == small.stable_tokens(tokenizer)  # its whole input so far, buffered included
    await server.session_delete(session_id=small.id)


async def test_one_session_alone_always_streams(tokenizer) -> None:  # noqa: F811
    server = Server(tokenizer)
    server.engine.client = client = Client(blocks=4)
    session = server.open_session()
    session.policy = StartPolicy(type="on_first_chunk")
    await server.session_chunk(session_id=session.id, sequence_id=0, payload=words(40))
    await asyncio.sleep(0.01)
    assert client.started and not session.buffered
    await server.session_delete(session_id=session.id)


async def test_the_vllm_baseline_streams_every_session(tokenizer) -> None:  # noqa: F811
    """The `vllm` policy is the paper's streaming-vLLM baseline: nothing added, so no residency control."""
    server = Server(tokenizer)
    server.config.prefill.scheduler = server.settings.model_copy(update={"policy": "vllm"})
    server.engine.client = client = Client(blocks=12)
    big, small = server.open_session(), server.open_session()
    for s in (big, small):
        s.policy = StartPolicy(type="on_first_chunk")
    await server.session_chunk(session_id=big.id, sequence_id=0, payload=words(50))
    await server.session_chunk(session_id=small.id, sequence_id=0, payload=words(30))
    await asyncio.sleep(0.01)
    assert sorted(r.rsplit("-stream", 1)[0] for r in client.started) == sorted([big.id, small.id])
    assert not small.buffered
    for s in (big, small):
        await server.session_delete(session_id=s.id)


async def test_a_buffered_session_streams_once_room_frees_without_another_chunk(tokenizer) -> None:  # noqa: F811
    """Its next chunk may be its last (then all of its input would be the hand-off's): the replica's sweep starts
    it as soon as room frees, oldest first, and one that still does not fit keeps the ones behind it waiting."""
    server = Server(tokenizer)
    server.engine.client = client = Client(blocks=12)  # 9 blocks for streaming sessions
    big, older, newer = server.open_session(), server.open_session(), server.open_session()
    for s in (big, older, newer):
        s.policy = StartPolicy(type="on_first_chunk")
    await server.session_chunk(session_id=big.id, sequence_id=0, payload=words(50))
    await server.session_chunk(session_id=older.id, sequence_id=0, payload=words(50))
    await server.session_chunk(session_id=newer.id, sequence_id=0, payload=words(20))
    await asyncio.sleep(0.01)
    assert older.buffered and newer.buffered and not older.streaming.active
    await server.table.promote_buffered()  # no room yet: the oldest does not fit, and the newer waits behind it
    assert [r.rsplit("-stream", 1)[0] for r in client.started] == [big.id]

    await server.session_delete(session_id=big.id)
    await server.table.promote_buffered()
    await asyncio.sleep(0.01)
    started = [r.rsplit("-stream", 1)[0] for r in client.started]
    assert started[1] == older.id and older.streaming.target == older.stable_tokens(tokenizer)
    assert newer.id not in started  # the older one took the room: 7 of the 9 blocks
    for s in (older, newer):
        await server.session_delete(session_id=s.id)
