"""The ranking policies (prefill/scheduler/policy.py) as pure functions: lower key = served first, and the
eviction key walking the other way."""

from __future__ import annotations

import math

import pytest

from prefill.scheduler.policy import RANKERS, RankView, rank_key, victim_key


def view(
    *,
    complete: bool = False,
    arrival: float = 0.0,
    last_chunk: float = 0.0,
    computed: int = 0,
    has_work: bool = True,
    order: int = 0,
) -> RankView:
    return RankView(complete, arrival, last_chunk, computed, has_work, order)


def ranked(policy: str, views: dict[str, RankView]) -> list[str]:
    key = rank_key(policy)  # type: ignore[arg-type]
    return sorted(views, key=lambda name: key(views[name]))


def evicted_first(policy: str, views: dict[str, tuple[bool, RankView]]) -> list[str]:
    return sorted(views, key=lambda name: victim_key(policy, *views[name]))  # type: ignore[arg-type]


def test_every_configured_policy_has_a_ranker() -> None:
    assert set(RANKERS) == {"fcfs", "lcas", "mcps", "vllm"}


def test_fcfs_complete_inputs_first_then_partial_by_session_arrival() -> None:
    views = {
        "partial_early": view(arrival=1.0, last_chunk=9.0, order=0),
        "partial_late": view(arrival=2.0, last_chunk=3.0, order=1),
        "complete_late": view(complete=True, arrival=5.0, order=2),
        "complete_early": view(complete=True, arrival=4.0, order=3),
    }
    assert ranked("fcfs", views) == ["complete_early", "complete_late", "partial_early", "partial_late"]


def test_lcas_orders_partial_inputs_by_their_latest_chunk() -> None:
    views = {
        "old_session_new_chunk": view(arrival=1.0, last_chunk=9.0, order=0),
        "new_session_old_chunk": view(arrival=2.0, last_chunk=3.0, order=1),
        "complete": view(complete=True, arrival=5.0, last_chunk=5.0, order=2),
    }
    assert ranked("lcas", views) == ["complete", "new_session_old_chunk", "old_session_new_chunk"]


def test_mcps_most_computed_first_whatever_the_arrival() -> None:
    views = {
        "little": view(arrival=1.0, computed=16, order=0),
        "most": view(arrival=3.0, computed=480, order=1),
        "none_complete": view(complete=True, arrival=0.5, computed=0, order=2),
        "some": view(arrival=2.0, computed=64, order=3),
    }
    assert ranked("mcps", views) == ["most", "some", "little", "none_complete"]


def test_mcps_ties_broken_by_arrival_then_engine_order() -> None:
    views = {
        "b": view(arrival=2.0, computed=32, order=0),
        "a": view(arrival=1.0, computed=32, order=5),
        "c": view(arrival=2.0, computed=32, order=1),
    }
    assert ranked("mcps", views) == ["a", "b", "c"]


def test_vllm_is_the_engine_order() -> None:
    views = {
        "third": view(complete=True, arrival=0.0, computed=999, order=2),
        "first": view(arrival=9.0, order=0),
        "second": view(arrival=5.0, order=1),
    }
    assert ranked("vllm", views) == ["first", "second", "third"]


@pytest.mark.parametrize("policy", ["fcfs", "lcas", "mcps"])
def test_requests_with_work_rank_before_those_without(policy: str) -> None:
    views = {
        "nothing_to_do": view(arrival=0.0, last_chunk=0.0, computed=0, has_work=False, order=0),
        "work": view(arrival=5.0, last_chunk=5.0, computed=0, has_work=True, order=1),
    }
    assert ranked(policy, views) == ["work", "nothing_to_do"]


def test_fcfs_key_without_work_is_infinite_arrival() -> None:
    assert rank_key("fcfs")(view(arrival=1.0, has_work=False, order=3)) == (0, 1, math.inf, 3)


@pytest.mark.parametrize("policy", ["fcfs", "lcas", "mcps"])
def test_victims_idle_first_then_lowest_ranked(policy: str) -> None:
    # Ranked: top, middle, bottom (for every policy: arrival, chunk and computed all agree).
    top = view(arrival=1.0, last_chunk=1.0, computed=300, order=0)
    middle = view(arrival=2.0, last_chunk=2.0, computed=200, order=1)
    bottom = view(arrival=3.0, last_chunk=3.0, computed=100, order=2)
    idle = view(arrival=0.0, last_chunk=0.0, computed=500, has_work=False, order=3)
    assert ranked(policy, {"top": top, "middle": middle, "bottom": bottom}) == ["top", "middle", "bottom"]
    victims = {"top": (False, top), "middle": (False, middle), "bottom": (False, bottom), "idle": (True, idle)}
    assert evicted_first(policy, victims) == ["idle", "bottom", "middle", "top"]


def test_victims_among_idle_sessions_for_mcps_least_computed_first() -> None:
    a = view(arrival=1.0, computed=64, has_work=False, order=0)
    b = view(arrival=2.0, computed=512, has_work=False, order=1)
    c = view(arrival=3.0, computed=16, has_work=False, order=2)
    assert evicted_first("mcps", {"a": (True, a), "b": (True, b), "c": (True, c)}) == ["c", "a", "b"]


def test_vllm_victims_latest_arrival_first() -> None:
    early = view(arrival=1.0, order=5)
    late = view(arrival=9.0, order=0)
    assert evicted_first("vllm", {"early": (True, early), "late": (True, late)}) == ["late", "early"]


def test_session_capacity_leaves_engine_slots_for_hand_offs() -> None:
    from core.scheduler_config import SchedulerSettings

    assert SchedulerSettings().session_capacity(1) == 0  # its idle request would hold the only slot
    assert SchedulerSettings().session_capacity(2) == 1
    assert SchedulerSettings().session_capacity(256) == 192
