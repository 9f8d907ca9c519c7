"""Turn changes into CloudEvents 1.0 records (structured JSON mode)."""
from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from forwarder import __version__
from forwarder.common.record_auth import sign_record
from forwarder.imds.differ import TERMINAL_KINDS, UPDATED, Change
from forwarder.imds.document import Document, Event
from forwarder.imds.identity import VmIdentity
from forwarder.imds.outcome import TERMINAL_KEY_SUFFIX, terminal_key
from forwarder.sinkapi import Record
from forwarder.record_types import EVENT_TYPE_PREFIX as EVENT_TYPE_PREFIX  # (re-exported)
from forwarder.record_types import LIFECYCLE_TYPES as LIFECYCLE_TYPES
from forwarder.record_types import RECORD_TYPES

SPEC_VERSION = "1.0"
SEQUENCE_WIDTH = 20  # zero-padded so the string sorts like the number (fits any u64)
# Fixed namespace so the same change always gets the same id, on any machine, after any restart.
_ID_NAMESPACE = uuid.UUID("6f0d6c1e-2b7a-5a53-9c1e-5e0f0bd0a7e1")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def rfc3339(moment: datetime | None) -> str | None:
    """UTC RFC 3339 with millisecond precision and a Z suffix."""
    if moment is None:
        return None
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def record_id(vm_key: str, event_id: str, kind: str, incarnation: object, discriminator: str = "") -> str:
    """Deterministic id of one change, so a change re-sent after a crash keeps its id."""
    name = f"{vm_key}|{event_id}|{kind}|{incarnation}|{discriminator}"
    return str(uuid.uuid5(_ID_NAMESPACE, name))


def _digest(values: Mapping[str, Any], fields: Iterable[str]) -> str:
    text = repr([(f, values.get(f)) for f in fields])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def event_key(change: Change) -> str:
    """Fleet-wide de-duplication key: every VM that sees this change computes the same key.

    ``updated`` carries a digest of the new values, so two different updates of one event stay
    two logical changes while the copies of one update seen by a whole availability set collapse.
    """
    if change.kind in TERMINAL_KINDS:
        # One terminal key whatever this VM concluded: the fleet folds the outcomes in data.
        return terminal_key(change.event.event_id)
    key = f"{change.event.event_id}:{change.kind}"
    if change.kind == UPDATED:
        key += ":" + _digest(change.event.comparable(), change.changed_fields)
    return key


def event_data(event: Event) -> dict[str, Any]:
    """The IMDS fields under their IMDS names, NotBefore normalized (raw kept)."""
    return {
        "EventId": event.event_id,
        "EventType": event.event_type,
        "ResourceType": event.resource_type,
        "Resources": list(event.resources),
        "EventStatus": event.status,
        "NotBefore": rfc3339(event.not_before),
        "NotBeforeRaw": event.not_before_raw,
        "Description": event.description,
        "EventSource": event.event_source,
        "DurationInSeconds": event.duration_seconds,
        **({"DurationInSecondsRaw": event.duration_raw} if event.duration_raw is not None else {}),
    }


class RecordFactory:
    """Builds records for one VM, numbering them with a per-VM sequence counter."""

    def __init__(
        self,
        vm: VmIdentity,
        api_version: str,
        sequence: int = 0,
        clock: Callable[[], datetime] = utcnow,
        key: bytes | None = None,
    ) -> None:
        self.vm = vm
        # This VM's record key (forwarder.common.fleet_keys): every record gets its sefwdauth.
        self.key = key
        self.api_version = api_version
        self.sequence = sequence  # the last number handed out
        self._clock = clock

    def _next_sequence(self) -> str:
        self.sequence += 1
        return str(self.sequence).zfill(SEQUENCE_WIDTH)

    def _envelope(self, rid: str, rtype: str, subject: str, data: dict[str, Any], when: datetime) -> dict[str, Any]:
        return {
            "specversion": SPEC_VERSION,
            "id": rid,
            "source": self.vm.source,
            "type": rtype,
            "subject": subject,
            "time": rfc3339(when),
            "datacontenttype": "application/json",
            "sequence": self._next_sequence(),
            "data": data,
        }

    def _record(self, envelope: dict[str, Any]) -> Record:
        if self.key is not None:
            sign_record(self.key, envelope)
        return Record.from_dict(envelope)

    def for_changes(self, changes: Sequence[Change], document: Document) -> list[Record]:
        """One record per change, all stamped with the same observation time."""
        when = self._clock()
        vm_data = self.vm.record_data()
        out: list[Record] = []
        for change in changes:
            event = change.event
            discriminator = ""
            if document.incarnation is None:
                discriminator = _digest(event.comparable(), sorted(event.comparable()))
            # A terminal change keeps its id if a re-derivation after a crash concludes differently.
            id_kind = TERMINAL_KEY_SUFFIX if change.kind in TERMINAL_KINDS else change.kind
            rid = record_id(self.vm.key, event.event_id, id_kind, document.incarnation, discriminator)
            data = event_data(event)
            data.update(
                {
                    "Change": change.kind,
                    "PreviousStatus": change.previous_status,
                    "ChangedFields": list(change.changed_fields),
                    "RemovalReason": change.removal_reason,
                    "Initial": change.initial,
                    "DocumentIncarnation": document.incarnation,
                    "AffectsThisVm": self.vm.affected_by(event.resources),
                    "ApiVersion": self.api_version,
                    "Vm": vm_data,
                    "Extra": dict(event.extra),
                }
            )
            if change.outcome is not None:
                data.update(change.outcome.to_data())
            if change.early_start is not None:
                data["EarlyStart"] = dict(change.early_start)
            envelope = self._envelope(rid, EVENT_TYPE_PREFIX + change.kind, event.event_id, data, when)
            envelope["eventkey"] = event_key(change)
            out.append(self._record(envelope))
        return out

    def preview(self, change: Change, document: Document) -> Record:
        """The record a change would get, without using a sequence number (for hooks' stdin)."""
        saved = self.sequence
        try:
            return self.for_changes([change], document)[0]
        finally:
            self.sequence = saved

    def approval(self, entry: Mapping[str, Any]) -> Record:
        """``approval.<outcome>`` audit record (``protect.<outcome>`` for an entry of ``Family`` protect);
        random id (an audit entry is never re-derived). An outcome no record type has is refused."""
        payload = dict(entry)
        family = str(payload.pop("Family", None) or "approval")
        rtype = f"{family}.{entry['Outcome']}"
        if rtype not in RECORD_TYPES:
            raise ValueError(f"unknown audit record type {rtype!r}")
        payload["ApiVersion"] = self.api_version
        payload["Vm"] = self.vm.record_data()
        subject = entry.get("EventId") or family
        envelope = self._envelope(str(uuid.uuid4()), rtype, str(subject), payload, self._clock())
        return self._record(envelope)

    def lifecycle(self, kind: str, data: Mapping[str, Any]) -> Record:
        """``forwarder.started|heartbeat|stopped``: ids are random, these are never re-derived."""
        rtype = f"forwarder.{kind}"
        if rtype not in LIFECYCLE_TYPES:
            raise ValueError(f"unknown lifecycle record {rtype!r}")
        payload = {"Version": __version__, "ApiVersion": self.api_version, "Vm": self.vm.record_data()}
        payload.update(data)
        envelope = self._envelope(str(uuid.uuid4()), rtype, "forwarder", payload, self._clock())
        return self._record(envelope)
