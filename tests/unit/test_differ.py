"""The differ for every change kind."""
from __future__ import annotations

from datetime import datetime, timezone

import orjson

from forwarder.imds.differ import (
    CANCELED, COMPLETED, GONE_BEFORE_NOT_BEFORE, ENDED, GONE_AFTER_NOT_BEFORE, SCHEDULED,
    STARTED, UPDATED, diff,
)
from forwarder.imds.document import parse_document
from tests.conftest import FIXTURES

NOW = datetime(2022, 4, 11, 22, 20, 0, tzinfo=timezone.utc)  # before the seed's NotBefore


def doc(incarnation, *events):
    return parse_document(orjson.dumps({"DocumentIncarnation": incarnation, "Events": list(events)}))


def ev(event_id="e1", status="Scheduled", **fields):
    base = {
        "EventId": event_id, "EventStatus": status, "EventType": "Reboot", "ResourceType": "VirtualMachine",
        "Resources": ["vm0"], "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT" if status == "Scheduled" else "",
        "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
    }
    base.update(fields)
    return base


def kinds(changes):
    return [(c.kind, c.event.event_id) for c in changes]


def test_windows_seed_sequence_1_to_4():
    docs = [parse_document((FIXTURES / f"windows-2020-07-01-example-{i}.json").read_bytes()) for i in (1, 2, 3, 4)]
    assert diff(docs[0], docs[1], NOW)[0].kind == SCHEDULED
    started = diff(docs[1], docs[2], NOW)
    assert len(started) == 1 and started[0].kind == STARTED
    assert started[0].changed_fields == ("EventStatus", "NotBefore")
    assert started[0].previous_status == "Scheduled"
    completed = diff(docs[2], docs[3], NOW)
    assert [c.kind for c in completed] == [COMPLETED]
    assert completed[0].removal_reason == ENDED
    assert completed[0].event.status == "Started"


def test_fresh_install_marks_current_events_initial():
    changes = diff(None, doc(7, ev("a"), ev("b", "Started")), NOW)
    assert kinds(changes) == [(SCHEDULED, "a"), (STARTED, "b")]
    assert all(c.initial for c in changes)


def test_incarnation_bump_without_event_change_gives_nothing():
    assert diff(doc(1, ev("a")), doc(2, ev("a")), NOW) == []


def test_hardware_failure_appears_started():
    changes = diff(doc(1), doc(2, ev("hw", "Started", EventType="Reboot")), NOW)
    assert kinds(changes) == [(STARTED, "hw")]
    assert changes[0].previous is None and not changes[0].initial


def test_not_before_moved_is_updated_with_changed_fields():
    changes = diff(doc(1, ev("a")), doc(2, ev("a", NotBefore="Mon, 11 Apr 2022 23:26:58 GMT")), NOW)
    assert kinds(changes) == [(UPDATED, "a")]
    assert changes[0].changed_fields == ("NotBefore",)


def test_several_fields_updated_once():
    changes = diff(doc(1, ev("a")), doc(2, ev("a", Resources=["vm0", "vm1"], Description="x", DurationInSeconds=9)), NOW)
    assert kinds(changes) == [(UPDATED, "a")]
    assert changes[0].changed_fields == ("Description", "DurationInSeconds", "Resources")


def test_resources_reordered_is_not_a_change():
    assert diff(doc(1, ev("a", Resources=["x", "y"])), doc(2, ev("a", Resources=["y", "x"])), NOW) == []


def test_status_change_is_one_started_listing_other_fields():
    changes = diff(doc(1, ev("a")), doc(2, ev("a", "Started", Description="now")), NOW)
    assert kinds(changes) == [(STARTED, "a")]
    assert changes[0].changed_fields == ("Description", "EventStatus", "NotBefore")


def test_removal_while_scheduled_is_canceled_with_reason():
    before_nb = diff(doc(1, ev("a")), doc(2), NOW)
    assert kinds(before_nb) == [(CANCELED, "a")]
    assert before_nb[0].removal_reason == GONE_BEFORE_NOT_BEFORE == "gone_before_notbefore"
    after_nb = diff(doc(1, ev("a")), doc(2), datetime(2022, 4, 12, tzinfo=timezone.utc))
    assert after_nb[0].removal_reason == GONE_AFTER_NOT_BEFORE


def test_many_events_mixed_changes_in_order():
    prev = doc(1, ev("keep"), ev("start"), ev("gone"), ev("done", "Started"), ev("move"))
    cur = doc(2, ev("keep"), ev("start", "Started"), ev("move", NotBefore="Tue, 12 Apr 2022 22:26:58 GMT"), ev("new"))
    assert kinds(diff(prev, cur, NOW)) == [
        (STARTED, "start"), (UPDATED, "move"), (SCHEDULED, "new"), (CANCELED, "gone"), (COMPLETED, "done"),
    ]


def test_extra_field_appearing_is_an_update():
    changes = diff(doc(1, ev("a")), doc(2, ev("a", NewThing=1)), NOW)
    assert changes[0].kind == UPDATED and changes[0].changed_fields == ("NewThing",)
