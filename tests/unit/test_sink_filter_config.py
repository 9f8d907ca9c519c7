"""The ``filter`` table of a sink: every problem reported at once, the notify default, and what matches."""
from __future__ import annotations

import pytest

from forwarder.record_types import RECORD_TYPES
from forwarder.agent.config import describe, parse_config
from forwarder.delivery.filters import RecordFilter, parse_filter
from forwarder.errors import ConfigError
from forwarder.sinkapi import Record


def config(*sinks: dict) -> list[str]:
    try:
        parse_config({"sinks": list(sinks), "state": {"dir": "/tmp/unused-sefwd-state"}}, {}, "test.toml")
    except ConfigError as exc:
        return exc.problems
    return []


def test_every_problem_of_every_filter_is_listed_at_once():
    problems = config(
        {"type": "stdout", "filter": {"changes": ["sheduled", "ended", 3], "record_types": ["approvals"],
                                      "event_types": ["reboot", "Hibernate"], "affects_this_vm": "yes", "kinds": []}},
        {"type": "file", "name": "f", "path": "/tmp/sefwd-filter-test.jsonl", "filter": {"changes": []}},
        {"type": "stdout", "name": "s2", "filter": ["scheduled"]},
    )
    assert problems == [
        "sinks[0] (stdout): unknown key filter.kinds (known: record_types, changes, event_types, affects_this_vm)",
        "sinks[0] (stdout): filter.record_types: unknown name 'approvals' (did you mean 'approval'?) (known: "
        f"{', '.join(RECORD_TYPES)})",
        "sinks[0] (stdout): filter.changes: unknown name 'sheduled' (did you mean 'scheduled'?) (known: scheduled, "
        "started, updated, completed, canceled, ended)",
        "sinks[0] (stdout): filter.changes: expected non-empty strings, got 3",
        "sinks[0] (stdout): filter.event_types: IMDS values are case-sensitive: 'reboot' never matches; write 'Reboot'",
        "sinks[0] (stdout): filter.event_types: unknown name 'Hibernate' (did you mean 'Terminate'?) (known: Reboot, Redeploy, Freeze, Preempt, Terminate, SpotRebalanceRecommendation)",
        "sinks[0] (stdout): filter.affects_this_vm must be true or false, got 'yes'",
        "sinks[1] (f): filter.changes: an empty list would hold back every record; remove the key to send them all",
        "sinks[2] (s2): filter must be a table (filter = { changes = [\"scheduled\"] }), got ['scheduled']",
    ]


def test_event_keys_without_scheduled_event_records_are_a_contradiction():
    assert config({"type": "stdout", "filter": {"record_types": ["approval"], "event_types": ["Reboot"]}}) == [
        "sinks[0] (stdout): filter.event_types judges scheduled-event records, but filter.record_types sends none: "
        "add \"scheduledevent\" to record_types"]


def test_an_absent_filter_sends_all_and_an_empty_table_too(tmp_path):
    parsed = parse_config({"sinks": [{"type": "stdout"}, {"type": "file", "path": str(tmp_path / "x"), "filter": {}}],
                           "state": {"dir": str(tmp_path / "state")}}, {}, "test.toml")
    assert [s.filter for s in parsed.sinks] == [None, RecordFilter()]
    default, problems = parse_filter({"record_types": ["scheduledevent", "approval", "forwarder.stopped",
                                                       "forwarder.data_lost"]}, "x")
    assert problems == [] and default is not None
    assert "filter: none (every record)" in describe(parsed)


def record(rtype: str, **data: object) -> Record:
    return Record.from_dict({"id": "r", "type": rtype, "data": data})


@pytest.mark.parametrize("table, rtype, data, reason", [
    ({"record_types": ["approval.refused"]}, "approval.refused", {}, None),
    ({"record_types": ["approval.refused"]}, "approval.approved", {}, "record_type"),
    ({"record_types": ["forwarder"]}, "forwarder.heartbeat", {}, None),
    ({"changes": ["Scheduled"]}, "scheduledevent.scheduled", {}, None),
    ({"changes": ["scheduled"]}, "scheduledevent.updated", {}, "change"),
    ({"changes": ["scheduled"]}, "approval.approved", {}, None),  # judges scheduled events only
    ({"event_types": ["Preempt"]}, "scheduledevent.started", {"EventType": "Preempt"}, None),
    ({"event_types": ["Preempt"]}, "scheduledevent.started", {"EventType": "Freeze"}, "event_type"),
    ({"event_types": ["Preempt"]}, "scheduledevent.started", {}, "event_type"),
    ({"affects_this_vm": False}, "scheduledevent.scheduled", {"AffectsThisVm": True}, "affects_this_vm"),
    ({"affects_this_vm": False}, "scheduledevent.scheduled", {"AffectsThisVm": False}, None),
    ({"affects_this_vm": True}, "scheduledevent.scheduled", {"AffectsThisVm": None}, None),  # unknown: kept
])
def test_what_each_key_holds_back(table, rtype, data, reason):
    parsed, problems = parse_filter(table, "x")
    assert problems == [] and parsed is not None
    assert parsed.reason(record(rtype, **data)) == reason
