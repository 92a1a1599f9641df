"""The realtime client events' models (router/realtime/events.py): the GA and beta shapes, what is ignored,
and the `InvalidEvent` each wrong shape raises."""

from __future__ import annotations

from typing import Any

import pytest

from router.realtime.events import (
    EVENTS,
    BufferAppend,
    BufferReplace,
    ConversationItemCreate,
    InvalidEvent,
    ResponseCreate,
    SessionUpdate,
    decode,
    event_id_of,
    parse,
)


def test_every_client_event_type_has_a_model() -> None:
    assert set(EVENTS) == {
        "session.update",
        "conversation.item.create",
        "input_text_buffer.append",
        "input_text_buffer.replace",
        "input_text_buffer.commit",
        "input_text_buffer.clear",
        "response.create",
        "response.cancel",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "conversation.item.truncate",
    }
    for type_, model in EVENTS.items():
        required = (
            "session.update",
            "conversation.item.create",
            "input_text_buffer.append",
            "input_text_buffer.replace",
            "input_audio_buffer.append",
            "conversation.item.truncate",
        )
        if type_ not in required:
            assert isinstance(parse({"type": type_}), model)  # everything else is optional


def test_session_update_ga_and_beta_shapes_and_ignored_fields() -> None:
    ga = parse(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "model": "m",
                "output_modalities": ["text"],
                "max_output_tokens": "inf",
                "temperature": 1,
                "instructions": "be brief",
                "audio": {"output": {"voice": "alloy"}},
                "tools": [],
            },
        }
    )
    assert isinstance(ga, SessionUpdate) and ga.session is not None
    assert ga.session.given() == {
        "instructions": "be brief",
        "max_output_tokens": "inf",
        "temperature": 1.0,
        "tools": [],
    }
    assert ga.session.output_modalities == ["text"]
    beta = parse({"type": "session.update", "session": {"modalities": ["text"], "max_response_output_tokens": 9}})
    assert isinstance(beta, SessionUpdate) and beta.session is not None
    assert beta.session.output_modalities == ["text"] and beta.session.given() == {"max_output_tokens": 9}
    for missing in ({"type": "session.update"}, {"type": "session.update", "session": None}):
        with pytest.raises(InvalidEvent) as refused:
            parse(missing)
        assert refused.value.param == "session"


def test_buffer_events_take_delta_or_text() -> None:
    assert isinstance(append := parse({"type": "input_text_buffer.append", "text": "a"}), BufferAppend)
    assert append.delta == "a"
    assert parse({"type": "input_text_buffer.append", "delta": "b", "text": "c"}).delta == "b"  # type: ignore[attr-defined]
    replace = parse({"type": "input_text_buffer.replace", "delta": "d", "offset": 3})
    assert isinstance(replace, BufferReplace) and (replace.text, replace.offset) == ("d", 3)
    assert parse({"type": "input_text_buffer.replace", "text": ""}).offset == 0  # type: ignore[attr-defined]


def test_item_text_comes_from_text_parts_and_parts_are_echoed() -> None:
    content = [
        {"type": "input_text", "text": "a"},
        {"type": "text", "text": "b"},
        {"type": "output_text", "text": "c"},
        {"type": "input_audio", "audio": "AAAA"},
        {"type": "input_text"},
    ]
    event = parse({"type": "conversation.item.create", "item": {"role": "assistant", "content": content}})
    assert isinstance(event, ConversationItemCreate)
    assert event.item.type == "message" and event.item.text == "abc"
    assert event.item.parts == content
    empty = parse({"type": "conversation.item.create", "item": {"role": "user", "content": None}})
    assert empty.item.text == "" and empty.item.parts == []  # type: ignore[attr-defined]


def test_response_create_overrides() -> None:
    event = parse({"type": "response.create", "response": {"max_output_tokens": 8, "conversation": "none"}})
    assert isinstance(event, ResponseCreate) and event.response is not None
    assert event.response.given() == {"max_output_tokens": 8}


@pytest.mark.parametrize(
    ("event", "param"),
    [
        ({"type": "session.update", "event_id": 3}, "event_id"),
        ({"type": "session.update", "session": {"temperature": float("nan")}}, "session.temperature"),
        ({"type": "session.update", "session": {"modalities": [1]}}, "session.modalities[0]"),
        ({"type": "conversation.item.create", "item": {"role": "user", "content": [{"text": "x"}]}}, None),
    ],
)
def test_invalid_events_name_the_field(event: dict[str, Any], param: str | None) -> None:
    with pytest.raises(InvalidEvent) as refused:
        parse(event)
    assert refused.value.code == "invalid_event"
    assert refused.value.param == (param or "item.content[0].type")
    assert refused.value.message.startswith(f"invalid {event['type']}: ")


def test_unknown_types_and_frames_that_are_not_events() -> None:
    with pytest.raises(InvalidEvent) as unknown:
        parse({"type": "response.function_call_arguments.delta"})
    assert (unknown.value.code, unknown.value.param) == ("unknown_event", "type")
    for frame in ("nope", "[]", "{}", '{"type": null}', "[" * 50_000):
        with pytest.raises(InvalidEvent) as refused:
            parse(decode(frame))
        assert refused.value.code == "invalid_json"
    assert decode('{"type": "x", "event_id": "e"}') == {"type": "x", "event_id": "e"}


def test_event_id_of_takes_strings_only() -> None:
    assert event_id_of({"event_id": "e1"}) == "e1"
    assert event_id_of({"event_id": 1}) is None and event_id_of([1]) is None and event_id_of({}) is None


def test_an_event_without_a_string_type_still_names_its_event_id() -> None:
    raw = decode('{"type": null, "event_id": "evt_1"}')
    assert event_id_of(raw) == "evt_1"
    with pytest.raises(InvalidEvent) as refused:
        parse(raw)
    assert (refused.value.code, refused.value.param) == ("invalid_json", "type")


def test_unpaired_surrogates_and_the_event_id_of_a_frame_too_large() -> None:
    from router.realtime.events import leading_event_id

    with pytest.raises(InvalidEvent) as refused:
        decode('{"type": "input_text_buffer.append", "delta": "\\ud800"}')
    assert refused.value.code == "invalid_json"
    assert leading_event_id('{"type": "input_text_buffer.append", "event_id": "evt_7", "delta": "' + "y" * 10**6) == (
        "evt_7"
    )
    assert leading_event_id('{"delta": "' + "y" * 10**6 + '", "event_id": "evt_8"}') == "evt_8"
