"""The Scheduled Events document: tolerant parsing of every api-version's shape."""
from __future__ import annotations

import email.utils
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import orjson

from forwarder.errors import DocumentError
from forwarder.common.logs import OnceLog

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
log = logging.getLogger(__name__)
# A value bounded or dropped is said once per event and value, not at every poll of the same
# document (nor again at the next start); at most 20 such lines a minute in all.
warn_once = OnceLog(log)
# (key, message, args) of such warnings, said only once the whole document parsed (a refused
# document is reported as refused, not value by value).
Notes = list[tuple[object, str, tuple[object, ...]]]


def _note(notes: Notes | None, key: object, msg: str, *args: object) -> None:
    if notes is None:
        warn_once.warning(key, msg, *args)
    else:
        notes.append((key, msg, args))

# Bounds on what the platform can send, so every later stage (diff, records, orjson, sinks) can
# handle any document that parses. IMDS sends GUID EventIds, small incarnation counters, a
# DurationInSeconds of -1 or a few hours, and NotBefore within days of now.
INT64 = (-(2**63), 2**63 - 1)
DURATION_RANGE = (-1, 366 * 24 * 3600)  # -1 = unknown; a year is already absurd
EVENT_ID_MAX = 256
INCARNATION_TEXT_MAX = 128
NOT_BEFORE_YEARS = (1970, 9000)  # far from datetime's edges: arithmetic on it never overflows
EXTRA_DEPTH_MAX = 8  # nesting levels of an unknown field kept
EXTRA_FIELD_MAX = 4096  # serialized bytes of one unknown field kept
EXTRA_FIELDS_MAX = 64  # unknown fields kept per event
TRUNCATED = "…(truncated by sefwd)"
_CONTROL = frozenset(chr(c) for c in (*range(0x20), 0x7F))


def parse_not_before(raw: object) -> datetime | None:
    """RFC 1123 ("Mon, 19 Sep 2016 18:29:47 GMT"), ISO 8601 ("2016-09-19T18:29:47Z") or "" → UTC datetime or None."""
    return _not_before(raw)[0]


def _not_before(raw: object) -> tuple[datetime | None, str | None]:
    """(UTC time or None, why a non-empty text gave None: None if it did not)."""
    if not isinstance(raw, str) or not raw.strip():
        return None, None
    text = raw.strip()
    try:
        parsed = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            return None, "is neither an RFC 1123 nor an ISO 8601 time"
    if parsed.tzinfo is None:  # IMDS times are UTC even when the zone is left out
        parsed = parsed.replace(tzinfo=timezone.utc)
    try:
        utc = parsed.astimezone(timezone.utc)
    except (OverflowError, ValueError):  # year 1 or 9999 with an offset leaves datetime's range
        return None, "leaves the representable date range when converted to UTC"
    # Outside these years it is no real notice; null (NotBeforeRaw keeps the text) is safe downstream.
    if not NOT_BEFORE_YEARS[0] <= utc.year <= NOT_BEFORE_YEARS[1]:
        return None, f"is outside the years {NOT_BEFORE_YEARS[0]}-{NOT_BEFORE_YEARS[1]}"
    return utc, None


def _bounded(value: Any, depth: int) -> tuple[Any, bool]:
    """An unknown field's value made safe to keep: depth, int width and size bounded; (value, cut)."""
    if isinstance(value, bool) or value is None or isinstance(value, (float, str)):
        return value, False
    if isinstance(value, int):
        return (value, False) if INT64[0] <= value <= INT64[1] else (str(value), True)
    if depth >= EXTRA_DEPTH_MAX:
        return TRUNCATED, True
    cut = False
    if isinstance(value, list):
        items = []
        for item in value:
            kept, c = _bounded(item, depth + 1)
            items.append(kept)
            cut |= c
        return items, cut
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            kept, c = _bounded(item, depth + 1)
            out[key] = kept
            cut |= c
        return out, cut
    return str(value), True


def bounded_extra(obj: Mapping[str, Any], where: str, event_id: str = "", notes: Notes | None = None) -> dict[str, Any]:
    """The event's unknown fields, each bounded in depth, number width and size (cuts are logged)."""
    extra: dict[str, Any] = {}
    cut_fields: list[str] = []
    for name, value in obj.items():
        if name in KNOWN_FIELDS:
            continue
        if len(extra) >= EXTRA_FIELDS_MAX:
            cut_fields.append("(more fields)")
            break
        kept, cut = _bounded(value, 0)
        size = len(orjson.dumps(kept))
        if size > EXTRA_FIELD_MAX:
            kept, cut = orjson.dumps(kept)[:EXTRA_FIELD_MAX].decode("utf-8", "ignore") + TRUNCATED, True
        extra[name[:EXTRA_FIELD_MAX]] = kept
        if cut:
            cut_fields.append(name[:64])
    if cut_fields:
        _note(notes, ("extra", event_id or where, tuple(cut_fields), len(orjson.dumps(extra))),
              "%s: unknown field(s) %s kept truncated (deeper than %d levels, wider than 64-bit numbers or larger "
              "than %d bytes)", where, ", ".join(cut_fields), EXTRA_DEPTH_MAX, EXTRA_FIELD_MAX)
    return extra


def _int_or_none(value: object, what: str) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise DocumentError(f"{what} must be a number, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= 40:
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise DocumentError(f"{what} must be a number, got {_short(value)}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def _key_text(text: str | None) -> tuple[str, int] | None:
    """What a once-per-value warning remembers of a value: a bounded prefix and the length."""
    return None if text is None else (text[:128], len(text))


def _duration(value: object, where: str, event_id: str, label: str, notes: Notes | None) -> tuple[int | None, str | None]:
    """DurationInSeconds within what the platform sends, else None with the raw text kept."""
    number = _int_or_none(value, f"{where}.DurationInSeconds")
    if number is None or DURATION_RANGE[0] <= number <= DURATION_RANGE[1]:
        return number, None
    raw = str(value)[:64]
    _note(notes, ("duration", event_id, raw), "%s: DurationInSeconds %s is beyond what IMDS sends (%d to %d); "
          "DurationInSeconds is null, the value kept as DurationInSecondsRaw", label, raw, *DURATION_RANGE)
    return None, raw


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
    duration_raw: str | None = None  # the text of a DurationInSeconds out of bounds (then None above)

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


def parse_event(obj: object, index: int, notes: Notes | None = None) -> Event:
    """Parse one event object; only a missing EventId or wrong types are errors.

    A value bounded or dropped is warned about once (see ``warn_once``), or added to ``notes``.
    """
    where = f"Events[{index}]"
    if not isinstance(obj, dict):
        raise DocumentError(f"{where} must be an object, got {type(obj).__name__}")
    event_id = obj.get("EventId")
    if not isinstance(event_id, str) or not event_id.strip():
        raise DocumentError(f"{where}.EventId must be a non-empty string, got {_short(event_id)}")
    # It becomes a record subject, an HTTP header value (binary CloudEvents) and a POST body.
    if len(event_id) > EVENT_ID_MAX or any(ch in _CONTROL for ch in event_id):
        raise DocumentError(f"{where}.EventId must be at most {EVENT_ID_MAX} characters without control "
                            f"characters, got {_short(event_id)}")
    label = f"{where} (EventId {event_id})"  # for warnings: which event, in words an operator can grep
    strings: dict[str, str | None] = {}
    for name in _STRING_FIELDS:
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise DocumentError(f"{where}.{name} must be a string, got {_short(value)}")
        strings[name] = value
    resources = obj.get("Resources", [])
    if resources is None:
        resources = []
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        raise DocumentError(f"{where}.Resources must be a list of strings, got {_short(resources)}")
    not_before_raw = obj.get("NotBefore")
    if not_before_raw is not None and not isinstance(not_before_raw, str):
        raise DocumentError(f"{where}.NotBefore must be a string, got {_short(not_before_raw)}")
    not_before, why = _not_before(not_before_raw)
    if why is not None:
        _note(notes, ("not_before", event_id, _key_text(not_before_raw)), "%s: NotBefore %s %s; NotBefore is null, "
              "the text kept as NotBeforeRaw", label, _short(not_before_raw), why)
    duration, duration_raw = _duration(obj.get("DurationInSeconds"), where, event_id, label, notes)
    extra = bounded_extra(obj, label, event_id, notes)
    # What the differ compares: the known fields as sent (bounded above where it matters) and the
    # bounded unknown ones, so no comparison or digest walks an unbounded structure.
    raw = {k: obj[k] for k in KNOWN_FIELDS if k in obj}
    if duration_raw is not None:
        raw["DurationInSeconds"] = duration_raw
    raw.update(extra)
    return Event(
        event_id=event_id,
        event_type=strings["EventType"],
        resource_type=strings["ResourceType"],
        resources=tuple(resources),
        status=strings["EventStatus"],
        not_before_raw=not_before_raw,
        not_before=not_before,
        description=strings["Description"],
        event_source=strings["EventSource"],
        duration_seconds=duration,
        extra=extra,
        raw=raw,
        duration_raw=duration_raw,
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
    # null is no more "no events" than a missing array: reading it as empty invents cancellations.
    if not isinstance(events, list):
        raise DocumentError(f"'Events' must be an array, got {'null' if events is None else type(events).__name__}")
    incarnation: int | str | None
    notes: Notes = []
    raw_inc = obj.get("DocumentIncarnation")
    try:
        incarnation = _int_or_none(raw_inc, "DocumentIncarnation")
        if incarnation is not None and not INT64[0] <= incarnation <= INT64[1]:
            # Wider than 64 bits (JSON parsers read such integers as floats): kept as opaque text.
            raw_inc, incarnation = str(raw_inc), None
            if len(raw_inc) <= INCARNATION_TEXT_MAX:
                notes.append((("incarnation", raw_inc), "DocumentIncarnation %s is wider than 64 bits; kept as "
                              "an opaque text", (raw_inc,)))
            raise DocumentError("wider than 64 bits")
    except DocumentError:
        if not isinstance(raw_inc, str):
            raise
        if len(raw_inc) > INCARNATION_TEXT_MAX or any(ch in _CONTROL for ch in raw_inc):
            raise DocumentError(f"DocumentIncarnation must be a number or a short text, got {_short(raw_inc)}") from None
        incarnation = raw_inc  # an opaque string is still a usable incarnation
    parsed = tuple(parse_event(e, i, notes) for i, e in enumerate(events))
    seen: set[str] = set()
    for e in parsed:
        if e.event_id in seen:
            raise DocumentError(f"EventId {e.event_id!r} appears twice")
        seen.add(e.event_id)
    for key, msg, args in notes:
        warn_once.warning(key, msg, *args)
    return Document(incarnation=incarnation, events=parsed)
