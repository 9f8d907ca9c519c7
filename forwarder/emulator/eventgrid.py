"""The emulator's Event Grid side: every change of an event, pushed as ``ScheduledEventEmitted`` to a subscriber.

It plays the system topic ``Microsoft.ResourceNotifications.MaintenanceResources`` with one webhook
event subscription (Event Grid schema), as Microsoft's "Scheduled Events in Event Grid" page
describes it (docs/platform-events.md has the fields and the sources):

* before the first event, the subscription validation handshake: a POST of one
  ``Microsoft.EventGrid.SubscriptionValidationEvent`` (header ``aeg-event-type: SubscriptionValidation``)
  whose answer must be 200 with ``{"validationResponse": <validationCode>}``; nothing is delivered
  to an endpoint that did not validate;
* then one POST per event (a JSON array of one, ``aeg-event-type: Notification``), in order, each
  retried with backoff on anything but 2xx, as Event Grid retries;
* ``data.resourceInfo.properties`` holds the IMDS fields (``apiVersion`` 2024-07-01, ``dataVersion``
  3.0); ``EventStatus`` also says ``Completed`` and ``Canceled``, which IMDS never does; ``subject``
  and ``data.resourceInfo.id`` are the scale set's (or the VM's) id +
  ``/providers/microsoft.maintenance/scheduledevents/{EventId}``;
* optional faults: ``duplicates`` (every n-th event delivered twice with the same Event Grid
  ``id``, as the page warns happens) and ``delay`` (seconds before each delivery).
"""
from __future__ import annotations

import logging
import queue
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson

from forwarder.emulator.model import SCHEDULED, STARTED, Event, VmProfile, rfc1123

log = logging.getLogger(__name__)

TOPIC_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources"
EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"
VALIDATION_TYPE = "Microsoft.EventGrid.SubscriptionValidationEvent"
DATA_API_VERSION = "2024-07-01"
DATA_VERSION = "3.0"
RESOURCE_TYPE = "microsoft.maintenance/scheduledevents"
COMPLETED, CANCELED = "Completed", "Canceled"


def _status(change: str, ev: Event) -> str:
    """EventStatus as the platform publishes it: Scheduled, Started, and the outcomes IMDS never shows."""
    if change == "canceled":
        return CANCELED
    if change == "completed":
        return COMPLETED
    return STARTED if ev.status == STARTED else SCHEDULED


def resource_of(ev: Event, vms: dict[str, VmProfile]) -> str:
    """The ARM id the platform files the event under: the scale set of its VMs, or its (first) VM."""
    profile = vms.get(ev.resources[0]) if ev.resources else None
    if profile is None:
        return ""
    if profile.vm_scale_set_name:
        return (f"/subscriptions/{profile.subscription_id}/resourceGroups/{profile.resource_group_name}"
                f"/providers/Microsoft.Compute/virtualMachineScaleSets/{profile.vm_scale_set_name}")
    return profile.resource_id


def render(change: str, ev: Event, when: datetime, vms: dict[str, VmProfile], *, grid_id: str | None = None) -> dict[str, Any]:
    """One ``ScheduledEventEmitted`` in the Event Grid schema."""
    resource = resource_of(ev, vms)
    event_resource = f"{resource}/providers/microsoft.maintenance/scheduledevents/{ev.id}"
    profile = vms.get(ev.resources[0]) if ev.resources else None
    status = _status(change, ev)
    properties = {
        "DurationInSeconds": ev.duration,
        "Description": ev.description,
        "EventId": ev.id,
        "EventSource": ev.source,
        "EventStatus": status,
        "EventType": ev.type,
        "NotBefore": rfc1123(ev.not_before) if ev.not_before is not None and status == SCHEDULED else "",
        "Resources": list(ev.resources),
        "ResourceType": ev.resource_type,
    }
    return {
        "id": grid_id or str(uuid.uuid4()),
        "topic": f"/subscriptions/{profile.subscription_id if profile else ''}",
        "subject": event_resource,
        "data": {
            "resourceInfo": {"id": event_resource, "name": ev.id, "type": RESOURCE_TYPE,
                             "location": profile.location if profile else "", "properties": properties},
            "apiVersion": DATA_API_VERSION,
        },
        "eventType": EVENT_TYPE,
        "dataVersion": DATA_VERSION,
        "metadataVersion": "1",
        "eventTime": when.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
    }


@dataclass
class Delivery:
    """What the publisher did: for tests and the control API."""

    validated: bool = False
    delivered: int = 0  # POSTs answered 2xx (a duplicate counts twice)
    failed: int = 0  # attempts answered otherwise (each is retried)
    duplicates: int = 0


class EventGridPublisher:
    """Pushes every change of the platform's events to one subscriber URL (started by ``Emulator.publish_to``)."""

    def __init__(self, url: str, vms: dict[str, VmProfile], *, duplicates: int = 0, delay: float = 0.0,
                 retry: float = 0.2, max_attempts: int = 30, timeout: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the subscriber URL must be http(s), got {url!r}")
        self.url = url
        self.vms = vms
        self.duplicates = duplicates  # every n-th event is delivered twice (0: never)
        self.delay = delay
        self.retry = retry
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.stats = Delivery()
        self.sent: list[dict[str, Any]] = []  # every event delivered, duplicates included, in order
        self._queue: queue.Queue[tuple[str, Event, datetime] | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="emulator-eventgrid", daemon=True)
        self._count = 0

    # -- the platform's listener (called under its lock: only take note) --
    def __call__(self, change: str, ev: Event, when: datetime) -> None:
        self._queue.put((change, ev, when))

    def start(self) -> EventGridPublisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(10)

    def _post(self, events: list[dict[str, Any]], kind: str) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.url, data=orjson.dumps(events), method="POST",
            headers={"Content-Type": "application/json", "aeg-event-type": kind,
                     "aeg-subscription-name": "SEFWD-EMULATOR", "aeg-delivery-count": "0"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - loopback subscriber
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError as exc:
            log.debug("emulator eventgrid: POST %s failed: %s", self.url, exc)
            return 0, b""

    def _validate(self) -> bool:
        code = str(uuid.uuid4())
        event = {"id": str(uuid.uuid4()), "topic": "/subscriptions/emulator", "subject": "",
                 "data": {"validationCode": code, "validationUrl": ""}, "eventType": VALIDATION_TYPE,
                 "eventTime": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
                 "metadataVersion": "1", "dataVersion": "1"}
        for _ in range(self.max_attempts):
            status, body = self._post([event], "SubscriptionValidation")
            try:
                answer = orjson.loads(body) if status == 200 else None
            except orjson.JSONDecodeError:
                answer = None
            if isinstance(answer, dict) and answer.get("validationResponse") == code:
                self.stats.validated = True
                return True
            if self._stop.wait(self.retry):
                return False
        log.warning("emulator eventgrid: %s never validated the subscription", self.url)
        return False

    def _deliver(self, event: dict[str, Any]) -> None:
        for attempt in range(self.max_attempts):
            status, _ = self._post([event], "Notification")
            if 200 <= status < 300:
                self.stats.delivered += 1
                self.sent.append(event)
                return
            self.stats.failed += 1
            if self._stop.wait(min(self.retry * 2 ** attempt, 5.0)):
                return
        log.warning("emulator eventgrid: gave up delivering %s", event["id"])

    def _run(self) -> None:
        if not self._validate():
            return
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            change, ev, when = item
            if self.delay and self._stop.wait(self.delay):
                return
            event = render(change, ev, when, self.vms)
            self._count += 1
            self._deliver(event)
            if self.duplicates and self._count % self.duplicates == 0:
                self.stats.duplicates += 1
                self._deliver(event)  # the same Event Grid id: the subscriber must drop it


__all__ = ["COMPLETED", "CANCELED", "DATA_API_VERSION", "DATA_VERSION", "EVENT_TYPE", "TOPIC_TYPE",
           "VALIDATION_TYPE", "Delivery", "EventGridPublisher", "render", "resource_of"]
