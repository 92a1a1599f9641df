"""The prefill role's client (prefill/client.py) on a fake Serve handle: each method calls the replica's method of
the same name with the same keywords, `route_to` only when given, each method's handle made once; and the router's
owner calls (router/sessions/owner.py) through it: the caller's key on every call, one `call_id` for every try of a call
that changes the session, retries steered to the session's new owner."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import RayActorError

from core.protocol import error_body
from prefill.client import PrefillClient
from prefill.server import PrefillServer
from router.sessions import owner

# The calls that change a session: each carries a `call_id`, so that a retry after its owner died is applied once.
MUTATING = {"session_chunk", "session_message", "session_buffer", "session_update", "session_finish", "session_respond"}
ROUTING = {"tenant", "call_id", "route_to"}  # taken off by the replica's `session_api` and the request router


class Handle:
    """A deployment handle: `options` gives itself; each attribute a method whose `.remote(...)` is recorded and
    answered by `replies[name]` (a list, in turn: an exception is raised), else `{}`."""

    def __init__(self, replies: dict[str, list[Any]] | None = None) -> None:
        self.options_given: list[dict[str, Any]] = []
        self.made: list[str] = []
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.replies = replies or {}

    def options(self, **options: Any) -> Handle:
        self.options_given.append(options)
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        self.made.append(name)
        handle = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                handle.calls.append((name, args, kwargs))

                async def reply() -> Any:
                    queued = handle.replies.get(name)
                    answer = queued.pop(0) if queued else {}
                    if isinstance(answer, BaseException):
                        raise answer
                    return answer

                return reply()

        return Method()


def public_methods() -> list[str]:
    return [name for name, _ in inspect.getmembers(PrefillClient, inspect.isfunction) if not name.startswith("_")]


def sample_kwargs(name: str) -> dict[str, Any]:
    """A distinct value for each keyword of the method (`route_to` left out: its own test)."""
    parameters = inspect.signature(getattr(PrefillClient, name)).parameters.values()
    return {p.name: f"<{p.name}>" for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "route_to"}


def test_the_client_has_every_method_routers_and_peers_call() -> None:
    sessions = {name for name in public_methods() if name.startswith("session_")}
    assert sessions == {
        "session_chunk", "session_message", "session_truncate", "session_buffer", "session_preempt",
        "session_update", "session_finish", "session_respond", "session_delete", "session_attach", "session_status",
        "session_info", "session_claim", "session_answer_done", "session_streaming", "session_alive",
        "session_cancel", "session_result",
    }  # fmt: skip
    assert set(public_methods()) - sessions == {"prefill", "check_health", "create_session", "adopt_sessions"}


@pytest.mark.parametrize("name", [n for n in public_methods() if n.startswith("session_") or n == "adopt_sessions"])
def test_each_keyword_is_one_the_replica_takes(name: str) -> None:
    """The client's keywords are the replica method's own (and the ones taken off for routing): a keyword renamed
    on either side shows here, not as a TypeError on a replica."""
    server = set(inspect.signature(getattr(PrefillServer.func_or_class, name)).parameters) - {"self"}
    assert set(sample_kwargs(name)) - ROUTING <= server
    required = {
        p.name
        for p in inspect.signature(getattr(PrefillServer.func_or_class, name)).parameters.values()
        if p.default is p.empty
    } - {"self"}
    assert required <= set(sample_kwargs(name))


@pytest.mark.parametrize("name", [n for n in public_methods() if n.startswith("session_")])
async def test_a_session_call_sends_its_keywords_and_route_to_only_when_given(name: str) -> None:
    handle = Handle()
    client = PrefillClient(handle)
    kwargs = sample_kwargs(name)
    assert "tenant" in kwargs  # every session call says whose it is
    assert ("call_id" in kwargs) == (name in MUTATING)  # only the calls that change a session carry one
    assert await getattr(client, name)(**kwargs) == {}
    assert await getattr(client, name)(**kwargs, route_to="replica-2") == {}
    assert handle.calls == [(name, (), kwargs), (name, (), {**kwargs, "route_to": "replica-2"})]


async def test_prompts_health_and_session_creation_pass_their_arguments_as_they_are() -> None:
    handle = Handle({"prefill": [{"kv_transfer_params": {"k": 1}}]})
    client = PrefillClient(handle)
    body, spec = {"messages": []}, {"request": {"messages": []}, "tenant": "key-1"}
    assert await client.prefill("chat", body) == {"kv_transfer_params": {"k": 1}}
    assert await client.check_health() == {}
    assert await client.create_session(spec) == {}
    assert handle.calls == [("prefill", ("chat", body), {}), ("check_health", (), {}), ("create_session", (spec,), {})]


async def test_adopt_sessions_is_steered_only_when_its_adopter_is_known() -> None:
    handle = Handle()
    client = PrefillClient(handle)
    journals = [[{"id": "sess_a_1"}]]
    await client.adopt_sessions(owner="a", journals=journals)
    await client.adopt_sessions(owner="a", journals=journals, session_id="sess_a_1", route_to="b")
    assert handle.calls == [
        ("adopt_sessions", (), {"owner": "a", "journals": journals}),  # (any replica: power of two choices)
        ("adopt_sessions", (), {"owner": "a", "journals": journals, "session_id": "sess_a_1", "route_to": "b"}),
    ]


async def test_each_methods_handle_is_made_once_and_calls_go_by_value() -> None:
    handle = Handle()
    client = PrefillClient(handle)
    for _ in range(3):
        await client.check_health()
        await client.session_info(session_id="s", tenant="")
    assert handle.options_given == [{"_by_reference": False, "stream": False}]
    assert handle.made == ["check_health", "session_info"]


# --- the router's owner calls (router/sessions/owner.py) through the client -----------------------------------
@pytest.fixture
def ingress(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(owner, "HANDOVER_RETRY_S", 0.0)
    monkeypatch.setattr(owner, "owners", OrderedDict())
    token = owner.current_tenant.set("key-1")
    yield SimpleNamespace(handle=Handle())
    owner.current_tenant.reset(token)


def client_of(ingress: Any, replies: dict[str, list[Any]]) -> Handle:
    ingress.handle.replies = replies
    ingress.prefill = PrefillClient(ingress.handle)
    return ingress.handle


async def test_a_mutating_call_keeps_its_call_id_through_a_dead_owner_and_a_hand_over(ingress: Any) -> None:
    moved = error_body(503, "session sess_a_1 is held by another replica; retry there", "session_id")
    moved["error"]["owner"] = "b"
    handle = client_of(ingress, {"session_buffer": [RayActorError(), moved, {"session_id": "sess_a_1"}]})
    result = await owner.session_buffer(ingress, "sess_a_1", op="append", text="hi")
    assert result == {"session_id": "sess_a_1"}
    tries = [kwargs for name, _, kwargs in handle.calls if name == "session_buffer"]
    assert len(tries) == 3 and len({t["call_id"] for t in tries}) == 1  # one id: the owner applies it once
    assert [t.get("route_to") for t in tries] == [None, None, "b"]  # (the new owner, once it was named)
    assert all(t["tenant"] == "key-1" and t["op"] == "append" and t["text"] == "hi" for t in tries)
    assert owner.owners == {"sess_a_1": "b"}  # the next call goes straight there
    await owner.session_info(ingress, "sess_a_1")
    assert handle.calls[-1] == ("session_info", (), {"session_id": "sess_a_1", "tenant": "key-1", "route_to": "b"})


@pytest.mark.parametrize(
    ("call", "kwargs"),
    [
        (owner.session_chunk, {"sequence_id": 0, "payload": "hi"}),
        (owner.session_message, {"role": "user", "content": "hi"}),
        (owner.session_buffer, {"op": "commit"}),
        (owner.session_update, {"instructions": "be brief"}),
        (owner.session_finish, {}),
        (owner.session_respond, {}),
        (owner.session_truncate, {"chars": 3}),
        (owner.session_preempt, {}),
        (owner.session_delete, {}),
        (owner.session_attach, {"connection": "router-1"}),
        (owner.session_info, {}),
        (owner.session_claim, {"turn": 0}),
        (owner.session_answer_done, {"turn": 0, "outcome": {"status": "completed"}}),
        (owner.session_streaming, {"turn": 0, "decode": {"replica": "d1"}}),
        (owner.session_alive, {"turn": 0}),
        (owner.session_cancel, {}),
        (owner.session_result, {"turn": 0, "wait": False}),
    ],
)
async def test_each_owner_call_reaches_its_method_with_the_callers_key(
    ingress: Any, call: Any, kwargs: dict[str, Any]
) -> None:
    handle = client_of(ingress, {})
    assert await call(ingress, "sess_a_1", **kwargs) == {}
    ((name, _, sent),) = handle.calls
    assert name == call.__name__ and sent["session_id"] == "sess_a_1" and sent["tenant"] == "key-1"
    assert {k: sent[k] for k in kwargs} == kwargs
    assert ("call_id" in sent) == (name in MUTATING) and "route_to" not in sent  # (no owner learnt yet)


async def test_the_routers_own_status_call_carries_the_sessions_key_not_the_callers(ingress: Any) -> None:
    handle = client_of(ingress, {"session_status": [{"state": "open"}]})
    assert await owner.session_status(ingress, "sess_a_1", "key-2") == {"state": "open"}
    assert handle.calls == [("session_status", (), {"session_id": "sess_a_1", "tenant": "key-2"})]


async def test_a_session_made_by_a_full_replica_is_refused_without_a_wait(ingress: Any) -> None:
    full = error_body(429, "capacity_exhausted: 96 sessions open; retry later")
    handle = client_of(ingress, {"create_session": [full]})
    assert await owner.create_session(ingress, {"request": {}}) == full
    assert handle.calls == [("create_session", ({"request": {}, "tenant": "key-1"},), {})]
