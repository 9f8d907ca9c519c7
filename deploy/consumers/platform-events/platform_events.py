"""Event Grid ``ScheduledEventEmitted`` events in, records of the agents' schema out (no Functions host needed).

The platform publishes every Scheduled Event of opted-in VMs and scale sets to the system topic
``Microsoft.ResourceNotifications.MaintenanceResources`` (Microsoft, "Scheduled Events in Event
Grid", preview; docs/platform-events.md). Each one becomes a CloudEvents record like an agent's:
type ``scheduledevent.<kind>``, the IMDS fields under their IMDS names (``NotBefore`` in RFC 3339),
the same ``eventkey`` (``<EventId>:<kind>``; ``<EventId>:ended`` for an outcome) and a stable id, but
``source`` ``platform:<scale set or VM id>`` and the platform's own view under ``data.Platform``
(Event Grid id and time, subject, and the VMs' resource ids rebuilt from ``Resources``).
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"
VALIDATION_TYPE = "Microsoft.EventGrid.SubscriptionValidationEvent"
PLATFORM_PREFIX = "platform:"
# forwarder.records' namespace: the platform's records get ids the same way the agents' do.
ID_NAMESPACE = uuid.UUID("6f0d6c1e-2b7a-5a53-9c1e-5e0f0bd0a7e1")
KINDS = {"Scheduled": "scheduled", "Started": "started", "Completed": "completed", "Canceled": "canceled"}
TERMINAL = ("completed", "canceled")
MAX_BODY = 1024 * 1024  # an Event Grid delivery is at most 1 MB
_FRACTION = re.compile(r"(\.\d+)(?=Z|[+-]\d\d:?\d\d|$)")


class BadEvent(ValueError):
    """An Event Grid delivery that is not what the system topic sends."""


def record_id(key: str, event_id: str, kind: str, discriminator: str = "") -> str:
    """forwarder.records.record_id with no DocumentIncarnation (the platform has none)."""
    return str(uuid.uuid5(ID_NAMESPACE, f"{key}|{event_id}|{kind}|None|{discriminator}"))


def _utc(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: object) -> datetime | None:
    """An ISO 8601 (eventTime) or RFC 1123 (NotBefore) time, timezone-aware; None if empty or unreadable."""
    if not isinstance(text, str) or not text.strip():
        return None
    # Event Grid writes 7 fractional digits ("…00.9584103Z"); Python before 3.11 reads at most 6.
    value = _FRACTION.sub(lambda m: m.group(1)[:7], text.strip())
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        try:
            moment = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment


def split_resource(event_resource: str) -> tuple[str, dict[str, str]]:
    """``{VM or scale set id}/providers/microsoft.maintenance/scheduledevents/{id}`` → (that id, its parts)."""
    lower = event_resource.lower()
    cut = lower.find("/providers/microsoft.maintenance/scheduledevents/")
    resource = event_resource[:cut] if cut > 0 else event_resource
    parts = resource.strip("/").split("/")
    named = {parts[i].lower(): parts[i + 1] for i in range(0, len(parts) - 1, 2)}
    return resource, {"subscription": named.get("subscriptions", ""), "group": named.get("resourcegroups", ""),
                      "scale_set": named.get("virtualmachinescalesets", ""),
                      "vm": named.get("virtualmachines", "")}


def vm_resource_ids(resource: str, resources: list[str]) -> dict[str, str]:
    """Each VM named in ``Resources`` with its resource id, rebuilt as the page says: the subscription and
    group of the event's resource + ``providers/Microsoft.Compute/virtualMachines/`` + the name."""
    _, parts = split_resource(resource)
    base = f"/subscriptions/{parts['subscription']}/resourceGroups/{parts['group']}/providers/Microsoft.Compute/virtualMachines/"
    return {name: base + name for name in resources}


def validation_answer(events: list[Any], headers: Mapping[str, str]) -> dict[str, str] | None:
    """The answer to Event Grid's subscription validation handshake, or None if this is no handshake."""
    kind = next((v for k, v in headers.items() if k.lower() == "aeg-event-type"), "")
    for event in events:
        if isinstance(event, dict) and event.get("eventType") == VALIDATION_TYPE:
            code = (event.get("data") or {}).get("validationCode")
            if not isinstance(code, str) or not code:
                raise BadEvent("a SubscriptionValidationEvent without a validationCode")
            return {"validationResponse": code}
    if kind.lower() == "subscriptionvalidation":
        raise BadEvent("aeg-event-type SubscriptionValidation without a SubscriptionValidationEvent")
    return None


def parse_delivery(body: bytes) -> list[dict[str, Any]]:
    """An Event Grid POST body: a JSON array of events (one object is accepted too)."""
    if len(body) > MAX_BODY:
        raise BadEvent(f"a delivery of {len(body)} bytes (Event Grid sends at most {MAX_BODY})")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadEvent(f"not JSON: {exc}") from None
    events = value if isinstance(value, list) else [value]
    if not all(isinstance(e, dict) for e in events):
        raise BadEvent("every event must be a JSON object")
    return events


def scheduled_event(grid_event: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a ``ScheduledEventEmitted`` the rest needs, checked; BadEvent if it is not one."""
    if grid_event.get("eventType") != EVENT_TYPE:
        raise BadEvent(f"not a ScheduledEventEmitted: {grid_event.get('eventType')!r}")
    data, info, props = grid_event.get("data"), None, None
    if isinstance(data, dict):
        info = data.get("resourceInfo")
    if isinstance(info, dict):
        props = info.get("properties")
    if not isinstance(data, dict) or not isinstance(info, dict) or not isinstance(props, dict) \
            or not isinstance(props.get("EventId"), str) or not props["EventId"]:
        raise BadEvent("data.resourceInfo.properties.EventId is missing")
    grid_id, when = grid_event.get("id"), parse_time(grid_event.get("eventTime"))
    if not isinstance(grid_id, str) or not grid_id or when is None:
        raise BadEvent("an Event Grid event needs an id and an eventTime")
    listed = props.get("Resources")
    resources: list[Any] = listed if isinstance(listed, list) else []
    resource, parts = split_resource(str(info.get("id") or grid_event.get("subject") or ""))
    return {"grid_id": grid_id, "time": when, "subject": str(grid_event.get("subject") or ""),
            "resource": resource, "parts": parts, "props": props, "api_version": data.get("apiVersion"),
            "resources": [r for r in resources if isinstance(r, str)], "status": props.get("EventStatus")}


def _digest(props: Mapping[str, Any]) -> str:
    fields = ("EventType", "EventStatus", "NotBefore", "Resources", "Description", "DurationInSeconds", "EventSource")
    return hashlib.sha256(repr([(f, props.get(f)) for f in fields]).encode()).hexdigest()[:12]


def platform_record(event: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The record of the agents' schema for one platform event (``kind``: scheduled, updated, started,
    completed or canceled, decided by the caller from what it saw of the event before)."""
    props, resource, parts = event["props"], event["resource"], event["parts"]
    event_id = props["EventId"]
    terminal = kind in TERMINAL
    not_before = parse_time(props.get("NotBefore"))
    digest = _digest(props)
    source = PLATFORM_PREFIX + resource
    data = {
        "EventId": event_id, "EventType": props.get("EventType"), "ResourceType": props.get("ResourceType"),
        "Resources": list(event["resources"]), "EventStatus": props.get("EventStatus"),
        "NotBefore": _utc(not_before) if not_before else None, "NotBeforeRaw": props.get("NotBefore") or "",
        "Description": props.get("Description"), "EventSource": props.get("EventSource"),
        "DurationInSeconds": props.get("DurationInSeconds"),
        "Change": kind, "ApiVersion": event["api_version"], "AffectsThisVm": None, "DocumentIncarnation": None,
        "Vm": {"ResourceId": resource, "SubscriptionId": parts["subscription"], "ResourceGroupName": parts["group"],
               "VmScaleSetName": parts["scale_set"], "Name": parts["vm"]},
        "Platform": {"EventGridId": event["grid_id"], "EventTime": _utc(event["time"]), "Subject": event["subject"],
                     "VmResourceIds": vm_resource_ids(resource, event["resources"])},
    }
    if terminal:
        data["Outcome"] = kind
    key = f"{event_id}:ended" if terminal else f"{event_id}:{kind}" + (f":{digest}" if kind == "updated" else "")
    return {"specversion": "1.0", "id": record_id(source, event_id, "ended" if terminal else kind, digest),
            "source": source, "type": f"scheduledevent.{kind}", "subject": event_id, "time": _utc(event["time"]),
            "datacontenttype": "application/json", "eventkey": key, "data": data}


__all__ = ["BadEvent", "EVENT_TYPE", "PLATFORM_PREFIX", "VALIDATION_TYPE", "parse_delivery", "parse_time",
           "platform_record", "record_id", "scheduled_event", "split_resource", "validation_answer", "vm_resource_ids"]
