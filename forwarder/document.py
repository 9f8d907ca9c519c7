"""The Scheduled Events document: tolerant parsing of every api-version's shape."""
from __future__ import annotations

import email.utils
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import orjson

from forwarder.errors import DocumentError

# The IMDS field names, in the order the seeds show them; everything else is kept as "extra".
KNOWN_FIELDS = (
    "EventId",
    "EventType",
    "ResourceType",
    "Resources",
    "EventStatus",
    "NotBefore",
    "Description",
    "EventSource",
    "DurationInSeconds",
)
_STRING_FIELDS = ("EventType", "ResourceType", "EventStatus", "Description", "EventSource")


def parse_not_before(raw: object) -> datetime | None:
    """RFC 1123 ("Mon, 19 Sep 2016 18:29:47 GMT"), ISO 8601 ("2016-09-19T18:29:47Z") or "" → UTC datetime or None."""
    if not isinstance(raw, str) or not raw.strip():
        return None
    text = raw.strip()
    try:
        parsed = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            return None
    if parsed.tzinfo is None:  # IMDS times are UTC even when the zone is left out
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


def _int_or_none(value: object, what: str) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise DocumentError(f"{what} must be a number, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise DocumentError(f"{what} must be a number, got {value!r}")


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of ``Events``, with typed views of its fields and the raw dict kept whole."""

    event_id: str
    event_type: str | None
    resource_type: str | None
    resources: tuple[str, ...]
    status: str | None
    not_before_raw: str | None
    not_before: datetime | None
    description: str | None
    event_source: str | None
    duration_seconds: int | None
    extra: Mapping[str, Any]
    raw: Mapping[str, Any] = field(repr=False)

    @property
    def started(self) -> bool:
        return self.status == "Started"

    def comparable(self) -> dict[str, Any]:
        """Field values as the differ compares them (Resources order does not matter)."""
        values = dict(self.raw)
        if isinstance(values.get("Resources"), list):
            values["Resources"] = sorted(values["Resources"])
        return values


@dataclass(frozen=True, slots=True)
class Document:
    """A parsed Scheduled Events document."""

    incarnation: int | str | None
    events: tuple[Event, ...]

    def by_id(self) -> dict[str, Event]:
        return {e.event_id: e for e in self.events}


def parse_event(obj: object, index: int) -> Event:
    """Parse one event object; only a missing EventId or wrong types are errors."""
    where = f"Events[{index}]"
    if not isinstance(obj, dict):
        raise DocumentError(f"{where} must be an object, got {type(obj).__name__}")
    event_id = obj.get("EventId")
    if not isinstance(event_id, str) or not event_id:
        raise DocumentError(f"{where}.EventId must be a non-empty string, got {event_id!r}")
    strings: dict[str, str | None] = {}
    for name in _STRING_FIELDS:
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise DocumentError(f"{where}.{name} must be a string, got {value!r}")
        strings[name] = value
    resources = obj.get("Resources", [])
    if resources is None:
        resources = []
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        raise DocumentError(f"{where}.Resources must be a list of strings, got {resources!r}")
    not_before_raw = obj.get("NotBefore")
    if not_before_raw is not None and not isinstance(not_before_raw, str):
        raise DocumentError(f"{where}.NotBefore must be a string, got {not_before_raw!r}")
    return Event(
        event_id=event_id,
        event_type=strings["EventType"],
        resource_type=strings["ResourceType"],
        resources=tuple(resources),
        status=strings["EventStatus"],
        not_before_raw=not_before_raw,
        not_before=parse_not_before(not_before_raw),
        description=strings["Description"],
        event_source=strings["EventSource"],
        duration_seconds=_int_or_none(obj.get("DurationInSeconds"), f"{where}.DurationInSeconds"),
        extra={k: v for k, v in obj.items() if k not in KNOWN_FIELDS},
        raw=obj,
    )


def parse_document(body: bytes | str | Mapping[str, Any]) -> Document:
    """Parse a document; raises DocumentError saying what is wrong (never a bare exception)."""
    if isinstance(body, Mapping):
        obj: object = body
    else:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            snippet = " ".join(text[:80].split())
            raise DocumentError(f"not JSON ({exc}): {snippet!r}") from None
    if not isinstance(obj, dict):
        raise DocumentError(f"document must be a JSON object, got {type(obj).__name__}")
    # A document without Events is broken, not empty: reading it as empty would invent cancellations.
    if "Events" not in obj:
        raise DocumentError("document has no 'Events' array")
    events = obj["Events"]
    if events is None:
        events = []
    if not isinstance(events, list):
        raise DocumentError(f"'Events' must be an array, got {type(events).__name__}")
    incarnation: int | str | None
    raw_inc = obj.get("DocumentIncarnation")
    try:
        incarnation = _int_or_none(raw_inc, "DocumentIncarnation")
    except DocumentError:
        if not isinstance(raw_inc, str):
            raise
        incarnation = raw_inc  # an opaque string is still a usable incarnation
    parsed = tuple(parse_event(e, i) for i, e in enumerate(events))
    seen: set[str] = set()
    for e in parsed:
        if e.event_id in seen:
            raise DocumentError(f"EventId {e.event_id!r} appears twice")
        seen.add(e.event_id)
    return Document(incarnation=incarnation, events=parsed)
