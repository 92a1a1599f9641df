"""Router admission control (router/admission.py) on fake routing stats: new sessions and plain requests are refused
(429 with Retry-After) only when every replica is full, and unknown state admits."""

from __future__ import annotations

from typing import Any

import pytest

from router.admission import Admission, decode_saturated, prefill_busy, session_room
from serve_app.config import AdmissionConfig, AppConfig
from serve_app.protocol import error_headers, error_status

CONFIG = AdmissionConfig(max_session_fill=0.9, max_queue_per_replica=8, min_kv_free_fraction=0.1, retry_after_s=3)


def prefill(open_: int = 0, capacity: int = 10, free: int = 100, waiting: int = 0) -> dict[str, Any]:
    return {
        "open_sessions": open_,
        "session_capacity": capacity,
        "kv_blocks_free": free,
        "kv_blocks_total": 100,
        "queue_waiting": waiting,
    }


def admission(prefills: list[dict[str, Any]] | None, decodes: list[dict[str, Any]] | None, **kw: Any) -> Admission:
    pools = {"prefill": prefills, "decode": decodes}
    return Admission(CONFIG.model_copy(update=kw), decode_capacity=4, stats=lambda name: pools[name])


@pytest.mark.parametrize(
    ("stats", "room"),
    [
        (prefill(open_=8), True),  # 8 < 0.9 * 10
        (prefill(open_=9), False),  # at the fill ratio
        (prefill(open_=0, free=9), False),  # KV under 10 % free
        (prefill(open_=0, free=10), True),
        ({}, True),  # no figures yet: the replica's own limit still holds
    ],
)
def test_session_room(stats: dict[str, Any], room: bool) -> None:
    assert session_room(stats, CONFIG) is room


def test_busy_and_saturated() -> None:
    assert not prefill_busy(prefill(waiting=7), CONFIG)
    assert prefill_busy(prefill(waiting=8), CONFIG)
    assert prefill_busy(prefill(free=5), CONFIG)
    assert not decode_saturated({"active_streams": 3}, 4)
    assert decode_saturated({"active_streams": 4}, 4)
    assert not decode_saturated({"active_streams": 400}, None)  # no known capacity: never saturated
    assert decode_saturated({"active_streams": 2, "stream_capacity": 2}, None)  # the replica's own figure wins


def test_a_session_is_admitted_while_any_prefill_replica_has_room() -> None:
    assert admission([prefill(open_=9), prefill(open_=3)], []).session() is None
    refused = admission([prefill(open_=9), prefill(open_=10)], []).session()
    assert refused is not None and refused.reason == "sessions_full"
    assert "9/10" in refused.message  # the least full replica's figures, to explain it
    kv = admission([prefill(free=1), prefill(free=2)], []).session()
    assert kv is not None and kv.reason == "kv_low"


def test_refusal_is_429_with_retry_after() -> None:
    refused = admission([prefill(open_=10)], []).session()
    assert refused is not None
    payload = refused.payload()
    assert error_status(payload) == 429
    assert payload["error"]["type"] == "RateLimitError"
    assert error_headers(payload) == {"Retry-After": "3"}


def test_a_plain_request_is_refused_only_when_prefill_and_decode_are_both_full() -> None:
    busy, idle = prefill(waiting=9), prefill(waiting=0)
    full, free = {"active_streams": 4}, {"active_streams": 1}
    assert admission([busy, busy], [full, full]).request() is not None
    assert admission([busy, idle], [full, full]).request() is None  # one prefill queue has room
    assert admission([busy, busy], [full, free]).request() is None  # decode can prefill it itself
    assert admission([busy], [{"active_streams": 9}], max_streams_per_decode=10).request() is None  # config wins


def test_unknown_state_and_disabled_admit() -> None:
    assert admission(None, None).session() is None  # no request router in this process yet
    assert admission([], []).request() is None  # no replica running
    assert admission([prefill(open_=10)], [], enabled=False).session() is None
    assert admission([prefill(waiting=99)], [{"active_streams": 99}], enabled=False).request() is None


def test_the_config_has_it() -> None:
    config = AppConfig.model_validate({"router": {"admission": {"max_session_fill": 0.5, "retry_after_s": 7}}})
    assert config.router.admission.max_session_fill == 0.5 and config.router.admission.enabled
    with pytest.raises(ValueError):
        AppConfig.model_validate({"router": {"admission": {"max_session_fil": 0.5}}})
