"""The notify sink's words: relative times, which VM a message is about, and the per-type advice."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from sinks.notify_messages import MessageRenderer, relative

NOW = datetime(2026, 11, 26, 1, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("seconds, words", [
    (0, "now"), (4, "now"), (-4, "now"), (30, "in 30 s"), (-30, "30 s ago"), (240, "in 4 min"),
    (269, "in 4 min"), (3600, "in 1 h"), (2 * 3600 + 5 * 60, "in 2 h 5 min"), (-90 * 60, "1 h 30 min ago"),
])
def test_relative_times_read_like_people_say_them(seconds, words):
    assert relative(NOW + timedelta(seconds=seconds), NOW) == words
    assert relative(None, NOW) == ""


def render(data: dict, rtype: str = "scheduledevent.scheduled"):
    return MessageRenderer(None, clock=lambda: NOW).render({"type": rtype, "data": {"Vm": {"Name": "web-3"}, **data}})


def test_an_event_of_other_vms_names_them_and_says_who_reported_it():
    message = render({"EventId": "E1", "EventType": "Preempt", "NotBefore": "2026-11-26T01:00:30Z",
                      "Resources": ["web-1", "web-2", "web-4", "web-5"], "AffectsThisVm": False})
    assert message.title == "Spot eviction of web-1, web-2, web-4 and 1 more scheduled in 30 s"
    assert "Reported by web-3, which it does not affect." in message.body


def test_an_event_of_several_vms_including_this_one_lists_them():
    message = render({"EventId": "E2", "EventType": "Reboot", "NotBefore": "2026-11-26T01:10:00Z",
                      "Resources": ["web-3", "web-4"], "AffectsThisVm": True})
    assert message.title == "Reboot of web-3 scheduled in 10 min"
    assert "It affects 2 VMs: web-3, web-4." in message.body


def test_a_freeze_advises_differently_and_a_missing_not_before_is_left_out():
    message = render({"EventId": "E3", "EventType": "Freeze", "NotBefore": "", "Resources": ["web-3"],
                      "AffectsThisVm": True, "DurationInSeconds": 5})
    assert message.title == "Freeze of web-3 scheduled"
    assert message.body.startswith("Freeze of web-3 is scheduled: the VM pauses for a few seconds")
    assert "Expected impact: about 5 s." in message.body and "What to do: usually nothing" in message.body


def test_an_unknown_event_type_still_reads():
    message = render({"EventId": "E4", "EventType": "Hibernate", "Resources": ["web-3"], "AffectsThisVm": True},
                     "scheduledevent.started")
    assert message.title == "Hibernate of web-3 started" and "see the event's Description" in message.body
