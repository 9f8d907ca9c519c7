"""Per-sink filters: which records a sink is sent. A filtered record advances that sink's cursor unsent.

A sink's ``filter`` table sets any of four keys; a record is sent only when it matches every key set:

- ``record_types``: record families (``scheduledevent``, ``approval``, ``protect``, ``forwarder``) or exact
  record types (``approval.refused``, ``protect.missed``, ``forwarder.data_lost``, ``scheduledevent.scheduled``).
- ``changes``: scheduled-event changes (``scheduled``, ``started``, ``updated``, ``completed``,
  ``canceled``, ``ended``).
- ``event_types``: IMDS EventTypes (``Reboot``, ``Redeploy``, ``Freeze``, ``Preempt``, ``Terminate``).
- ``affects_this_vm``: true or false (an event whose Resources this VM cannot judge, because it does not
  know its own name, is kept: better one message too many than a missed reboot).

``changes``, ``event_types`` and ``affects_this_vm`` describe scheduled events, so they judge only
``scheduledevent.*`` records; approval and agent-lifecycle records are kept or dropped by
``record_types`` alone. The dispatcher applies the filter (``forwarder.delivery.dispatcher``), once for
every sink type, and counts what it held back by reason (the first key that did not match).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forwarder.approval.config import KNOWN_VALUES
from forwarder.common.values import suggest
from forwarder.imds.differ import KINDS
from forwarder.record_types import EVENT_TYPE_PREFIX, RECORD_TYPES, SCHEDULED_EVENT
from forwarder.sinkapi import Record

FILTER_KEYS = ("record_types", "changes", "event_types", "affects_this_vm")
# (RECORD_TYPES: the one list of forwarder.record_types, which the record factory uses too)
EVENT_TYPES = KNOWN_VALUES["event_type"]
# Why a record was held back (status, metrics): the key that did not match.
REASONS = {"record_types": "record_type", "changes": "change", "event_types": "event_type",
           "affects_this_vm": "affects_this_vm"}
# Sinks that read best with a narrower default than "everything" (an explicit `filter = {}` sends all).
# People do not want a heartbeat every few minutes in a chat channel.
DEFAULT_FILTERS: dict[str, Mapping[str, Any]] = {
    "notify": {"record_types": [SCHEDULED_EVENT, "approval", "protect", "forwarder.stopped", "forwarder.data_lost"]},
}


@dataclass(frozen=True)
class RecordFilter:
    """What one sink is sent; a key left as None does not filter."""

    record_types: frozenset[str] | None = None
    changes: frozenset[str] | None = None
    event_types: frozenset[str] | None = None
    affects_this_vm: bool | None = None

    @property
    def needs_data(self) -> bool:
        return self.event_types is not None or self.affects_this_vm is not None

    def reason(self, record: Record) -> str | None:
        """None when ``record`` is to be sent; else why it is held back (``record_type``, ``change``, ...)."""
        family = record.type.partition(".")[0]
        if self.record_types is not None and family not in self.record_types and record.type not in self.record_types:
            return REASONS["record_types"]
        if family != SCHEDULED_EVENT:
            return None
        if self.changes is not None and record.type[len(EVENT_TYPE_PREFIX):] not in self.changes:
            return REASONS["changes"]
        if not self.needs_data:
            return None
        try:
            data = record.to_dict().get("data") or {}
        except ValueError:
            data = {}
        if not isinstance(data, Mapping):
            data = {}
        event_type = data.get("EventType")
        if self.event_types is not None and (not isinstance(event_type, str) or event_type not in self.event_types):
            return REASONS["event_types"]
        affects = data.get("AffectsThisVm")
        if self.affects_this_vm is not None and isinstance(affects, bool) and affects != self.affects_this_vm:
            return REASONS["affects_this_vm"]
        return None

    def describe(self) -> str:
        """One line for ``sefwd config show``."""
        parts = []
        for key in FILTER_KEYS:
            value = getattr(self, key)
            if value is not None:
                shown = str(value).lower() if isinstance(value, bool) else ",".join(sorted(value))
                parts.append(f"{key}={shown}")
        return " ".join(parts) or "none (every record)"


def _names(value: Any, known: tuple[str, ...], key: str, *, fold_case: bool) -> tuple[frozenset[str] | None, list[str]]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return None, [f"{key}: expected a list of strings, got {value!r}"]
    if not items:
        return None, [f"{key}: an empty list would hold back every record; remove the key to send them all"]
    problems: list[str] = []
    found: set[str] = set()
    for item in items:
        if not isinstance(item, str) or not item.strip():
            problems.append(f"{key}: expected non-empty strings, got {item!r}")
            continue
        text = item.strip().lower() if fold_case else item.strip()
        if text in known:
            found.add(text)
            continue
        same = [k for k in known if k.lower() == text.lower()]
        if same:
            problems.append(f"{key}: IMDS values are case-sensitive: {item!r} never matches; write {same[0]!r}")
        else:
            problems.append(f"{key}: unknown name {item!r}{suggest(text, known)} (known: {', '.join(known)})")
    return frozenset(found), problems


def parse_filter(raw: Any, where: str) -> tuple[RecordFilter | None, list[str]]:
    """The filter of one sink's ``filter`` table, and every problem with it (each prefixed by ``where``)."""
    if not isinstance(raw, Mapping):
        return None, [f"{where}: filter must be a table (filter = {{ changes = [\"scheduled\"] }}), got {raw!r}"]
    problems: list[str] = []
    for key in raw:
        if key not in FILTER_KEYS:
            problems.append(f"{where}: unknown key filter.{key}{suggest(str(key), FILTER_KEYS)} "
                            f"(known: {', '.join(FILTER_KEYS)})")
    values: dict[str, Any] = {}
    for key, known, fold in (("record_types", RECORD_TYPES, True), ("changes", KINDS, True),
                             ("event_types", EVENT_TYPES, False)):
        if key in raw:
            names, found = _names(raw[key], known, f"filter.{key}", fold_case=fold)
            problems += [f"{where}: {p}" for p in found]
            values[key] = names
    if "affects_this_vm" in raw:
        if isinstance(raw["affects_this_vm"], bool):
            values["affects_this_vm"] = raw["affects_this_vm"]
        else:
            problems.append(f"{where}: filter.affects_this_vm must be true or false, got {raw['affects_this_vm']!r}")
    types = values.get("record_types")
    if types and not any(t == SCHEDULED_EVENT or t.startswith(EVENT_TYPE_PREFIX) for t in types):
        narrowing = [k for k in ("changes", "event_types", "affects_this_vm") if k in raw]
        if narrowing:
            problems.append(f"{where}: filter.{narrowing[0]} judges scheduled-event records, but filter.record_types "
                            f"sends none: add \"{SCHEDULED_EVENT}\" to record_types")
    if problems:
        return None, problems
    return RecordFilter(**values), []


def filter_for(sink_type: str, raw: Any, where: str) -> tuple[RecordFilter | None, list[str]]:
    """The configured ``filter`` table (``None`` when absent: the sink type's default, if it has one)."""
    if raw is None:
        default = DEFAULT_FILTERS.get(sink_type)
        return parse_filter(default, where) if default is not None else (None, [])
    return parse_filter(raw, where)
