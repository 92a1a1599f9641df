"""Hardening: fuzz every REST endpoint (schemathesis over the live OpenAPI schema, and hypothesis strategies of
junk and near-valid bodies) and the Realtime WebSocket, on the real stack.

What must hold for every case: no 5xx; every HTTP error is OpenAI error JSON `{"error": {"message", "type",
"param", "code"}}` (and so is every SSE error event); a bad Realtime event leaves the socket open and gets an
`error` event (carrying the offending `event_id` when one was sent), and a valid conversation still works
after any sequence of bad events; REST chunks apply in `sequence_id` order, duplicates once. Afterwards the
server is healthy, both engines idle and no session left open.

Generated valid requests are capped at a few tokens (fuzzing.cap_generation). Reproducible (derandomized);
`RTPD_FUZZ_SCALE` scales every example count. Case counts and every violation seen are written to
`$RTPD_FUZZ_COUNTS` (default /tmp/rtpd-fuzz-counts.json) and printed at the end of the module.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.integration.conftest import engine_stats, wait_idle
from tests.integration.fuzzing import (
    COUNTS,
    HUGE_INTS,
    MAX_GEN_TOKENS,
    SPECIAL_FLOATS,
    WEIRD_TEXT,
    cap_generation,
    describe_failure,
    dump,
    error_shape_problem,
    fail,
    floats,
    fuzz_settings,
    json_dumps_lenient,
    json_values,
    junk,
    raw_bodies,
    record,
    reset,
    shorten,
    sse_error_problems,
    summary_lines,
    texts,
)

pytestmark = pytest.mark.integration

SESSIONS = "/v1/streaming_input/sessions"
TIMEOUT = 30.0  # no fuzzed request may take longer than this to answer
MODULE = "test_fuzz"


# --- plumbing ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def fuzz_report(pytestconfig: pytest.Config) -> Iterator[None]:
    reset()
    yield
    data = dump(MODULE)
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")
    for line in summary_lines(MODULE, data):
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def baseline_sessions(server: str) -> int:
    """Sessions open before the first fuzz test (taken then: autouse); the last test compares with it."""
    return engine_stats("prefill")["sessions_open"]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str

    @classmethod
    def of(cls, r: httpx.Response) -> Reply:
        return cls(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.text)

    def json(self) -> Any:
        return json.loads(self.text)


def send(http: httpx.Client, label: str, method: str, path: str, sent: Any = None, **kwargs: Any) -> Reply:
    """One fuzz request; no answer within TIMEOUT (or a dropped connection) is a finding."""
    try:
        r = http.request(method, path, **kwargs)
    except httpx.TimeoutException:
        fail("no_response", label=label, method=method, path=path, sent=sent, why=f"no answer within {TIMEOUT}s")
    except httpx.TransportError as e:
        fail("connection_error", label=label, method=method, path=path, sent=sent, why=repr(e))
    return Reply.of(r)


def check_reply(reply: Reply, label: str, sent: Any) -> None:
    """No 5xx; an error is OpenAI error JSON; an SSE body's error events too. Every violation is recorded
    before the first is raised."""
    COUNTS[f"case:{label}"] += 1
    COUNTS[f"status:{reply.status}"] += 1
    found: list[tuple[str, dict[str, Any]]] = []
    if reply.status >= 500:
        detail = {"label": label, "status": reply.status, "retry_after": reply.headers.get("retry-after")}
        found.append(("5xx", {**detail, "body": reply.text, "sent": sent}))
    if reply.status >= 400:
        try:
            why = error_shape_problem(reply.json())
        except ValueError:
            why = f"not JSON: {shorten(reply.text, 200)}"
        if why:
            found.append(("error_not_openai_json", {"label": label, "status": reply.status, "why": why, "sent": sent}))
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        for why in sse_error_problems(reply.text):
            found.append(("sse_error_not_openai_json", {"label": label, "why": why, "sent": sent}))
    for kind, detail in found[1:]:
        record(kind, **detail)
    if found:
        fail(found[0][0], **found[0][1])


def post_json(http: httpx.Client, label: str, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
    content = json_dumps_lenient(body)
    reply = send(http, label, "POST", path, sent=body, content=content, headers={"content-type": "application/json"})
    check_reply(reply, label, body)
    return reply


def create_session(http: httpx.Client, **body: Any) -> str:
    r = http.post(SESSIONS, json={"messages": [], "max_tokens": 4, **body})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def delete_session(http: httpx.Client, sid: str) -> None:
    http.delete(f"{SESSIONS}/{sid}")


def created_session_id(reply: Reply) -> str | None:
    if reply.status == 201:
        try:
            return reply.json().get("session_id")
        except (ValueError, AttributeError):
            return None
    return None


def is_finding(exc: BaseException) -> bool:
    if isinstance(getattr(exc, "exceptions", None), tuple):  # hypothesis's group of several bugs
        return all(is_finding(e) for e in exc.exceptions)
    return isinstance(exc, AssertionError)


def run_hypothesis(test: Any) -> None:
    """Run a nested @given test and fail with every distinct falsifying example it reports."""
    try:
        test()
    except Exception as e:  # an AssertionError or hypothesis's group of several distinct bugs
        pytest.fail(describe_failure(e), pytrace=False)


# --- strategies: near-valid OpenAI bodies ---------------------------------------------------------------
words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.?", min_size=1, max_size=30)
small_ints = st.one_of(st.integers(-3, 12), st.sampled_from(HUGE_INTS))
small_floats = st.one_of(st.floats(-3, 3), st.sampled_from(SPECIAL_FLOATS))
numbers = st.one_of(small_ints, small_floats)


def maybe_junk(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(plausible, plausible, junk)


# Tools and tool calls: good ones, schemas that are no JSON Schema, names and choices that match nothing.
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
schemas = st.one_of(
    st.just(WEATHER_PARAMETERS),
    st.sampled_from([{"type": "nonsense"}, {"required": 5}, {"properties": []}, {"$ref": "#/nowhere"}, {}, "x", 5]),
    junk,
)
tool_defs = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": maybe_junk(st.sampled_from(["get_weather", "f", ""]))},
                optional={"parameters": schemas, "description": junk, "strict": junk},
            ),
        }
    ),
    st.fixed_dictionaries({"type": maybe_junk(st.sampled_from(["function", "mcp", "code_interpreter"]))}),
    junk,
)
tool_choices = st.one_of(
    st.sampled_from(["auto", "none", "required", "sometimes", ""]),
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": maybe_junk(st.sampled_from(["get_weather", "nope"]))}),
        }
    ),
    junk,
)
tool_call_shapes = st.one_of(
    st.fixed_dictionaries(
        {
            "id": maybe_junk(st.sampled_from(["call_1", ""])),
            "type": maybe_junk(st.just("function")),
            "function": st.fixed_dictionaries(
                {
                    "name": maybe_junk(st.just("get_weather")),
                    "arguments": st.sampled_from(['{"city": "Paris"}', "{no", "[]", "", 5]),
                }
            ),
        }
    ),
    junk,
)

content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe_junk(words)}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "image_url", "audio", "video", "x"]), "text": junk}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {"url": st.sampled_from(["file:///etc/passwd", "data:image/png;base64,AAAA", "data:,x", "", "x"])}
            ),
        }
    ),
    junk,
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": maybe_junk(words)},
        optional={"name": junk},
    ),
    st.fixed_dictionaries(
        {"role": maybe_junk(st.sampled_from(["user", "tool", "developer", "function", "", "USER"]))},
        optional={"content": st.one_of(words, st.lists(content_parts, max_size=3), junk), "tool_call_id": junk},
    ),
    st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": junk}, optional={"content": junk}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "tool_calls": st.lists(tool_call_shapes, max_size=2)},
        optional={"content": st.one_of(st.none(), words)},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": maybe_junk(words)}, optional={"tool_call_id": maybe_junk(texts)}
    ),
    junk,
)
messages = st.one_of(
    st.lists(message, min_size=1, max_size=4),
    st.just([]),
    st.just([{"role": "user", "content": "hi"}] * 300),  # many small messages
    st.just([{"role": "user", "content": "word " * 3000}]),  # longer than the context
    st.just([{"role": "user", "content": "token " * 300}]),  # long enough to be prefilled on prefill
    junk,
)
stops = st.one_of(words, st.lists(words, max_size=5), st.just([""] * 3), junk)
COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("local:tiny-llama"), texts, junk),
    "max_tokens": maybe_junk(small_ints),
    "max_completion_tokens": maybe_junk(small_ints),
    "temperature": maybe_junk(numbers),
    "top_p": maybe_junk(numbers),
    "top_k": maybe_junk(small_ints),
    "min_p": maybe_junk(numbers),
    "n": maybe_junk(small_ints),
    "stream": maybe_junk(st.booleans()),
    "stream_options": maybe_junk(
        st.fixed_dictionaries({"include_usage": junk}, optional={"continuous_usage_stats": junk})
    ),
    "stop": stops,
    "stop_token_ids": maybe_junk(st.lists(small_ints, max_size=3)),
    "seed": maybe_junk(small_ints),
    "presence_penalty": maybe_junk(numbers),
    "frequency_penalty": maybe_junk(numbers),
    "repetition_penalty": maybe_junk(numbers),
    "logprobs": maybe_junk(st.one_of(st.booleans(), small_ints)),
    "top_logprobs": maybe_junk(small_ints),
    "prompt_logprobs": maybe_junk(small_ints),
    "logit_bias": maybe_junk(st.dictionaries(st.one_of(st.just("1"), texts), numbers, max_size=3)),
    "user": junk,
    "min_tokens": maybe_junk(small_ints),
    "ignore_eos": maybe_junk(st.booleans()),
    "skip_special_tokens": junk,
    "bad_words": maybe_junk(st.lists(words, max_size=2)),
    "allowed_token_ids": maybe_junk(st.lists(small_ints, min_size=1, max_size=3)),
    "truncate_prompt_tokens": maybe_junk(small_ints),
    "priority": maybe_junk(small_ints),
    "return_token_ids": junk,
    "echo": maybe_junk(st.booleans()),
    "response_format": maybe_junk(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["json_object", "json_schema", "text", "x"])}, optional={"json_schema": junk}
        )
    ),
    "structured_outputs": maybe_junk(
        st.one_of(
            st.fixed_dictionaries({"regex": st.sampled_from(["((((", "[a-z]+", "(a*)*b", ""])}),
            st.fixed_dictionaries({"json": junk}),
            st.fixed_dictionaries({"grammar": st.sampled_from(["root ::= ", "junk", ""])}),
            st.fixed_dictionaries({"choice": junk}),
        )
    ),
    "cache_salt": junk,
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": messages,
    "tools": st.one_of(st.lists(tool_defs, max_size=3), junk),
    "tool_choice": tool_choices,
    "parallel_tool_calls": junk,
    "add_generation_prompt": junk,
    "continue_final_message": junk,
    "chat_template_kwargs": junk,
    "documents": junk,
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": st.one_of(
        words,
        st.lists(words, min_size=1, max_size=6),
        st.lists(small_ints, min_size=1, max_size=5),  # token ids, out of vocabulary and negative ones included
        st.lists(st.lists(small_ints, min_size=1, max_size=3), min_size=1, max_size=3),
        st.just(""),
        st.just([]),
        st.just("token " * 3000),
        junk,
    ),
    "best_of": maybe_junk(small_ints),
    "suffix": junk,
    "prompt_embeds": maybe_junk(st.sampled_from(["AAAA", "", "not base64"])),
}
SESSION_FIELDS = {
    "start_policy": st.one_of(
        st.sampled_from(["on_first_chunk", "on_min_length", "on_end_only", "sometimes", ""]),
        st.fixed_dictionaries(
            {"type": maybe_junk(st.sampled_from(["on_first_chunk", "on_min_length", "on_end_only"]))},
            optional={"min_tokens": maybe_junk(small_ints), "x": junk},
        ),
        junk,
    ),
    "min_tokens": maybe_junk(small_ints),
    "limits": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "idle_timeout_s": maybe_junk(numbers),
                "max_payload_bytes": maybe_junk(small_ints),
                "gap_timeout_s": maybe_junk(numbers),
                "answer_timeout_s": maybe_junk(numbers),
                "unknown": junk,
            },
        ),
        junk,
    ),
    "instructions": junk,
}


def near_valid(base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with 1-4 mutations: a known field set to a plausible or junk value, a field deleted, or a junk key."""

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        body = copy.deepcopy(base)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["set", "set", "set", "delete", "extra"]))
            if op == "set":
                key = draw(st.sampled_from(sorted(fields)))
                body[key] = draw(fields[key])
            elif op == "delete" and body:
                del body[draw(st.sampled_from(sorted(body)))]
            else:
                body[draw(texts)] = draw(junk)
        return body

    return build()


CHAT_BASE = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
COMPLETION_BASE = {"prompt": "def hello():", "max_tokens": 4}
chat_bodies = st.one_of(near_valid(CHAT_BASE, CHAT_FIELDS), json_values)
completion_bodies = st.one_of(near_valid(COMPLETION_BASE, COMPLETION_FIELDS), json_values)
session_bodies = st.one_of(
    near_valid({"messages": [], "max_tokens": 4}, {**CHAT_FIELDS, **SESSION_FIELDS}),
    near_valid({"prompt": "", "max_tokens": 4}, {**COMPLETION_FIELDS, **SESSION_FIELDS}),
    json_values,
)
sequence_ids = st.one_of(st.integers(0, 6), st.integers(-3, -1), st.sampled_from(HUGE_INTS), floats, junk)
chunk_bodies = st.one_of(
    st.fixed_dictionaries(
        {"sequence_id": sequence_ids, "payload": maybe_junk(words)},
        optional={
            "modality": maybe_junk(st.sampled_from(["text", "audio", "image"])),
            "end_of_input": maybe_junk(st.booleans()),
            "mode": maybe_junk(st.sampled_from(["append", "replace", "insert"])),
            "offset": maybe_junk(st.one_of(st.integers(-2, 60), st.sampled_from(HUGE_INTS))),
            "role": maybe_junk(st.sampled_from(["user", "tool", "assistant"])),
            "tool_call_id": maybe_junk(st.sampled_from(["call_1", "", "x" * 300])),
            "extra": junk,
        },
    ),
    st.fixed_dictionaries({"sequence_id": sequence_ids, "payload": st.sampled_from(WEIRD_TEXT)}),
    st.fixed_dictionaries({"sequence_id": st.integers(0, 3), "payload": st.just("x" * 1_100_000)}),  # > payload cap
    json_values,
)


# --- 1a. schema-driven REST fuzzing (schemathesis) -------------------------------------------------------
def future_turn(value: Any) -> bool:
    for v in value if isinstance(value, list) else [value]:
        try:
            if int(str(v)) > 0:
                return True
        except ValueError:
            pass
    return False


def schema_case_test(server: str, http: httpx.Client, op: Any, mode: Any, label: str, real_ids: Any) -> Any:
    """The hypothesis test of one operation: a generated case, its session id replaced by a real one (when
    `real_ids` draws one), sent and checked."""

    @settings(**fuzz_settings(30))
    @given(case=op.as_strategy(generation_mode=mode), real=real_ids)
    def fuzz_operation(case: Any, real: str | None) -> None:
        if real is not None:
            case.path_parameters = {**(case.path_parameters or {}), "session_id": real}
            query = case.query if isinstance(case.query, dict) else None
            if query and "turn" in query and future_turn(query["turn"]):
                query["turn"] = 0  # a future turn is waited for (a long poll, up to the idle timeout): past ones only
        if isinstance(case.body, dict):
            cap_generation(case.body)
        sent = {"path": case.path_parameters, "query": case.query, "headers": case.headers, "body": case.body}
        try:
            response = case.call(base_url=server, timeout=TIMEOUT)
        except Exception as e:
            fail("no_response", label=label, sent=sent, why=repr(e))
        headers = {k.lower(): v[0] if isinstance(v, list) else v for k, v in response.headers.items()}
        reply = Reply(response.status_code, headers, response.content.decode("utf-8", "replace"))
        try:
            check_reply(reply, label, sent)
        finally:
            if (sid := created_session_id(reply)) is not None:
                delete_session(http, sid)

    return fuzz_operation


def test_openapi_schema_fuzz(server: str, http: httpx.Client) -> None:
    """Every operation the live OpenAPI schema declares, positive and negative generation; session-id path
    parameters are real session ids half of the time (answered ones for reads, open ones for input, fresh ones
    for DELETE)."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        try:
            operations.append(result.ok())
        except Exception as e:  # an operation schemathesis cannot build cases for is a finding of its own
            record("schema_operation_unusable", why=repr(e))
    labels = sorted(f"{op.method.upper()} {op.path}" for op in operations)
    COUNTS["schema_operations"] = len(operations)
    for required in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"):
        assert required in labels, f"{required} missing from the OpenAPI schema: {labels}"

    answered = []
    for _ in range(2):
        sid = create_session(http)
        r = http.post(f"{SESSIONS}/{sid}/chunks", json={"sequence_id": 0, "payload": "Say hi.", "end_of_input": True})
        assert r.status_code == 202, r.text
        assert http.get(f"{SESSIONS}/{sid}/result").status_code == 200
        answered.append(sid)
    open_ = [create_session(http, limits={"gap_timeout_s": 10}) for _ in range(3)]
    victims = [create_session(http) for _ in range(6)]

    def real_ids(op: Any) -> list[str]:
        if op.method.upper() == "DELETE":
            return victims
        if op.path.endswith(("/chunks", "/finish", "/cancel")):
            return open_
        return answered

    failures = []
    for op in sorted(operations, key=lambda o: (o.path, o.method)):
        label = f"schema {op.method.upper()} {op.path}"
        has_session = "{session_id}" in op.path
        COUNTS[f"schema_operation:{label}"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            choices = st.sampled_from([None, *real_ids(op)]) if has_session else st.just(None)

            fuzz_operation = schema_case_test(server, http, op, mode, label, choices)
            try:
                fuzz_operation()
            except Exception as e:
                if not is_finding(e):  # schemathesis could not generate such cases (e.g. negative ones for /health)
                    record("schema_generation_error", label=label, mode=mode.value, why=repr(e))
                    continue
                failures.append(f"--- {label} ({mode.value}) ---\n{describe_failure(e)}")
    for sid in answered + open_ + victims:
        delete_session(http, sid)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


# --- 1a. hypothesis bodies -----------------------------------------------------------------------------
def test_chat_completion_bodies(http: httpx.Client) -> None:
    @settings(**fuzz_settings(300))
    @given(body=chat_bodies)
    def fuzz(body: Any) -> None:
        post_json(http, "chat body", "/v1/chat/completions", cap_generation(body))

    run_hypothesis(fuzz)


def test_completion_bodies(http: httpx.Client) -> None:
    @settings(**fuzz_settings(200))
    @given(body=completion_bodies)
    def fuzz(body: Any) -> None:
        post_json(http, "completion body", "/v1/completions", cap_generation(body))

    run_hypothesis(fuzz)


RAW_TARGETS = [
    ("/v1/chat/completions", {}),
    ("/v1/completions", {}),
    (SESSIONS, {}),
    (f"{SESSIONS}/nosuchsession/chunks", {}),
    ("/v1/chat/completions", {"x-streaming-input": "true", "content-type": "application/x-ndjson"}),
]


def test_raw_bodies(http: httpx.Client) -> None:
    """Bytes that are not JSON (or barely are): truncated, invalid UTF-8, a BOM, NaN, 100k-deep nesting."""

    @settings(**fuzz_settings(150))
    @given(target=st.sampled_from(RAW_TARGETS), body=raw_bodies, content_type=st.sampled_from([None, "text/plain"]))
    def fuzz(target: tuple[str, dict[str, str]], body: bytes, content_type: str | None) -> None:
        path, headers = target
        headers = {"content-type": content_type or "application/json", **headers}
        label = f"raw {path}{' ndjson' if 'x-streaming-input' in headers else ''}"
        reply = send(http, label, "POST", path, sent=body[:200], content=body, headers=headers)
        try:
            check_reply(reply, label, body[:200])
        finally:
            if (sid := created_session_id(reply)) is not None:
                delete_session(http, sid)

    run_hypothesis(fuzz)


def test_session_create_bodies(http: httpx.Client) -> None:
    @settings(**fuzz_settings(150))
    @given(body=session_bodies)
    def fuzz(body: Any) -> None:
        reply = send(
            http, "session create", "POST", SESSIONS, sent=body, content=json_dumps_lenient(cap_generation(body))
        )
        try:
            check_reply(reply, "session create", body)
        finally:
            if (sid := created_session_id(reply)) is not None:
                delete_session(http, sid)

    run_hypothesis(fuzz)


def test_session_chunk_bodies(http: httpx.Client) -> None:
    """Junk and near-valid chunks (ids out of order, duplicate, negative, huge, floats; bad modes and offsets,
    payloads past the cap) against a real session; the session then still answers GET and DELETE."""

    @settings(**fuzz_settings(100))
    @given(chunks=st.lists(chunk_bodies, min_size=1, max_size=6), finish=st.booleans())
    def fuzz(chunks: list[Any], finish: bool) -> None:
        sid = create_session(http, limits={"gap_timeout_s": 10})
        try:
            for body in chunks:
                post_json(http, "session chunk", f"{SESSIONS}/{sid}/chunks", body)
            if finish:
                check_reply(send(http, "session finish", "POST", f"{SESSIONS}/{sid}/finish"), "session finish", chunks)
            check_reply(send(http, "session info", "GET", f"{SESSIONS}/{sid}"), "session info", chunks)
            check_reply(
                send(http, "session result nowait", "GET", f"{SESSIONS}/{sid}/result?wait=false"), "result", chunks
            )
        finally:
            reply = send(http, "session delete", "DELETE", f"{SESSIONS}/{sid}")
            check_reply(reply, "session delete", chunks)

    run_hypothesis(fuzz)


ORDER_TEXT = "The crawler found page one. Then page two arrived, and a question: what came first? " * 2


def test_session_chunks_out_of_order_and_duplicate(http: httpx.Client) -> None:
    """Model-based: chunks sent in any order, with duplicates (also after the end of input), apply in
    sequence order exactly once; each reply's applied/pending/duplicate is what the model says; the answer
    equals the whole request's."""
    whole_answers: dict[str, str] = {}

    @settings(**fuzz_settings(25))
    @given(data=st.data())
    def fuzz(data: Any) -> None:
        n = data.draw(st.integers(2, 6), label="chunks")
        cuts = sorted(data.draw(st.sets(st.integers(1, len(ORDER_TEXT) - 1), min_size=n - 1, max_size=n - 1)))
        pieces = [ORDER_TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(ORDER_TEXT)], strict=True)]
        order = list(data.draw(st.permutations(range(n)), label="order"))
        for dup in data.draw(st.lists(st.integers(0, n - 1), max_size=n), label="duplicates"):
            order.insert(data.draw(st.integers(order.index(dup) + 1, len(order))), dup)
        sid = create_session(http, temperature=0, limits={"gap_timeout_s": 10})
        try:
            next_seq, pending = 0, set()
            for seq in order:
                body = {"sequence_id": seq, "payload": pieces[seq], "end_of_input": seq == n - 1}
                reply = post_json(http, "ordered chunk", f"{SESSIONS}/{sid}/chunks", body)
                got = reply.json() if reply.status == 202 else None
                if seq < next_seq or seq in pending:
                    expected = {"duplicate": True, "applied": []}
                else:
                    pending.add(seq)
                    applied = []
                    while next_seq in pending:
                        pending.discard(next_seq)
                        applied.append(next_seq)
                        next_seq += 1
                    expected = {"duplicate": False, "applied": applied, "pending": sorted(pending)}
                if got is None or any(got.get(k) != v for k, v in expected.items()):
                    fail(
                        "chunk_order_mismatch",
                        order=order,
                        seq=seq,
                        expected=expected,
                        status=reply.status,
                        got={k: got.get(k) for k in expected} if isinstance(got, dict) else reply.text,
                    )
            result = http.get(f"{SESSIONS}/{sid}/result", timeout=60)
            check_reply(Reply.of(result), "ordered result", order)
            if "text" not in whole_answers:
                whole = {"messages": [{"role": "user", "content": ORDER_TEXT}], "max_tokens": 4, "temperature": 0}
                whole_answers["text"] = http.post("/v1/chat/completions", json=whole).json()["choices"][0]["message"][
                    "content"
                ]
            if result.json()["answer"]["text"] != whole_answers["text"]:
                fail("chunk_order_answer_differs", order=order, got=result.json()["answer"], expected=whole_answers)
        finally:
            delete_session(http, sid)

    run_hypothesis(fuzz)


ndjson_lines = st.one_of(
    st.fixed_dictionaries({"payload": maybe_junk(words)}, optional={"end_of_input": junk}),
    st.fixed_dictionaries({"delta": maybe_junk(words)}),
    st.fixed_dictionaries({"end_of_input": maybe_junk(st.booleans())}),
    json_values,
)


def test_ndjson_bodies(http: httpx.Client) -> None:
    """`X-Streaming-Input: true` bodies: a near-valid (or junk) first line, junk later lines, garbage lines."""

    @settings(**fuzz_settings(120))
    @given(
        first=chat_bodies,
        lines=st.lists(st.one_of(ndjson_lines.map(json.dumps), st.sampled_from(["{", "]", "nul", "\x00"])), max_size=4),
    )
    def fuzz(first: Any, lines: list[str]) -> None:
        body = "\n".join([json.dumps(cap_generation(first)), *lines]) + "\n"
        headers = {"x-streaming-input": "true", "content-type": "application/x-ndjson"}
        reply = send(http, "ndjson", "POST", "/v1/chat/completions", sent=body, content=body.encode(), headers=headers)
        check_reply(reply, "ndjson", body)

    run_hypothesis(fuzz)


def test_protocol_edges(http: httpx.Client) -> None:
    """Wrong methods, unknown paths, bad query parameters, odd content types: still OpenAI error JSON."""
    sid = create_session(http)
    cases = [
        ("GET", "/v1/chat/completions", {}),
        ("PUT", "/v1/completions", {}),
        ("DELETE", "/v1/models", {}),
        ("GET", "/v1/nope", {}),
        ("GET", f"{SESSIONS}/{sid}/result?wait=maybe", {}),
        ("GET", f"{SESSIONS}/{sid}/events?turn=abc", {}),
        ("GET", f"{SESSIONS}/{sid}/result?turn=-7", {}),
        ("GET", f"{SESSIONS}/{sid}/events?turn=-7", {}),
        ("POST", f"{SESSIONS}/{sid}/chunks", {"content": b'{"sequence_id": 0, "payload": "x"}', "headers": {}}),
        (
            "POST",
            "/v1/chat/completions",
            {"content": b"messages=hi", "headers": {"content-type": "application/x-www-form-urlencoded"}},
        ),
        ("POST", "/v1/chat/completions", {"json": CHAT_BASE, "headers": {"x-streaming-input": "TRUE"}}),
    ]
    failures = []
    for method, path, kwargs in cases:
        label = f"edge {method} {path.replace(sid, '{sid}')}"
        try:
            check_reply(send(http, label, method, path, sent=kwargs.get("content"), **kwargs), label, kwargs)
        except AssertionError as e:
            failures.append(f"{label}: {e}")
    delete_session(http, sid)
    assert not failures, "\n".join(failures)


# --- 1b. the Realtime WebSocket --------------------------------------------------------------------------
def ws_url(server: str) -> str:
    return server.replace("http://", "ws://") + "/v1/realtime"


class WSClosed(Exception):
    pass


@dataclass
class Step:
    """One fuzz step: frames sent back to back, then what must follow (`error`: an error event, with
    `event_id` when given; `ok`: no error, and `acks` among the events; `any`: only that the socket lives)."""

    name: str
    frames: list[str | bytes]
    expect: str = "error"
    event_id: Any = None
    acks: tuple[str, ...] = ()
    response: bool = False  # a response starts: wait for its response.done
    check: Any = None  # extra check(seen) for compound steps

    def __repr__(self) -> str:  # what hypothesis prints of a falsifying example: short, huge frames too
        frames = [shorten(f if isinstance(f, str) else repr(f), 160) for f in self.frames]
        return f"Step({self.name!r}, frames={frames}, expect={self.expect!r}, event_id={self.event_id!r})"


@dataclass
class RealtimeFuzz:
    ws: Any
    buffer: str = ""
    # Whether `buffer` is known: conversation.item.create with text in the buffer leaves it open to two readings
    # (OpenAI: the buffer is untouched; the owner replica: it is committed first), so the next buffer-dependent
    # step waits for a clear (reported separately, see the module's report).
    buffer_known: bool = True
    has_input: bool = False
    pings: int = 0
    history: list[str] = field(default_factory=list)
    active: int = 0  # responses created and not done

    async def recv(self, timeout: float) -> dict[str, Any]:
        try:
            raw = await asyncio.wait_for(self.ws.recv(), timeout)
        except websockets.ConnectionClosed as e:
            why = f"closed: code={e.rcvd.code if e.rcvd else None} reason={e.rcvd.reason if e.rcvd else ''}"
            raise WSClosed(why) from None
        event = json.loads(raw)
        COUNTS["ws_events_received"] += 1
        if event.get("type") == "response.created":
            self.active += 1
        elif event.get("type") == "response.done":
            self.active -= 1
        return event

    async def exchange(self, frames: list[str | bytes]) -> list[dict[str, Any]]:
        """Send `frames`, then a ping (an unknown event, answered by an error with its event_id): every event
        the frames caused arrives before the ping's answer."""
        self.pings += 1
        ping = f"ping_{self.pings}"
        try:
            for frame in frames:
                await self.ws.send(frame)
                COUNTS["ws_frames_sent"] += 1
            await self.ws.send(json.dumps({"type": "rtpd.fuzz.ping", "event_id": ping}))
        except websockets.ConnectionClosed as e:
            raise WSClosed(f"closed while sending: {e!r}") from None
        seen = []
        while True:
            event = await self.recv(TIMEOUT)
            if event.get("type") == "error" and (event.get("error") or {}).get("event_id") == ping:
                return seen
            seen.append(event)

    async def until_done(self, seen: list[dict[str, Any]], timeout: float = 60) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        for event in seen:
            if event.get("type") == "response.done":
                return event
        while time.monotonic() < deadline:
            event = await self.recv(max(0.1, deadline - time.monotonic()))
            seen.append(event)
            if event.get("type") == "response.done":
                return event
        return None


def ev(type_: str, event_id: Any = None, **fields: Any) -> str:
    body: dict[str, Any] = {"type": type_, **fields}
    if event_id is not None:
        body["event_id"] = event_id
    return json.dumps(body, allow_nan=True)


def ev_ordered(type_: str, event_id: Any, leading: bool, **fields: Any) -> str:
    """An event with `event_id` right after `type` (leading) or as its last member."""
    if event_id is None:
        return ev(type_, **fields)
    if leading:
        return json.dumps({"type": type_, "event_id": event_id, **fields})
    return json.dumps({"type": type_, **fields, "event_id": event_id})


USER_ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say something."}]}
HUGE = 1_200_000  # > 1 MiB: past limits.max_frame_bytes and the session payload cap


@st.composite
def valid_step(draw: Any, conv: RealtimeFuzz) -> Step:
    kinds = ["append", "clear", "item", "update", "response"]
    if conv.buffer_known:
        kinds += ["replace"] + (["commit"] if conv.buffer else [])
    kind = draw(st.sampled_from(kinds))
    eid = f"evt_{kind}_{draw(st.integers(0, 999))}"
    text = draw(words)
    if kind == "append":
        return Step("append", [ev("input_text_buffer.append", eid, delta=text)], "ok", eid)
    if kind == "replace":
        offset = draw(st.integers(0, len(conv.buffer)))
        return Step("replace", [ev("input_text_buffer.replace", eid, text=text, offset=offset)], "ok", eid)
    if kind == "clear":
        return Step("clear", [ev("input_text_buffer.clear", eid)], "ok", eid, ("input_text_buffer.cleared",))
    if kind == "commit":
        return Step("commit", [ev("input_text_buffer.commit", eid)], "ok", eid, ("conversation.item.created",))
    if kind == "item":
        role = draw(st.sampled_from(["user", "user", "system", "assistant"]))
        item = {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}
        return Step(
            f"item:{role}", [ev("conversation.item.create", eid, item=item)], "ok", eid, ("conversation.item.created",)
        )
    if kind == "update":
        session = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "instructions": words,
                    "temperature": st.floats(0, 1.5),
                    "max_output_tokens": st.one_of(st.integers(1, MAX_GEN_TOKENS), st.just("inf")),
                },
            )
        )
        return Step("update", [ev("session.update", eid, session=session)], "ok", eid, ("session.updated",))
    tokens = draw(st.integers(1, 4))
    frame = ev("response.create", eid, response={"max_output_tokens": tokens})
    # An empty conversation has nothing to answer: whatever the server does then, the socket must live.
    usable = conv.has_input or bool(conv.buffer)
    return Step("response", [frame], "ok" if usable else "any", eid, ("response.created",), response=True)


BAD_JSON_FRAMES = ["{not json", "", " ", "{", "[]", "null", "0", '"x"', "true", "[{}]", '{"type": null}', "[" * 100_000]


@st.composite
def bad_step(draw: Any, family: str, conv: RealtimeFuzz, huge_left: list[int]) -> Step:
    eid = draw(st.one_of(st.just(None), st.builds(lambda i: f"evt_bad_{i}", st.integers(0, 999))))
    if family == "audio":  # (tests/integration/test_voice.py runs it on the app with a speech role)
        return bad_audio_step(draw, eid)
    if family == "json":
        choice = draw(st.integers(0, 4))
        if choice == 0:
            return Step("malformed", [draw(st.sampled_from(BAD_JSON_FRAMES))])
        if choice == 1:
            return Step("random text", [draw(st.text(max_size=30).filter(lambda t: not t.startswith("{")))])
        if choice == 2:
            eid = eid or "evt_bad_type"
            return Step(
                "type not a string",
                [json.dumps({"type": draw(junk.filter(lambda v: not isinstance(v, str))), "event_id": eid})],
                event_id=eid,
            )
        if choice == 3:
            return Step(
                "no type",
                [json.dumps({"event_id": eid or "evt_no_type", "session": {}})],
                event_id=eid or "evt_no_type",
            )
        nan = ev("session.update", eid, session={"temperature": draw(st.sampled_from([float("nan"), float("inf")]))})
        return Step("NaN temperature", [nan], event_id=eid)
    if family == "types":
        type_ = draw(
            st.one_of(
                st.text(max_size=30),
                st.sampled_from(
                    [
                        "input_audio_buffer.append",
                        "conversation.item.truncate",
                        "conversation.item.delete",
                        "conversation.item.retrieve",
                        "output_audio_buffer.clear",
                        "transcription_session.update",
                        "Response.Create",
                        " response.create",
                        "response.create\n",
                        "session.updated",
                        "error",
                    ]
                ),
            ).filter(
                lambda t: (
                    t not in ("session.update", "conversation.item.create", "response.create", "response.cancel")
                    and not t.startswith("input_text_buffer.")
                )
            )
        )
        return Step(f"unknown type {type_!r}", [ev(type_, eid)], event_id=eid)
    if family == "session":
        session = draw(
            st.one_of(
                st.sampled_from([[], [1], "x", 5, True]),
                st.fixed_dictionaries({"max_output_tokens": st.sampled_from(["abc", -1, 0, 1.5, 2**70, [], {}, True])}),
                st.fixed_dictionaries({"temperature": st.sampled_from(["abc", -1.0, -100, [], {}, "0.5x"])}),
                st.fixed_dictionaries({"instructions": st.sampled_from([5, [], {"a": 1}, True, ["x"]])}),
                st.fixed_dictionaries({"output_modalities": st.sampled_from(["text", [1], [[]], ["audio"], {}, 5])}),
                st.fixed_dictionaries({"modalities": st.sampled_from([["audio", "text"], [None], "text"])}),
                st.fixed_dictionaries(
                    {
                        "tools": st.sampled_from(
                            [
                                "f",
                                [5],
                                [{"name": "a b"}],
                                [{"name": "f", "parameters": {"type": 5}}],
                                [{"type": "mcp", "name": "f"}],
                            ]
                        )
                    }
                ),
                st.fixed_dictionaries(
                    {
                        "tool_choice": st.sampled_from(
                            ["sometimes", "required", {"type": "function", "name": "nope"}, {"name": 5}, 5]
                        )
                    }
                ),
            )
        )
        return Step(
            f"session.update {shorten(session, 60)}", [ev("session.update", eid, session=session)], event_id=eid
        )
    if family == "items":
        item = draw(
            st.one_of(
                st.sampled_from([[], "x", 5, None, True, {}]),
                st.fixed_dictionaries(
                    {"type": st.just("message"), "role": st.sampled_from([5, None, "robot", "", "tool"])}
                ),
                st.fixed_dictionaries(
                    {
                        "type": st.just("message"),
                        "role": st.just("user"),
                        "content": st.sampled_from(
                            ["a string", [1, 2], {"a": 1}, [{"type": "input_text", "text": 5}], [[]], [None], 7]
                        ),
                    }
                ),
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["function_call", "function_call_output", 5]), "role": st.just("user")}
                ),
                st.fixed_dictionaries(
                    {
                        "type": st.just("function_call_output"),
                        "call_id": st.sampled_from(["call_unknown", 5, ""]),
                        "output": st.sampled_from(["21C", 5]),
                    }
                ),
                st.fixed_dictionaries(
                    {
                        "type": st.just("function_call"),
                        "call_id": st.sampled_from(["c", 5]),
                        "name": st.sampled_from(["f", None]),
                        "arguments": st.sampled_from(["{no", 5]),
                    }
                ),
            )
        )
        frame = (
            ev("conversation.item.create", eid, item=item) if item is not None else ev("conversation.item.create", eid)
        )
        return Step(f"item {shorten(item, 60)}", [frame], event_id=eid)
    if family == "buffer":
        choice = draw(st.integers(0, 3))
        if choice == 0:
            delta = draw(st.sampled_from([5, None, [], {}, True, ["x"]]))
            return Step(f"append delta={delta!r}", [ev("input_text_buffer.append", eid, delta=delta)], event_id=eid)
        if choice == 1:
            n = len(conv.buffer)
            offset = draw(st.sampled_from([n + 1, n + 1000, -1, "0", 1.5, True, 2**70, None, []]))
            return Step(
                f"replace offset={offset!r}",
                [ev("input_text_buffer.replace", eid, text="x", offset=offset)],
                event_id=eid,
            )
        if choice == 2:
            text = draw(st.sampled_from([5, None, [], {"a": 1}]))
            return Step(
                f"replace text={text!r}", [ev("input_text_buffer.replace", eid, text=text, offset=0)], event_id=eid
            )
        clear_id = f"clear_{draw(st.integers(0, 999))}"

        def commit_check(seen: list[dict[str, Any]], eid: Any = eid) -> None:
            errors = [e for e in seen if e.get("type") == "error"]
            if not errors:
                fail("ws_bad_event_accepted", step="commit with an empty buffer", seen=[e["type"] for e in seen])

        conv.buffer, conv.buffer_known = "", True
        frames = [ev("input_text_buffer.clear", clear_id), ev("input_text_buffer.commit", eid)]
        return Step("commit after clear (empty)", frames, event_id=eid, check=commit_check)
    if family == "responses":
        choice = draw(st.integers(0, 3))
        if choice == 0:
            return Step("cancel without a response", [ev("response.cancel", eid)], event_id=eid)
        if choice == 1:
            response = draw(
                st.sampled_from(
                    [
                        "x",
                        [1],
                        5,
                        {"max_output_tokens": "abc"},
                        {"max_output_tokens": -1},
                        {"max_output_tokens": 0},
                        {"max_output_tokens": 1.5},
                        {"temperature": "hot"},
                        {"temperature": -1},
                        {"instructions": 5},
                    ]
                )
            )
            frame = ev("response.create", eid, response=response)
            return Step(f"response.create response={response!r}", [frame], event_id=eid)
        if not (conv.has_input or conv.buffer):  # needs something to answer
            conv.has_input = True
            item_id = f"item_{draw(st.integers(0, 999))}"
            frames: list[str | bytes] = [ev("conversation.item.create", item_id, item=USER_ITEM)]
        else:
            frames = []
        second = eid or "evt_second_create"
        conv.buffer, conv.buffer_known = "", True  # response.create commits the buffer
        if choice == 2:
            frames += [
                ev("response.create", f"first_{second}", response={"max_output_tokens": 4}),
                ev("response.create", second, response={"max_output_tokens": 4}),
            ]
            return Step("two response.create", frames, event_id=second, response=True)

        def cancel_check(seen: list[dict[str, Any]]) -> None:
            done = [e for e in seen if e.get("type") == "response.done"]
            errors = [e for e in seen if e.get("type") == "error"]
            if errors or not done or done[0]["response"].get("status") != "cancelled":
                status = done[0]["response"].get("status") if done else None
                fail("ws_cancel_failed", errors=errors, status=status)

        frames += [
            ev("response.create", f"to_cancel_{second}", response={"max_output_tokens": 200}),
            ev("response.cancel", second),
        ]
        return Step("response.create then cancel", frames, "any", second, response=True, check=cancel_check)
    # family == "frames": binary and huge frames
    choice = draw(st.integers(0, 4 if huge_left[0] > 0 else 1))
    if choice == 0:
        return Step("binary frame", [draw(st.binary(min_size=1, max_size=32))])
    if choice == 1:
        return Step("binary JSON frame", [ev("input_text_buffer.append", eid, delta="hi").encode()], event_id=None)
    huge_left[0] -= 1
    if choice == 2:
        return Step("huge non-JSON text frame", ["x" * HUGE])
    # A client may put `event_id` anywhere in the object: first, or after the huge field.
    leading = draw(st.booleans())
    where = "event_id first" if leading else "event_id last"
    if choice == 3:
        frame = ev_ordered("input_text_buffer.append", eid, leading, delta="y" * HUGE)
        return Step(f"huge append ({where})", [frame], event_id=eid)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "z" * HUGE}]}
    return Step(f"huge item ({where})", [ev_ordered("conversation.item.create", eid, leading, item=item)], event_id=eid)


def bad_audio_step(draw: Any, eid: Any) -> Step:
    """A bad `input_audio_buffer.*` event, audio setting or truncate: refused whole, naming the field."""
    choice = draw(st.integers(0, 5))
    if choice == 0:
        audio = draw(
            st.one_of(
                st.sampled_from([5, None, [], {}, True, "not base64!", "AAA", "\u00e9\u00e9"]),
                st.binary(min_size=1, max_size=9)
                .filter(lambda b: len(b) % 2 == 1)
                .map(lambda b: base64.b64encode(b).decode()),
            )
        )
        return Step(
            f"append audio={shorten(audio, 40)!r}", [ev("input_audio_buffer.append", eid, audio=audio)], event_id=eid
        )
    if choice == 1:
        fmt = draw(
            st.sampled_from(
                [
                    {"type": "audio/ogg"},
                    {"type": "audio/pcm", "rate": 11025},
                    {"type": "audio/pcm", "rate": "24000"},
                    "mp3",
                    5,
                    {"rate": 24000},
                ]
            )
        )
        session = {"audio": {"input": {"format": fmt}}} if not isinstance(fmt, str) else {"input_audio_format": fmt}
        return Step(f"format {fmt!r}", [ev("session.update", eid, session=session)], event_id=eid)
    if choice == 2:
        detection = draw(
            st.sampled_from(
                [
                    {"type": "magic_vad"},
                    {"type": "server_vad", "threshold": 1.5},
                    {"type": "server_vad", "threshold": "high"},
                    {"type": "server_vad", "silence_duration_ms": -1},
                    {"type": "server_vad", "prefix_padding_ms": 10**9},
                    {"type": "server_vad", "create_response": "yes"},
                    {"type": "server_vad", "idle_timeout_ms": 5},
                    {"type": "semantic_vad", "eagerness": "very"},
                    "server_vad",
                ]
            )
        )
        session = draw(
            st.sampled_from([{"turn_detection": detection}, {"audio": {"input": {"turn_detection": detection}}}])
        )
        return Step(f"turn_detection {detection!r}", [ev("session.update", eid, session=session)], event_id=eid)
    if choice == 3:
        transcription = draw(st.sampled_from([{"model": "nope"}, {"language": 5}, {"prompt": ["x"]}, "whisper-1"]))
        session = {"input_audio_transcription": transcription}
        return Step(f"transcription {transcription!r}", [ev("session.update", eid, session=session)], event_id=eid)
    if choice == 4:
        return Step("commit an empty audio buffer", [ev("input_audio_buffer.commit", eid)], event_id=eid)
    truncate = draw(
        st.sampled_from([{"item_id": "item_unknown", "audio_end_ms": 5}, {"item_id": 5}, {"audio_end_ms": -1}])
    )
    return Step(f"truncate {truncate!r}", [ev("conversation.item.truncate", eid, **truncate)], event_id=eid)


def check_step(step: Step, seen: list[dict[str, Any]], conv: RealtimeFuzz) -> None:
    errors = [e for e in seen if e.get("type") == "error"]
    for e in errors:
        err = e.get("error")
        if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
            fail("ws_error_event_shape", step=step.name, event=e, history=conv.history)
    if step.check is not None:
        step.check(seen)
    if step.expect == "error":
        if not errors:
            fail(
                "ws_bad_event_accepted",
                step=step.name,
                frames=step.frames,
                seen=[e.get("type") for e in seen],
                history=conv.history,
            )
        if isinstance(step.event_id, str) and not any(e["error"].get("event_id") == step.event_id for e in errors):
            fail("ws_error_without_event_id", step=step.name, frames=step.frames, errors=errors, history=conv.history)
    elif step.expect == "ok":
        if errors:
            fail("ws_valid_event_refused", step=step.name, frames=step.frames, errors=errors, history=conv.history)
        types = {e.get("type") for e in seen}
        if missing := [a for a in step.acks if a not in types]:
            fail("ws_valid_event_unanswered", step=step.name, missing=missing, seen=sorted(types), history=conv.history)


def apply_step(step: Step, conv: RealtimeFuzz) -> None:
    """The client's model of the session after a step the server accepted."""
    frame = step.frames[-1]
    if step.expect != "ok" or not isinstance(frame, str):
        return
    event = json.loads(frame)
    if event["type"] == "input_text_buffer.append":
        conv.buffer += event["delta"]
    elif event["type"] == "input_text_buffer.replace":
        conv.buffer = conv.buffer[: event["offset"]] + event["text"]
    elif event["type"] == "input_text_buffer.clear":
        conv.buffer, conv.buffer_known = "", True
    elif event["type"] in ("input_text_buffer.commit", "response.create"):
        conv.has_input = conv.has_input or bool(conv.buffer)
        conv.buffer, conv.buffer_known = "", True
    elif event["type"] == "conversation.item.create":
        conv.has_input = conv.has_input or event["item"]["role"] == "user"
        if conv.buffer:
            conv.buffer_known = False


async def realtime_episode(server: str, family: str, data: Any) -> None:
    async with websockets.connect(ws_url(server), max_size=None, open_timeout=TIMEOUT, close_timeout=2) as ws:
        conv = RealtimeFuzz(ws)
        created = await conv.recv(TIMEOUT)
        assert created.get("type") == "session.created", created
        huge_left = [2]
        steps = data.draw(st.integers(1, 16), label="steps")
        for _ in range(steps):
            bad = data.draw(st.booleans(), label="bad")
            step = data.draw(bad_step(family, conv, huge_left) if bad else valid_step(conv), label="step")
            conv.history.append(step.name)
            COUNTS[f"case:ws {family}:{'bad' if bad else 'valid'}"] += 1
            try:
                if conv.active > 0:
                    await conv.until_done([])
                seen = await conv.exchange(step.frames)
                errors = [e for e in seen if e.get("type") == "error"]
                refused = step.expect == "any" and step.check is None and errors
                if step.response and not refused:
                    if await conv.until_done(seen) is None and step.expect == "ok":
                        fail("ws_response_never_done", step=step.name, history=conv.history)
                elif any(isinstance(f, str) and '"response.create"' in f for f in step.frames) and not errors:
                    await conv.until_done(seen, timeout=20)  # a bad response.create that started a response anyway
            except WSClosed as e:
                fail(
                    "ws_connection_closed",
                    step=step.name,
                    frames=[shorten(f, 120) for f in step.frames],
                    why=str(e),
                    history=conv.history,
                )
            check_step(step, seen, conv)
            apply_step(step, conv)
        # At the end, a valid conversation still works.
        try:
            if conv.active > 0:
                await conv.until_done([])
            # Greedy: a fuzzed temperature (up to 1.5) can sample only byte fragments and special tokens, which
            # detokenize to no text at all; the greedy answer of the random model is text.
            seen = await conv.exchange([ev("session.update", "final_update", session={"temperature": 0})])
            seen += await conv.exchange([ev("conversation.item.create", "final_item", item=USER_ITEM)])
            seen += await conv.exchange([ev("response.create", "final_response", response={"max_output_tokens": 8})])
            done = await conv.until_done(seen)
        except WSClosed as e:
            fail("ws_connection_closed", step="final conversation", why=str(e), history=conv.history)
        errors = [e for e in seen if e.get("type") == "error"]
        text = "".join(e.get("delta", "") for e in seen if e.get("type") == "response.output_text.delta")
        status = done["response"].get("status") if done else None
        # (the random local model may end at once: "completed" with no text; 8 greedy tokens of no text is a bug)
        if errors or status not in ("completed", "incomplete") or (status == "incomplete" and not text):
            fail("ws_final_conversation_failed", errors=errors, status=status, text=text, history=conv.history)
        COUNTS["ws_final_conversations"] += 1


@pytest.mark.parametrize("family", ["json", "types", "session", "items", "buffer", "responses", "frames"])
def test_realtime_fuzz(server: str, family: str) -> None:
    """Bad events of one family interleaved with valid ones, each answered before the next is sent; after
    each bad event the socket is open and answered with an `error` (with the event's `event_id`); at the end
    a valid conversation gets a response.done with text."""

    @settings(**fuzz_settings(12))
    @given(data=st.data())
    def fuzz(data: Any) -> None:
        asyncio.run(realtime_episode(server, family, data))

    run_hypothesis(fuzz)


def test_internal_fields_from_clients(http: httpx.Client) -> None:
    """Fields the router and engines use among themselves, sent by a client: `kv_transfer_params` (a NIXL read
    from wherever the client says), `request_id` (collisions with other requests and sessions),
    `vllm_xargs`, a client chat template. Refused or ignored, never a 5xx; the engines survive."""
    fields = {
        "kv_transfer_params": st.one_of(
            junk,
            st.fixed_dictionaries(
                {
                    "do_remote_prefill": st.just(True),
                    "do_remote_decode": junk,
                    "remote_block_ids": st.one_of(st.just([0, 1, 2]), junk),
                    "remote_engine_id": st.one_of(st.just("nope"), junk),
                    "remote_host": st.one_of(st.just("127.0.0.1"), junk),
                    "remote_port": st.one_of(st.just(1), junk),
                    "remote_request_id": junk,
                }
            ),
        ),
        "request_id": st.one_of(st.just("dup-request-id"), st.just(""), texts, junk),
        "vllm_xargs": junk,
        "chat_template": st.one_of(st.just("{{ raise_exception('boom') }}"), st.just("{% for %}"), junk),
    }

    @settings(**fuzz_settings(60))
    @given(body=near_valid(CHAT_BASE, fields), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def fuzz(body: dict[str, Any], path: str) -> None:
        if path == "/v1/completions":
            body = {**{k: v for k, v in body.items() if k != "messages"}, "prompt": "def hello():"}
        post_json(http, f"internal fields {path}", path, cap_generation(body))

    run_hypothesis(fuzz)


# --- afterwards ----------------------------------------------------------------------------------------
def test_healthy_after_fuzzing(server: str, http: httpx.Client, baseline_sessions: int) -> None:
    """Last: /health is 200, a normal chat completion works, both engines go idle and every session the
    fuzzers opened is gone (a NIXL hand-off nobody reads is freed after its lease: up to 60 s)."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={**CHAT_BASE, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    deadline = time.time() + 60
    while (open_now := engine_stats("prefill")["sessions_open"]) > baseline_sessions and time.time() < deadline:
        time.sleep(1)
    assert open_now <= baseline_sessions, f"{open_now - baseline_sessions} sessions left open by the fuzzers"
    wait_idle("decode", timeout=60)
    wait_idle("prefill", timeout=60)
