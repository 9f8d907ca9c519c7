"""Parsing of every api-version's document shape (seed payloads verbatim where the seeds give them)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from forwarder.imds.document import parse_document, parse_not_before
from forwarder.errors import DocumentError
from tests.conftest import FIXTURES

UTC = timezone.utc

# The seeds' schema blocks filled with the example values of their property tables.
PREVIEW_2017_03_01 = b"""{
    "DocumentIncarnation": 5,
    "Events": [
        {
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Reboot",
            "ResourceType": "VirtualMachine",
            "Resources": ["_FrontEnd_IN_0", "_BackEnd_IN_0"],
            "EventStatus": "Scheduled",
            "NotBefore": "2016-09-19T18:29:47Z"
        }
    ]
}"""
GA_2017_08_01 = b"""{
    "DocumentIncarnation": "5",
    "Events": [
        {
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["FrontEnd_IN_0", "BackEnd_IN_0"],
            "EventStatus": "Scheduled",
            "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"
        }
    ]
}"""
CURRENT_2020_07_01 = b"""{
    "DocumentIncarnation": 2,
    "Events": [
        {
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": ["FrontEnd_IN_0", "BackEnd_IN_0"],
            "EventStatus": "Scheduled",
            "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
            "Description": "Host server is undergoing maintenance.",
            "EventSource": "Platform",
            "DurationInSeconds": "-1"
        }
    ]
}"""


def test_windows_seed_example_sequence_parses_verbatim():
    docs = [parse_document((FIXTURES / f"windows-2020-07-01-example-{i}.json").read_bytes()) for i in (1, 2, 3, 4)]
    assert [d.incarnation for d in docs] == [1, 2, 3, 4]
    assert [len(d.events) for d in docs] == [0, 1, 1, 0]
    scheduled, started = docs[1].events[0], docs[2].events[0]
    assert scheduled.event_id == "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
    assert scheduled.event_type == "Freeze"
    assert scheduled.resources == ("WestNO_0", "WestNO_1")
    assert scheduled.not_before == datetime(2022, 4, 11, 22, 26, 58, tzinfo=UTC)
    assert scheduled.event_source == "Platform"
    assert scheduled.duration_seconds == 5
    assert started.status == "Started" and started.not_before is None and started.not_before_raw == ""


def test_preview_shape_iso_not_before_and_missing_newer_fields():
    doc = parse_document(PREVIEW_2017_03_01)
    (e,) = doc.events
    assert e.not_before == datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)
    assert e.description is None and e.event_source is None and e.duration_seconds is None
    assert e.resources == ("_FrontEnd_IN_0", "_BackEnd_IN_0")


def test_ga_shape_string_incarnation_rfc1123():
    doc = parse_document(GA_2017_08_01)
    assert doc.incarnation == 5
    assert doc.events[0].not_before == datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)


def test_current_shape_duration_as_string():
    e = parse_document(CURRENT_2020_07_01).events[0]
    assert e.duration_seconds == -1
    assert e.description == "Host server is undergoing maintenance."


def test_unknown_event_type_and_extra_fields_are_kept():
    doc = parse_document(
        b'{"DocumentIncarnation": 1, "Events": [{"EventId": "x", "EventType": "Hibernate",'
        b' "EventStatus": "Scheduled", "Resources": ["vm"], "NotBefore": "", "FutureField": {"a": 1}}]}'
    )
    e = doc.events[0]
    assert e.event_type == "Hibernate"
    assert e.extra == {"FutureField": {"a": 1}}


def test_empty_document_and_null_events():
    assert parse_document(b'{"DocumentIncarnation": 0, "Events": []}').events == ()
    # null is as broken as a missing array: read as "no events" it would cancel every event.
    with pytest.raises(DocumentError, match="'Events' must be an array, got null"):
        parse_document(b'{"DocumentIncarnation": 0, "Events": null}')


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html><body>502 Bad Gateway</body></html>", "not JSON"),
        (b"", "not JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"DocumentIncarnation": 1}', "no 'Events'"),
        (b'{"DocumentIncarnation": 1, "Events": {}}', "'Events' must be an array"),
        (b'{"DocumentIncarnation": 1, "Events": [1]}', r"Events\[0\] must be an object"),
        (b'{"DocumentIncarnation": 1, "Events": [{"EventType": "Reboot"}]}', "EventId"),
        (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "a", "Resources": "vm"}]}', "Resources"),
        (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "a", "EventStatus": 3}]}', "EventStatus"),
        (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "a", "DurationInSeconds": "long"}]}', "DurationInSeconds"),
        (b'{"DocumentIncarnation": [1], "Events": []}', "DocumentIncarnation"),
        (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "a"}, {"EventId": "a"}]}', "twice"),
    ],
)
def test_broken_documents_raise_clear_errors(body, message):
    with pytest.raises(DocumentError, match=message):
        parse_document(body)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("Mon, 19 Sep 2016 18:29:47 GMT", datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)),
        ("2016-09-19T18:29:47Z", datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)),
        ("2016-09-19T20:29:47+02:00", datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)),
        ("9/19/2016 6:29:47 PM", None),
        ("", None),
        (None, None),
    ],
)
def test_not_before_formats(raw, expected):
    assert parse_not_before(raw) == expected
