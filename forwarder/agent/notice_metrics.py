"""Metrics against the notice window: how much notice each event gave, and how much an approval left.

* ``sefwd.event.notice_lead`` {type}: NotBefore minus the moment the agent first saw the event (a
  ``scheduled`` record, or a ``started`` one for an event never seen Scheduled); negative when the
  agent saw it only after NotBefore (it was down, or the platform was late).
* ``sefwd.approval.lead`` {type}: NotBefore minus the approval (an ``approval.approved`` record), per
  approved event: the time the platform was given back.

Delivery latency per sink (record time → the sink acknowledged) is ``sefwd.sink.delivery.latency``
(forwarder.agent.telemetry). Detection latency needs the platform's own time of the event, which the
VM never sees: the fleet side measures it (deploy/consumers/platform-events, docs/notice-window.md).

Labels take fixed values only (the known EventTypes and "other"), so the series count is fixed
however many events come and go. An event's NotBefore is remembered for its approval only while the event
lasts: its end (a ``completed``, ``canceled`` or ``ended`` record) forgets it, so what the agent holds here is
the events in the document now, not every event since it started (a soak's memory kept growing with it);
``MAX_REMEMBERED`` bounds it besides.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson

from forwarder.imds.differ import TERMINAL_KINDS
from forwarder.imds.event_types import EVENT_TYPES
from forwarder.record_types import EVENT_TYPE_PREFIX
from forwarder.sinkapi import Record

# Seconds: a Spot eviction's 30 s, Terminate's 5-15 min, Reboot's 15 min, up to a week for hardware.
LEAD_BUCKETS = (0.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 86400.0, 7 * 86400.0)
TYPE_LABELS = (*EVENT_TYPES, "other")
MAX_REMEMBERED = 1024  # events whose NotBefore is kept for their approval (oldest forgotten first)
SEEN = tuple(EVENT_TYPE_PREFIX + kind for kind in ("scheduled", "started", "updated"))
ENDED = tuple(EVENT_TYPE_PREFIX + kind for kind in TERMINAL_KINDS)
_LABELS = {label: label for label in EVENT_TYPES}  # a parsed EventType -> the one constant string


def type_label(event_type: object) -> str:
    """The bounded ``type`` label: a known EventType, else "other"."""
    return _LABELS.get(event_type, "other") if isinstance(event_type, str) else "other"


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def _parsed(record: Record) -> tuple[dict[str, Any], dict[str, Any]]:
    """The record's envelope and its ``data``; empty dicts for anything unreadable."""
    try:
        body = orjson.loads(record.body)
    except orjson.JSONDecodeError:
        return {}, {}
    if not isinstance(body, dict):
        return {}, {}
    data = body.get("data")
    return body, data if isinstance(data, dict) else {}


class NoticeWindow:
    """Records notice and approval leads from journaled records (called from the outbox's commit)."""

    def __init__(self, meter: Any) -> None:
        self._notice = meter.create_histogram(
            "sefwd.event.notice_lead", "s", "NotBefore minus first seen, per event type",
            explicit_bucket_boundaries_advisory=LEAD_BUCKETS)
        self._approval = meter.create_histogram(
            "sefwd.approval.lead", "s", "NotBefore minus the approval, per approved event's type",
            explicit_bucket_boundaries_advisory=LEAD_BUCKETS)
        self._events: OrderedDict[str, tuple[datetime | None, str]] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, records: Sequence[Record]) -> None:
        """Look at the records that matter here (a few per event); everything else costs a string compare."""
        for record in records:
            kind = record.type
            if kind in SEEN:
                self._event(record)
            elif kind in ENDED:
                self._forget(record)
            elif kind == "approval.approved":
                self._approved(record)

    def _event(self, record: Record) -> None:
        body, data = _parsed(record)
        if not isinstance(data.get("EventId"), str):
            return
        event_id, label = data["EventId"], type_label(data.get("EventType"))
        not_before, seen = _time(data.get("NotBefore")), _time(body.get("time"))
        with self._lock:
            first = event_id not in self._events
            if not_before is not None or first:
                self._events[event_id] = (not_before or (self._events.get(event_id) or (None, label))[0], label)
            self._events.move_to_end(event_id)
            while len(self._events) > MAX_REMEMBERED:
                self._events.popitem(last=False)
        # The notice an event gave: once, at first sight (a Started one seen first gave none it kept).
        # (An Initial record is the first poll after an install: the agent was not there to be notified.)
        if first and seen is not None and record.type != "scheduledevent.updated" and data.get("Initial") is not True:
            lead = (not_before - seen).total_seconds() if not_before is not None else 0.0
            self._notice.record(lead, {"type": label})

    @property
    def remembered(self) -> int:
        """Events whose NotBefore is kept now (the live ones, at most ``MAX_REMEMBERED``)."""
        with self._lock:
            return len(self._events)

    def _forget(self, record: Record) -> None:
        """The event ended: its approval is behind it, nothing here needs it any more."""
        event_id = _parsed(record)[1].get("EventId")
        if isinstance(event_id, str):
            with self._lock:
                self._events.pop(event_id, None)

    def _approved(self, record: Record) -> None:
        body, data = _parsed(record)
        approved = _time(body.get("time"))
        if approved is None:
            return
        listed = data.get("EventIds")
        ids: list[Any] = listed if isinstance(listed, list) else [data.get("EventId")]
        for event_id in ids:
            with self._lock:
                known = self._events.get(event_id) if isinstance(event_id, str) else None
            if known is not None and known[0] is not None:
                self._approval.record((known[0] - approved).total_seconds(), {"type": known[1]})


__all__ = ["LEAD_BUCKETS", "MAX_REMEMBERED", "TYPE_LABELS", "NoticeWindow", "type_label"]
