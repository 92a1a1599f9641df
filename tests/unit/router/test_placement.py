"""router/placement.py: the request router classes as Serve ships them, and the router's own placement."""

from __future__ import annotations

import asyncio

import pytest
from ray import cloudpickle

import router.placement
from core import placement


def test_the_request_routers_pickle_by_value_while_this_process_has_live_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve pickles a request router's module by value (`serve.status()` does, in a driver that has called a
    handle, whose pools then hold live routers with futures): the classes must not drag the live pools along."""

    class Live:
        def __init__(self) -> None:
            self.future = asyncio.new_event_loop().create_future()

    monkeypatch.setitem(placement.POOLS, "decode", Live())
    cloudpickle.register_pickle_by_value(router.placement)
    try:
        for cls in (
            router.placement.DecodeRouter,
            router.placement.SessionAffinityRouter,
            router.placement.SpeechRouter,
        ):
            assert cloudpickle.loads(cloudpickle.dumps(cls)).__name__ == cls.__name__
    finally:
        cloudpickle.unregister_pickle_by_value(router.placement)


class _Pool:
    """The decode pool as this process's Serve request router sees it (core/placement.py POOLS)."""

    def __init__(self, stats: dict[str, int]) -> None:
        from types import SimpleNamespace

        self.curr_replicas = {
            rid: SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={"active_streams": n})
            for rid, n in stats.items()
        }


def test_the_router_places_a_start_by_the_decode_pools_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.placement import choose_decode

    monkeypatch.setitem(placement.POOLS, "decode", _Pool({"d1": 5, "d2": 2, "d3": 2}))
    assert choose_decode([], None, lambda: {"d2": 4}) == "d3"  # (its own 4 streams on d2: the stats are older)
    assert choose_decode(["d3"], None, dict) == "d2"  # (never the replica a stream is resumed from)
    assert choose_decode([], "d1", dict) == "d1"  # (a continuation where its KV is cached)
    assert choose_decode(["d1", "d2", "d3"], None, dict) in {"d2", "d3"}  # (all avoided: any, by load)
    monkeypatch.setitem(placement.POOLS, "decode", _Pool({}))
    assert choose_decode([], None, dict) is None  # (no view of the pool: Serve places it)


def test_a_burst_of_starts_spreads_over_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starts in flight count as the replica's load: a burst does not all go to the one least loaded a second ago."""
    from router.streams.feeds import Feeds
    from tests.unit.router.test_feeds import FakeDecode

    monkeypatch.setitem(placement.POOLS, "decode", _Pool({"d1": 0, "d2": 0}))
    feeds = Feeds(FakeDecode(), "r")  # type: ignore[arg-type]
    chosen = []
    for _ in range(4):
        replica = router.placement.choose_decode([], None, feeds._local_streams)
        assert replica is not None
        feeds._starting[replica] += 1  # (as `_start_once` counts it)
        chosen.append(replica)
    assert sorted(chosen) == ["d1", "d1", "d2", "d2"]


def test_serve_and_the_router_place_by_the_same_first_rule() -> None:
    """`DecodeRouter` (Serve's routing) and `choose_decode` (the router's own) share `decode_candidates`: never an
    avoided replica unless all are, a preferred one first, then the fewest streams."""
    from types import SimpleNamespace

    replicas = list(_Pool({"d1": 5, "d2": 2, "d3": 1}).curr_replicas.values())

    def serve(**kwargs: object) -> list[list[str]]:
        pending = SimpleNamespace(kwargs=kwargs)
        groups = asyncio.run(router.placement.DecodeRouter.choose_replicas(None, replicas, pending))  # type: ignore[arg-type]
        return [[r.replica_id.unique_id for r in group] for group in groups]

    assert serve(prefer="d1") == [["d1"], ["d2", "d3"]]
    assert serve(prefer="d1", avoid=["d1"]) == [["d3", "d2"]]
    assert serve(avoid=["d1", "d2", "d3"]) == [["d3", "d2"], ["d1"]]
    assert serve(prefer="gone") == [["d3", "d2"], ["d1"]]
