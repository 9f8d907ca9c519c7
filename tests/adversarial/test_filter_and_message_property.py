"""A sink's filter and the notify sink's messages over arbitrary records and filter tables (hypothesis):
a stored record of any shape never raises (which would stall that sink's delivery in a retry loop), and
any filter table is either a filter or a list of problems."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.delivery.filters import FILTER_KEYS, RecordFilter, parse_filter
from forwarder.sinkapi import Record
from sinks.notify_messages import MAX_BODY, MAX_TITLE, MessageRenderer
from tests.conftest import examples

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=20,
)
FIELDS = ("EventId", "EventType", "AffectsThisVm", "NotBefore", "Resources", "Vm", "Evidence", "ChangedFields",
          "DurationInSeconds", "Outcome", "Actor", "Reason", "Detail", "Description", "EventSource")
DATA = st.one_of(JSON, st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=len(FIELDS)))
TYPES = st.one_of(st.text(max_size=30), st.sampled_from([
    "scheduledevent.scheduled", "scheduledevent.completed", "scheduledevent.weird", "approval.refused",
    "forwarder.data_lost", "forwarder.heartbeat", "other"]))
FILTERS = [
    RecordFilter(record_types=frozenset({"scheduledevent", "approval.refused"})),
    RecordFilter(changes=frozenset({"scheduled"}), event_types=frozenset({"Reboot"}), affects_this_vm=True),
    RecordFilter(affects_this_vm=False),
]
RENDERERS = [MessageRenderer(None, fmt) for fmt in ("text", "markdown", "html")]


@pytest.mark.slow  # a large property run (1,500 examples)
@settings(max_examples=examples(1500), deadline=None)
@given(TYPES, DATA, st.one_of(JSON, st.text(max_size=40)))
def test_any_stored_record_is_judged_and_rendered_without_raising(rtype, data, time):
    record = Record.from_dict({"id": "r", "type": rtype, "time": time, "data": data})
    for record_filter in FILTERS:
        assert record_filter.reason(record) in (None, "record_type", "change", "event_type", "affects_this_vm")
    for renderer in RENDERERS:
        message = renderer.render(record.to_dict())
        assert isinstance(message.title, str) and len(message.title) <= MAX_TITLE
        assert isinstance(message.body, str) and len(message.body) <= MAX_BODY
        assert message.notify_type in ("info", "success", "warning", "failure")


@pytest.mark.slow  # a large property run (1,500 examples)
@settings(max_examples=examples(1500), deadline=None)
@given(st.one_of(JSON, st.dictionaries(st.sampled_from([*FILTER_KEYS, "other"]), JSON, max_size=5)))
def test_any_filter_table_is_a_filter_or_problems(table):
    parsed, problems = parse_filter(table, "sinks[0]")
    assert (parsed is None) == bool(problems)
    assert all(isinstance(p, str) and p.startswith("sinks[0]: ") for p in problems)


@settings(max_examples=examples(500), deadline=None)
@given(st.one_of(st.datetimes(timezones=st.none()).map(lambda d: d.isoformat()),
                 st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()),
                 st.sampled_from(["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "2026-11-26T01:23:00Z"])))
def test_any_not_before_renders_without_raising(not_before):
    record = {"type": "scheduledevent.scheduled", "time": not_before, "data": {"EventType": "Reboot", "NotBefore": not_before}}
    for renderer in RENDERERS:
        assert renderer.render(record).title.startswith("Reboot of ")
