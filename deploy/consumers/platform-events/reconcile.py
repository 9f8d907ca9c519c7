"""Per event, the platform's record beside the agents': who reported it and when, who never did, and whether the outcomes agree.

Inputs: the platform's ``ScheduledEventEmitted`` deliveries (Event Grid) and the agents' records
(the Event Hub they send to). Outputs, as records of the agents' schema (``emit``):

* the platform's own record of each event (``scheduledevent.*``, ``source`` ``platform:…``);
  an Event Grid duplicate (same Event Grid ``id``) makes none;
* ``fleet.reported``: a VM named in the event reported it; ``DetectionSeconds`` = its agent's first
  sight minus the platform's ``eventTime`` (``Late`` when it came after ``fleet.missed``);
* ``fleet.missed``: a VM named in the event had not reported it ``missed_after`` seconds after the
  platform emitted it (its agent is down, blind, or not installed); its resource id rebuilt;
* ``fleet.outcome``: the platform's ``Completed``/``Canceled`` against each agent's evidence-based
  outcome, ``Agrees`` true/false (null when the agent could not tell: ``unknown``).

Records are emitted before the state says they were: a crash in between sends them again with the
same ids (consumers de-duplicate on ``id``), never loses them.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from platform_events import (
    EVENT_TYPE, ID_NAMESPACE, KINDS, PLATFORM_PREFIX, TERMINAL, BadEvent, parse_delivery, parse_time,
    platform_record, scheduled_event, validation_answer, vm_resource_ids,
)
from reconcile_state import ReconcileState

log = logging.getLogger(__name__)

DEFAULT_MISSED_AFTER = 300.0  # seconds: Scheduled Events reach IMDS and Event Grid within seconds of each other
AGENT_TERMINAL = ("completed", "canceled", "ended")


def vm_name(resource_id: str) -> str:
    """The VM name ``Resources`` uses for a VM's resource id: ``{scale set}_{instance}`` for a Uniform
    scale set's instance (``…/virtualMachineScaleSets/{ss}/virtualMachines/{instance}``), else the name."""
    parts = resource_id.strip("/").split("/")
    lower = [p.lower() for p in parts]
    if "virtualmachinescalesets" in lower:
        at = lower.index("virtualmachinescalesets")
        if len(parts) > at + 3 and lower[at + 2] == "virtualmachines":
            return f"{parts[at + 1]}_{parts[at + 3]}"
    if "virtualmachines" in lower:
        at = lower.index("virtualmachines")
        if len(parts) > at + 1:
            return parts[at + 1]
    return ""


def _utc(moment: float) -> str:
    return datetime.fromtimestamp(moment, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class _Batch:
    """Records to emit, and the state writes that may only follow a successful emit."""

    records: list[dict[str, Any]] = field(default_factory=list)
    claims: list[tuple[str, str]] = field(default_factory=list)
    puts: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    opens: list[tuple[str, float | None]] = field(default_factory=list)
    duplicates: int = 0


class Reconciler:
    """Joins the two views per event; ``state`` may be shared by several instances (see reconcile_state)."""

    def __init__(self, state: ReconcileState, emit: Callable[[list[dict[str, Any]]], None], *,
                 missed_after: float = DEFAULT_MISSED_AFTER, clock: Callable[[], float] = time.time,
                 verify: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        if not missed_after > 0:
            raise ValueError(f"missed_after must be a positive number of seconds, got {missed_after!r}")
        self.state = state
        self.emit = emit
        self.missed_after = missed_after
        self.clock = clock
        # With a verifier (the records' sefwdauth, streamauth.verify), only authenticated records count,
        # and the VM is the one their signed `source` names: a record cannot report for another VM.
        self.verify = verify
        self.refused = 0  # agent records that failed verification

    # -- the HTTP endpoint (Event Grid webhook) --
    def handle_delivery(self, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        """One Event Grid POST: the validation handshake, or events; (HTTP status, JSON answer).

        A 5xx makes Event Grid deliver again (the emit failed: nothing was marked done); a 400 is final.
        """
        try:
            events = parse_delivery(body)
            answer = validation_answer(events, headers)
            if answer is not None:
                return 200, answer
            batch = _Batch()
            ignored = 0
            for event in events:
                if event.get("eventType") != EVENT_TYPE:
                    ignored += 1  # another event type on the same topic: not ours
                    continue
                self._platform_event(event, batch)
        except BadEvent as exc:
            return 400, {"error": str(exc)}
        batch.records += self._due(self.clock(), batch)
        try:
            self._flush(batch)
        except Exception as exc:  # noqa: BLE001 - the output failed: let Event Grid retry
            log.warning("could not emit %d record(s): %s", len(batch.records), exc)
            return 503, {"error": "output unavailable"}
        return 200, {"received": len(events), "records": len(batch.records), "duplicates": batch.duplicates,
                     "ignored": ignored}

    def agent_records(self, records: Sequence[Mapping[str, Any]]) -> int:
        """The agents' records (any types; only ``scheduledevent.*`` count here); returns records emitted."""
        batch = _Batch()
        for rec in records:
            self._agent_record(rec, batch)
        batch.records += self._due(self.clock(), batch)
        self._flush(batch)
        return len(batch.records)

    def tick(self) -> int:
        """Emit ``fleet.missed`` for every event whose wait is over (a timer calls this); returns records emitted."""
        batch = _Batch()
        batch.records += self._due(self.clock(), batch)
        self._flush(batch)
        return len(batch.records)

    # -- internals --
    def _flush(self, batch: _Batch) -> None:
        if batch.records:
            self.emit(batch.records)
        for event_id, key in batch.claims:
            self.state.claim(event_id, key)
        for event_id, row, value in batch.puts:
            self.state.put(event_id, row, value)
        for event_id, due in batch.opens:
            self.state.set_open(event_id, due)

    def _once(self, batch: _Batch, event_id: str, key: str) -> bool:
        """Not yet done (in the state, nor earlier in this batch): then it is, once the batch is flushed."""
        if self.state.has(event_id, key) or (event_id, key) in batch.claims:
            return False
        batch.claims.append((event_id, key))
        return True

    def _view(self, batch: _Batch, event_id: str, row: str) -> dict[str, Any] | None:
        put: tuple[str, str, dict[str, Any]]
        for put in reversed(batch.puts):
            if put[0] == event_id and put[1] == row:
                return put[2]
        found: dict[str, Any] | None = self.state.rows(event_id, row).get(row)
        return found

    def _reports(self, batch: _Batch, event_id: str) -> dict[str, dict[str, Any]]:
        reports = {row[len("report|"):]: value for row, value in self.state.rows(event_id, "report|").items()}
        for e, row, value in batch.puts:
            if e == event_id and row.startswith("report|"):
                reports[row[len("report|"):]] = value
        return reports

    def _platform_event(self, grid_event: Mapping[str, Any], batch: _Batch) -> None:
        event = scheduled_event(grid_event)
        props = event["props"]
        event_id = props["EventId"]
        if not self._once(batch, event_id, "grid|" + event["grid_id"]):
            batch.duplicates += 1  # Event Grid delivered this one before (same id): no second record
            return
        view = self._view(batch, event_id, "platform")
        status = props.get("EventStatus")
        kind = KINDS.get(status, "updated") if isinstance(status, str) else "updated"
        if kind == "scheduled" and view is not None:
            kind = "updated"  # a new NotBefore, Resources or Description of an event already scheduled
        when = event["time"].timestamp()
        names = list(dict.fromkeys([*(view or {}).get("resources", []), *event["resources"]]))
        new_view = {
            "first_time": min(when, (view or {}).get("first_time", when)), "status": status, "resources": names,
            "resource": event["resource"], "type": props.get("EventType"),
            "vm_ids": vm_resource_ids(event["resource"], names), "not_before": props.get("NotBefore") or "",
        }
        batch.records.append(platform_record(event, kind))
        batch.puts.append((event_id, "platform", new_view))
        if view is None:
            batch.opens.append((event_id, new_view["first_time"] + self.missed_after))
        for vm in self._reports(batch, event_id):
            self._reported(batch, event_id, vm)
        if kind in TERMINAL:
            self._outcomes(batch, event_id)

    def _agent_record(self, rec: Mapping[str, Any], batch: _Batch) -> None:
        rtype, source = rec.get("type"), rec.get("source")
        data = rec.get("data")
        if not isinstance(rtype, str) or not rtype.startswith("scheduledevent.") or not isinstance(data, dict):
            return
        if isinstance(source, str) and source.startswith(PLATFORM_PREFIX):
            return  # our own platform records, read back from the hub
        vm_value = data.get("Vm")
        vm_data: dict[str, Any] = vm_value if isinstance(vm_value, dict) else {}
        name, event_id, seen = vm_data.get("Name"), data.get("EventId"), parse_time(rec.get("time"))
        if self.verify is not None:
            if not self.verify(rec):
                self.refused += 1
                log.warning("ignoring an agent record that fails verification (source %.200r)", source)
                return
            name = vm_name(str(source))
            vm_data = {**vm_data, "ResourceId": source}
        if not isinstance(name, str) or not name or not isinstance(event_id, str) or not event_id or seen is None:
            return
        vm = name.lower()
        row = "report|" + vm
        report = dict(self._view(batch, event_id, row) or {"first_seen": seen.timestamp(), "name": name,
                                                             "resource_id": vm_data.get("ResourceId")})
        report["first_seen"] = min(report["first_seen"], seen.timestamp())
        kind = rtype.partition(".")[2]
        if kind in AGENT_TERMINAL:
            outcome = data.get("Outcome") if isinstance(data.get("Outcome"), str) else kind
            report["outcome"] = "unknown" if outcome == "ended" else outcome
        batch.puts.append((event_id, row, report))
        self._reported(batch, event_id, vm)
        if kind in AGENT_TERMINAL:
            self._outcomes(batch, event_id)

    def _fleet_record(self, kind: str, event_id: str, vm: str, data: dict[str, Any], when: float) -> dict[str, Any]:
        return {"specversion": "1.0", "id": str(uuid.uuid5(ID_NAMESPACE, f"fleet|{event_id}|{kind}|{vm}")),
                "source": "platform:reconciler", "type": f"fleet.{kind}", "subject": event_id, "time": _utc(when),
                "datacontenttype": "application/json", "eventkey": f"{event_id}:{kind}:{vm}",
                "data": {"EventId": event_id, **data}}

    def _reported(self, batch: _Batch, event_id: str, vm: str) -> None:
        view = self._view(batch, event_id, "platform")
        report = self._view(batch, event_id, "report|" + vm)
        if view is None or report is None or not self._once(batch, event_id, "reported|" + vm):
            return
        detection = report["first_seen"] - view["first_time"]
        batch.records.append(self._fleet_record("reported", event_id, vm, {
            "EventType": view["type"], "Resources": view["resources"],
            "Vm": {"Name": report["name"], "ResourceId": report.get("resource_id")},
            "ReportedAt": _utc(report["first_seen"]), "PlatformTime": _utc(view["first_time"]),
            "DetectionSeconds": round(detection, 3), "Late": self.state.has(event_id, "missed|" + vm),
        }, self.clock()))

    def _outcomes(self, batch: _Batch, event_id: str) -> None:
        view = self._view(batch, event_id, "platform")
        if view is None or KINDS.get(view["status"]) not in TERMINAL:
            return
        platform = KINDS[view["status"]]
        for vm, report in self._reports(batch, event_id).items():
            agent = report.get("outcome")
            if agent is None or not self._once(batch, event_id, "outcome|" + vm):
                continue
            agrees = None if agent == "unknown" else agent == platform
            batch.records.append(self._fleet_record("outcome", event_id, vm, {
                "EventType": view["type"], "Vm": {"Name": report["name"], "ResourceId": report.get("resource_id")},
                "PlatformStatus": view["status"], "Outcome": agent, "Agrees": agrees,
                "Reason": "agent_unsure" if agrees is None else "agree" if agrees else "disagree",
            }, self.clock()))

    def _due(self, now: float, batch: _Batch) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event_id in self.state.due(now):
            view = self._view(batch, event_id, "platform")
            if view is None:
                batch.opens.append((event_id, None))
                continue
            reported = set(self._reports(batch, event_id))
            for name in view["resources"]:
                vm = name.lower()
                if vm in reported or not self._once(batch, event_id, "missed|" + vm):
                    continue
                out.append(self._fleet_record("missed", event_id, vm, {
                    "EventType": view["type"], "Resources": view["resources"], "NotBeforeRaw": view["not_before"],
                    "Vm": {"Name": name, "ResourceId": view["vm_ids"].get(name)},
                    "PlatformTime": _utc(view["first_time"]), "MissedAfterSeconds": self.missed_after,
                    "Reason": "not_reported",
                }, now))
            batch.opens.append((event_id, None))
        return out


__all__ = ["AGENT_TERMINAL", "DEFAULT_MISSED_AFTER", "Reconciler", "vm_name"]
