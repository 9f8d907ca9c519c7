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

Each record is a decision claimed in the state before it is emitted and settled after (released when
the output fails), so any number of instances sharing the state (``STATE_BACKEND=table``) emit each at
most once; an instance killed in between leaves a claim that another one takes over when its lease ran
out (then the record can go out twice, with the same id: consumers de-duplicate on ``id``).
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
from reconcile_state import BUSY, DEFAULT_LEASE, DONE, TAKEN, ReconcileState

log = logging.getLogger(__name__)

DEFAULT_MISSED_AFTER = 300.0  # seconds: Scheduled Events reach IMDS and Event Grid within seconds of each other
PURGE_EVERY = 3600.0  # seconds between two purges of the state (from the timer's tick)
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
    """Records to emit, and the decisions they carry: settled after a successful emit, released after a failed one."""

    records: list[dict[str, Any]] = field(default_factory=list)
    taken: list[tuple[str, str]] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)  # events marked open for a recheck in this batch
    busy: set[str] = field(default_factory=set)  # events with a decision another instance holds
    reschedules: list[tuple[str, str, float | None]] = field(default_factory=list)
    duplicates: int = 0
    retry: bool = False  # a delivery another instance is handling: Event Grid must deliver it again


class Reconciler:
    """Joins the two views per event; ``state`` may be shared by several instances (see reconcile_state)."""

    def __init__(self, state: ReconcileState, emit: Callable[[list[dict[str, Any]]], None], *,
                 missed_after: float = DEFAULT_MISSED_AFTER, clock: Callable[[], float] = time.time,
                 verify: Callable[[Mapping[str, Any]], bool] | None = None, recheck: float = DEFAULT_LEASE) -> None:
        if not missed_after > 0:
            raise ValueError(f"missed_after must be a positive number of seconds, got {missed_after!r}")
        self.state = state
        self.emit = emit
        self.missed_after = missed_after
        self.clock = clock
        # With a verifier (the records' sefwdauth, streamauth.verify), only authenticated records count,
        # and the VM is the one their signed `source` names: a record cannot report for another VM.
        self.verify = verify
        # When to look again at an event whose decision an instance holds (the state's lease: then it can
        # be taken over if that instance died).
        self.recheck = recheck
        self.refused = 0  # agent records that failed verification
        self._done: set[tuple[str, str]] = set()  # decisions known settled (they stay so): no state round trip
        self.purge_every = PURGE_EVERY
        self._purged_at: float | None = None

    # -- the HTTP endpoint (Event Grid webhook) --
    def handle_delivery(self, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        """One Event Grid POST: the validation handshake, or events; (HTTP status, JSON answer).

        A 5xx makes Event Grid deliver again (the emit failed, or another instance holds one of these
        events and may die: nothing was marked done that did not get out); a 400 is final.
        """
        try:
            events = parse_delivery(body)
            answer = validation_answer(events, headers)
            if answer is not None:
                return 200, answer
            for event in events:  # all bad or none: a 400 before any state is written
                if event.get("eventType") == EVENT_TYPE:
                    scheduled_event(event)
        except BadEvent as exc:
            return 400, {"error": str(exc)}
        batch = _Batch()
        ours = [event for event in events if event.get("eventType") == EVENT_TYPE]
        ignored = len(events) - len(ours)  # other event types on the same topic: not ours

        def fill() -> None:
            for event in ours:
                self._platform_event(event, batch)

        try:
            self._emit(batch, fill)
        except Exception as exc:  # noqa: BLE001 - the output (or the state) failed: let Event Grid retry
            log.warning("could not emit %d record(s): %s", len(batch.records), exc)
            return 503, {"error": "output unavailable"}
        if batch.retry:
            return 503, {"error": "another instance is handling this delivery", "records": len(batch.records)}
        return 200, {"received": len(events), "records": len(batch.records), "duplicates": batch.duplicates,
                     "ignored": ignored}

    def agent_records(self, records: Sequence[Mapping[str, Any]]) -> int:
        """The agents' records (any types; only ``scheduledevent.*`` count here); returns records emitted."""
        batch = _Batch()

        def fill() -> None:
            for rec in records:
                self._agent_record(rec, batch)

        self._emit(batch, fill)
        return len(batch.records)

    def tick(self) -> int:
        """Emit ``fleet.missed`` for every event whose wait is over, and the decisions a dead instance left
        (a timer calls this); returns records emitted."""
        batch = _Batch()
        self._emit(batch, lambda: None)
        self.purge_when_due()
        return len(batch.records)

    def purge_when_due(self) -> int:
        """Forget what the state keeps past its retention, at most every ``purge_every`` seconds (and at the
        first tick); returns the rows deleted. A failure is logged: the next tick tries again."""
        now = self.clock()
        if self._purged_at is not None and now - self._purged_at < self.purge_every:
            return 0
        try:
            deleted = self.state.purge(now)
        except Exception as exc:  # the state unreachable: purging waits, the decisions do not
            log.warning("purging the reconcile state failed (next tick tries again): %s", exc)
            return 0
        self._purged_at = now
        self._done.clear()  # (what they named may be forgotten now; the state answers again)
        if deleted:
            log.info("purged %d reconcile state rows past their retention", deleted)
        return deleted

    # -- internals --
    def _emit(self, batch: _Batch, fill: Callable[[], object]) -> None:
        """``fill`` the batch, add what is due, send it; on any failure its claims are given back, then it raises."""
        try:
            fill()
            batch.records += self._due(self.clock(), batch)
            self._flush(batch)
        except BaseException:
            self._release(batch)
            raise

    def _flush(self, batch: _Batch) -> None:
        """Emit, then settle what was emitted (a failed emit releases it: the next attempt makes it again)."""
        try:
            if batch.records:
                self.emit(batch.records)
        except BaseException:
            self._release(batch)
            raise
        for event_id, key in batch.taken:
            self.state.settle(event_id, key)
            self._remember(event_id, key)
        batch.taken.clear()
        for event_id, token, due in batch.reschedules:
            self.state.reschedule(event_id, token, due)  # a newer set_open meanwhile wins: looked at again

    def _release(self, batch: _Batch) -> None:
        for event_id, key in batch.taken:
            try:
                self.state.release(event_id, key)
            except Exception as exc:  # noqa: BLE001 - its lease runs out: taken over then
                log.warning("could not release a decision of %s: %s", event_id, exc)
        batch.taken.clear()

    def _remember(self, event_id: str, key: str) -> None:
        if len(self._done) >= 100_000:
            self._done.clear()  # a bounded cache: forgetting costs a round trip, never a duplicate
        self._done.add((event_id, key))

    def _once(self, batch: _Batch, event_id: str, key: str) -> bool:
        """Claim a decision: True when this batch now makes it (its record is emitted, then it is settled)."""
        if (event_id, key) in batch.taken or (event_id, key) in self._done:
            return False
        if event_id not in batch.touched:
            # Before any claim: the event is looked at again after the lease, so the decisions this
            # instance takes are made by another one if it dies before settling them.
            self.state.set_open(event_id, self.clock() + self.recheck)
            batch.touched.add(event_id)
        answer = self.state.claim(event_id, key)
        if answer == TAKEN:
            batch.taken.append((event_id, key))
            return True
        if answer == BUSY:
            batch.busy.add(event_id)
        else:
            self._remember(event_id, key)
        return False

    def _view(self, event_id: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.state.rows(event_id, "platform").get("platform")
        return found

    def _reports(self, event_id: str) -> dict[str, dict[str, Any]]:
        return {row[len("report|"):]: value for row, value in self.state.rows(event_id, "report|").items()}

    def _platform_event(self, grid_event: Mapping[str, Any], batch: _Batch) -> None:
        event = scheduled_event(grid_event)
        props = event["props"]
        event_id, grid_id = props["EventId"], event["grid_id"]
        key = "grid|" + grid_id
        if (event_id, key) in batch.taken or (event_id, key) in self._done:
            claimed = DONE  # twice in one delivery, or settled here before
        else:
            claimed = self.state.claim(event_id, key)  # no recheck row: Event Grid delivers it again
        if claimed != TAKEN:
            batch.duplicates += 1  # Event Grid delivered this one before (same id): no second record
            batch.retry = batch.retry or claimed == BUSY  # ... or is delivering it to another instance now
            return
        batch.taken.append((event_id, key))
        when = event["time"].timestamp()

        def merge(view: dict[str, Any] | None) -> dict[str, Any]:
            old = view or {}
            names = list(dict.fromkeys([*old.get("resources", []), *event["resources"]]))
            # Event Grid does not keep order (and a delivery can be retried late): the newest status wins.
            latest = view is None or when >= old.get("status_time", old.get("first_time", when))
            return {
                "first_time": min(when, old.get("first_time", when)), "resources": names,
                "resource": event["resource"], "type": props.get("EventType"),
                "vm_ids": vm_resource_ids(event["resource"], names),
                "status": props.get("EventStatus") if latest else old.get("status"),
                "not_before": (props.get("NotBefore") or "") if latest else old.get("not_before", ""),
                "status_time": when if latest else old.get("status_time", when),
                # The delivery that created the view (its retry is still the event's first record).
                "created_by": old.get("created_by", grid_id),
            }
        # The view is written before any report is read (and a report before the view is read), so of
        # two instances handling both at once, at least one sees the other's.
        view = self.state.update(event_id, "platform", merge)
        status = props.get("EventStatus")
        kind = KINDS.get(status, "updated") if isinstance(status, str) else "updated"
        if kind == "scheduled" and view["created_by"] != grid_id:
            kind = "updated"  # a new NotBefore, Resources or Description of an event already scheduled
        batch.records.append(platform_record(event, kind))
        if view["created_by"] == grid_id:
            self.state.set_open(event_id, view["first_time"] + self.missed_after)
        reports = self._reports(event_id)
        for vm, report in reports.items():
            self._reported(batch, event_id, vm, view, report)
        if kind in TERMINAL:
            self._outcomes(batch, event_id, view, reports)

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
        kind = rtype.partition(".")[2]
        outcome = data.get("Outcome") if isinstance(data.get("Outcome"), str) else kind

        def merge(report: dict[str, Any] | None) -> dict[str, Any]:
            merged = dict(report or {"first_seen": seen.timestamp(), "name": name,
                                     "resource_id": vm_data.get("ResourceId")})
            merged["first_seen"] = min(merged["first_seen"], seen.timestamp())
            if kind in AGENT_TERMINAL:
                merged["outcome"] = "unknown" if outcome == "ended" else outcome
            return merged
        report = self.state.update(event_id, "report|" + vm, merge)
        view = self._view(event_id)
        if view is None:
            return  # the platform's delivery, when it comes, finds this report
        self._reported(batch, event_id, vm, view, report)
        if kind in AGENT_TERMINAL:
            self._outcomes(batch, event_id, view, {vm: report})

    def _fleet_record(self, kind: str, event_id: str, vm: str, data: dict[str, Any], when: float) -> dict[str, Any]:
        return {"specversion": "1.0", "id": str(uuid.uuid5(ID_NAMESPACE, f"fleet|{event_id}|{kind}|{vm}")),
                "source": "platform:reconciler", "type": f"fleet.{kind}", "subject": event_id, "time": _utc(when),
                "datacontenttype": "application/json", "eventkey": f"{event_id}:{kind}:{vm}",
                "data": {"EventId": event_id, **data}}

    def _reported(self, batch: _Batch, event_id: str, vm: str, view: dict[str, Any], report: dict[str, Any]) -> None:
        if not self._once(batch, event_id, "reported|" + vm):
            return
        detection = report["first_seen"] - view["first_time"]
        batch.records.append(self._fleet_record("reported", event_id, vm, {
            "EventType": view["type"], "Resources": view["resources"],
            "Vm": {"Name": report["name"], "ResourceId": report.get("resource_id")},
            "ReportedAt": _utc(report["first_seen"]), "PlatformTime": _utc(view["first_time"]),
            "DetectionSeconds": round(detection, 3),
            "Late": self.state.has(event_id, "missed|" + vm) or (event_id, "missed|" + vm) in batch.taken,
        }, self.clock()))

    def _outcomes(self, batch: _Batch, event_id: str, view: dict[str, Any], reports: dict[str, dict[str, Any]]) -> None:
        if KINDS.get(view["status"]) not in TERMINAL:
            return
        platform = KINDS[view["status"]]
        for vm, report in reports.items():
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
        """The open events' turn: every decision still to make (a dead instance's too), ``fleet.missed`` once due."""
        out: list[dict[str, Any]] = []
        for event_id, token in self.state.due(now):
            view = self._view(event_id)
            if view is None:  # agents reported an event the platform has not (yet): its delivery reopens it
                batch.reschedules.append((event_id, token, None))
                continue
            batch.touched.add(event_id)  # open already: a takeover's recheck is this row
            reports = self._reports(event_id)
            for vm, report in reports.items():
                self._reported(batch, event_id, vm, view, report)
            self._outcomes(batch, event_id, view, reports)
            missed_at = view["first_time"] + self.missed_after
            if now >= missed_at:
                reported = set(reports)
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
            if event_id in batch.busy:
                later: float | None = now + self.recheck  # another instance holds a decision: see it made
            else:
                later = missed_at if now < missed_at else None
            batch.reschedules.append((event_id, token, later))
        return out


__all__ = ["AGENT_TERMINAL", "DEFAULT_MISSED_AFTER", "Reconciler", "vm_name"]
