"""The emulated platform: events, DocumentIncarnation, VMs, counters and the timeline thread."""
from __future__ import annotations

import copy
import functools

import heapq
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from forwarder.emulator.model import (
    DEFAULT_DESCRIPTIONS, MIN_NOTICE, SCHEDULED, SE_VERSIONS, SPEC_KEYS, STARTED, UPDATE_KEYS, Event,
    SpecError, VmProfile, normalize_spec, parse_not_before,
)
from forwarder.emulator.scenario import Scenario, Step

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Timeline:
    """Runs callbacks at monotonic deadlines on one daemon thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="emulator-timeline", daemon=True)
        self._thread.start()

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay), next(self._seq), fn))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # a broken step must not kill the timeline
                log.exception("emulator timeline callback failed")


class Platform:
    """All emulator state behind one lock; the HTTP layer and the Python API both drive it."""

    def __init__(
        self,
        vms: list[VmProfile],
        *,
        time_scale: float = 1.0,
        clock: Clock | None = None,
        terminate_notice: float = MIN_NOTICE["Terminate"],
        rate_limit: float | None = 5,
        token_rate_limit: float | None = 20,
        token_concurrency: int | None = 5,
    ) -> None:
        if not vms:
            vms = [VmProfile(name="myVM")]
        self.lock = threading.RLock()
        self.vms: dict[str, VmProfile] = {vm.name: vm for vm in vms}
        self.default_vm = vms[0].name
        self.time_scale = time_scale
        self.clock = clock or _utcnow
        self.terminate_notice = terminate_notice
        self.rate_limit = rate_limit
        self.token_rate_limit = token_rate_limit
        self.token_concurrency = token_concurrency
        self._tokens_in_flight: dict[str, int] = {}
        # access token -> (audience, the VM whose managed identity got it): checked by the ARM side
        self.issued_tokens: dict[str, tuple[str, str]] = {}
        self.timeline = Timeline()
        self.finished = threading.Event()
        self.events: dict[str, Event] = {}
        # One DocumentIncarnation per api-version: it moves only when the document that version
        # renders changes (a Terminate is no change at all for a 2017-08-01 client).
        self._incarnations: dict[str, int] = dict.fromkeys(SE_VERSIONS, 1)
        self._rendered: dict[str, list[dict[str, Any]]] = {v: [] for v in SE_VERSIONS}
        self._scenario: Scenario | None = None
        self._scenario_gen = 0
        # Called with (change, a copy of the event, when) on every visible change (see _bump).
        self.listeners: list[Callable[[str, Event, datetime], None]] = []
        self._steps_left = 0
        self._reset_counters()

    # -- counters -----------------------------------------------------------------------------

    def _reset_counters(self) -> None:
        self.requests: dict[str, dict[str, Any]] = {}
        self.start_requests: list[dict[str, Any]] = []
        self.token_requests = 0
        self.history: list[dict[str, Any]] = []
        self._hits: dict[str, deque[float]] = {}
        self._first_call_done: set[str] = set()

    def count(self, vm: str, method: str, endpoint: str, status: int | str) -> None:
        with self.lock:
            c = self.requests.setdefault(vm, {"GET": 0, "POST": 0, "other": 0, "by_status": {}, "by_endpoint": {},
                                              "token": 0})
            c[method if method in ("GET", "POST") else "other"] += 1
            c["by_status"][str(status)] = c["by_status"].get(str(status), 0) + 1
            c["by_endpoint"][endpoint] = c["by_endpoint"].get(endpoint, 0) + 1
            if endpoint == "token":
                c["token"] += 1
                self.token_requests += 1

    def allow(self, vm: str, endpoint: str = "scheduledevents") -> bool:
        """Sliding one-second window per VM; throttled requests do not use up the budget.

        IMDS documents 5 requests/s per VM, and 20/s for the managed-identity token endpoint, which
        has its own budget here.
        """
        token = endpoint == "token"
        limit = self.token_rate_limit if token else self.rate_limit
        if not limit:
            return True
        now = time.monotonic()
        with self.lock:
            hits = self._hits.setdefault(f"{vm}\0token" if token else vm, deque())
            while hits and hits[0] <= now - 1.0:
                hits.popleft()
            if len(hits) >= limit:
                return False
            hits.append(now)
            return True

    def token_slot_acquire(self, vm: str) -> bool:
        """Take one of the token endpoint's concurrent slots (IMDS: 5 per VM); False when none is free."""
        with self.lock:
            busy = self._tokens_in_flight.get(vm, 0)
            if self.token_concurrency and busy >= self.token_concurrency:
                return False
            self._tokens_in_flight[vm] = busy + 1
            return True

    def token_slot_release(self, vm: str) -> None:
        with self.lock:
            self._tokens_in_flight[vm] = max(0, self._tokens_in_flight.get(vm, 0) - 1)

    def first_call(self, vm: str) -> bool:
        """True exactly once per VM: the call that "enables" Scheduled Events."""
        with self.lock:
            if vm in self._first_call_done:
                return False
            self._first_call_done.add(vm)
            return True

    # -- documents ----------------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        """DocumentIncarnation at the newest api-version (which sees every change)."""
        return self._incarnations[SE_VERSIONS[-1]]

    def _events(self, version: str) -> list[dict[str, Any]]:
        return [ev.render(version) for ev in self.events.values() if ev.visible_in(version)]

    def document(self, version: str) -> dict[str, Any]:
        with self.lock:
            return {"DocumentIncarnation": self._incarnations[version], "Events": self._events(version)}

    def _bump(self, change: str, event_id: str, ev: Event | None = None) -> None:
        """Record a change; each api-version's incarnation goes up only if its document changed.

        Listeners (the Event Grid side, forwarder.emulator.eventgrid) hear of every visible change of
        an event, under the lock: they must only take note (a copy of the event) and return.
        """
        for version in SE_VERSIONS:
            events = self._events(version)
            if events != self._rendered[version]:
                self._rendered[version] = events
                self._incarnations[version] += 1
            elif version == SE_VERSIONS[-1]:
                return  # the newest version sees every field: nothing visible changed at all
        now = self.clock()
        self.history.append({"incarnation": self.incarnation, "change": change, "event_id": event_id,
                             "time": now.isoformat()})
        if ev is not None:
            for listener in self.listeners:
                listener(change, copy.deepcopy(ev), now)
        log.info("emulator: %s %s (DocumentIncarnation %d)", change, event_id, self.incarnation)

    def ensure_vm(self, name: str) -> None:
        if name not in self.vms:
            self.vms[name] = VmProfile(name=name)

    # -- lifecycle ----------------------------------------------------------------------------

    def schedule(self, spec: dict[str, Any]) -> str:
        """Add an event (Scheduled, or Started for a hardware failure); returns its EventId."""
        spec = normalize_spec(spec, allowed=SPEC_KEYS)
        now = self.clock()
        etype = spec.get("type", "Reboot")
        source = spec.get("source", "User" if etype == "Terminate" else "Platform")
        status = spec.get("status", SCHEDULED)
        notice = self.terminate_notice if etype == "Terminate" else MIN_NOTICE[etype]
        not_before = self._not_before(spec, now) or now + timedelta(seconds=notice * self.time_scale)
        description = spec.get("description", DEFAULT_DESCRIPTIONS.get((etype, source), ""))
        duration = spec.get("duration", -1)
        with self.lock:
            event_id = spec.get("id") or str(uuid.uuid4()).upper()
            if event_id in self.events:
                raise SpecError(f"event {event_id} already exists")
            resources = list(spec.get("resources") or [self.default_vm])
            for name in resources:
                self.ensure_vm(name)
            ev = Event(
                id=event_id, type=etype, resources=resources, status=status,
                not_before=not_before, description=description, source=source, duration=duration,
                resource_type=spec.get("resource_type", "VirtualMachine"),
                require_all_approvals=bool(spec.get("require_all_approvals", False)),
                complete_after=(spec["complete_after"] if "complete_after" in spec
                                else float(duration) if duration > 0 else 2.0) * self.time_scale,
            )
            if status == STARTED:
                ev.started_by = "platform"
            self.events[event_id] = ev
            self._bump("hardware-failure" if status == STARTED else "scheduled", event_id, ev)
            if status == STARTED:
                self._arm_completion(ev)
            else:
                self._arm_auto_start(ev)
        return event_id

    def _not_before(self, spec: dict[str, Any], now: datetime) -> datetime | None:
        """NotBefore from ``not_before`` or ``start_after`` (its shorthand), relative times scaled."""
        if "not_before" in spec and "start_after" in spec:
            # One start time only: an unapproved event starts exactly at its NotBefore, never before.
            raise SpecError("give not_before or start_after (NotBefore = now + start_after), not both")
        if "start_after" in spec:
            return now + timedelta(seconds=spec["start_after"] * self.time_scale)
        if "not_before" in spec:
            return parse_not_before(spec["not_before"], now, self.time_scale)
        return None

    def _arm_auto_start(self, ev: Event) -> None:
        # IMDS: "guaranteed to not start before this time". Unapproved events start at NotBefore.
        ev.timer_gen += 1
        gen = ev.timer_gen
        nb = ev.not_before or self.clock()
        delay = max(0.0, (nb - self.clock()).total_seconds())
        self.timeline.call_later(delay, lambda: self._timer_start(ev.id, gen))

    def _arm_completion(self, ev: Event) -> None:
        ev.timer_gen += 1
        gen = ev.timer_gen
        self.timeline.call_later(ev.complete_after, lambda: self._timer_complete(ev.id, gen))

    def _timer_start(self, event_id: str, gen: int) -> None:
        with self.lock:
            ev = self.events.get(event_id)
            if ev is not None and ev.timer_gen == gen and ev.status == SCHEDULED:
                self._start(ev, "not-before")

    def _timer_complete(self, event_id: str, gen: int) -> None:
        with self.lock:
            ev = self.events.get(event_id)
            if ev is not None and ev.timer_gen == gen and ev.status == STARTED:
                self._remove(ev, "completed")

    def _start(self, ev: Event, by: str) -> None:
        ev.status = STARTED
        ev.started_by = by
        self._bump(f"started ({by})", ev.id, ev)
        self._arm_completion(ev)

    def _remove(self, ev: Event, change: str) -> None:
        ev.timer_gen += 1
        del self.events[ev.id]
        self._bump(change, ev.id, ev)
        self._check_finished()

    def _get(self, event_id: str) -> Event:
        ev = self.events.get(event_id)
        if ev is None:
            raise KeyError(f"no event {event_id!r}")
        return ev

    def start_event(self, event_id: str, by: str = "api") -> None:
        """Move a Scheduled event to Started now (no-op if already Started)."""
        with self.lock:
            ev = self._get(event_id)
            if ev.status == SCHEDULED:
                self._start(ev, by)

    def cancel(self, event_id: str) -> None:
        """Remove an event as Azure does when it calls maintenance off."""
        with self.lock:
            ev = self._get(event_id)
            self._remove(ev, "canceled" if ev.status == SCHEDULED else "completed")

    def complete(self, event_id: str) -> None:
        """Remove an event now (its impact is over)."""
        with self.lock:
            self._remove(self._get(event_id), "completed")

    def update(self, event_id: str, fields: dict[str, Any]) -> None:
        """Change fields of a live event; visible changes bump DocumentIncarnation."""
        fields = normalize_spec(fields, allowed=UPDATE_KEYS)
        with self.lock:
            ev = self._get(event_id)
            if "type" in fields:
                ev.type = fields["type"]
            if "source" in fields:
                ev.source = fields["source"]
            if "description" in fields:
                ev.description = fields["description"]
            if "duration" in fields:
                ev.duration = fields["duration"]
            if "resources" in fields:
                ev.resources = list(fields["resources"])
                for name in ev.resources:
                    self.ensure_vm(name)
            not_before = self._not_before(fields, self.clock())
            if not_before is not None:
                ev.not_before = not_before
            if "complete_after" in fields:
                ev.complete_after = fields["complete_after"] * self.time_scale
            if ev.status == SCHEDULED and not_before is not None:
                self._arm_auto_start(ev)
            elif ev.status == STARTED and "complete_after" in fields:
                self._arm_completion(ev)
            self._bump("updated", ev.id, ev)

    def approve(self, vm: str, version: str, event_ids: list[str], incarnation: object, *,
                via: str = "imds") -> str | None:
        """Handle a POST StartRequests (``via`` "arm": an ARM acknowledgement); an error message for a 400, else None."""
        with self.lock:
            by_key = {ev.id.lower(): ev for ev in self.events.values() if ev.visible_in(version)}
            unknown = [i for i in event_ids if i.lower() not in by_key]
            self.start_requests.append({"vm": vm, "event_ids": list(event_ids), "api_version": version,
                                        "document_incarnation": incarnation, "accepted": not unknown, "via": via,
                                        "time": self.clock().isoformat()})
            if unknown:
                return f"Bad request. Unknown EventId: {', '.join(unknown)}"
            for event_id in event_ids:
                ev = by_key[event_id.lower()]
                if vm not in ev.approvals:
                    ev.approvals.append(vm)
                if ev.status != SCHEDULED:
                    continue
                if ev.require_all_approvals and not set(ev.resources) <= set(ev.approvals):
                    continue
                self._start(ev, f"approved by {vm}")
            return None

    # -- scenarios ----------------------------------------------------------------------------

    def run_scenario(self, scenario: Scenario) -> None:
        """Queue every step of the scenario on the timeline, relative to now."""
        with self.lock:
            self._scenario = scenario
            self._scenario_gen += 1
            gen = self._scenario_gen
            self._steps_left = len(scenario.steps)
            self.finished.clear()
            for vm in scenario.vms:
                self.vms.setdefault(vm.name, vm)
            for step in scenario.steps:
                self.timeline.call_later(step.at * self.time_scale, functools.partial(self._run_step, step, gen))
            self._check_finished()

    def _run_step(self, step: Step, gen: int) -> None:
        with self.lock:
            if gen != self._scenario_gen or self._steps_left <= 0:
                return
            args = dict(step.args)
            try:
                if step.action == "schedule":
                    self.schedule(args)
                elif step.action == "start":
                    self.start_event(args["id"], by="scenario")
                elif step.action == "approve":
                    self.approve_as(args["id"], args.get("vm"))
                elif step.action == "cancel":
                    self.cancel(args["id"])
                elif step.action == "complete":
                    self.complete(args["id"])
                elif step.action == "update":
                    self.update(args.pop("id"), args)
                elif step.action == "fault":
                    self.on_fault_step(args)
            except KeyError as exc:
                # An approval can finish an event before a later step names it: that is not an error.
                log.info("emulator: scenario step %s at %gs skipped: %s", step.action, step.at, exc)
            self._steps_left = 0 if step.action == "end" else self._steps_left - 1
            self._check_finished()

    def approve_as(self, event_id: str, vm: str | None = None) -> None:
        """A VM of the availability set POSTs StartRequests (by default the last in Resources)."""
        with self.lock:
            ev = self._get(event_id)
            self.approve(vm or ev.resources[-1], SE_VERSIONS[-1], [ev.id], None)

    def on_fault_step(self, spec: dict[str, Any]) -> None:
        """Replaced by the server to route scenario faults into its queue."""

    def _check_finished(self) -> None:
        if self._scenario is not None and self._steps_left <= 0 and not self.events and not self.finished.is_set():
            log.info("emulator: scenario %s finished", self._scenario.name)
            self.finished.set()

    def reset(self) -> None:
        """Drop events, counters and the running scenario; DocumentIncarnation keeps counting up."""
        with self.lock:
            self._scenario_gen += 1
            self._scenario = None
            self._steps_left = 0
            had_events = bool(self.events)
            for ev in self.events.values():
                ev.timer_gen += 1
            self.events.clear()
            self._reset_counters()
            if had_events:
                self._bump("reset", "*")
            self.finished.clear()

    def snapshot(self) -> dict[str, Any]:
        """Everything tests and the control API want to assert on."""
        with self.lock:
            events = []
            for ev in self.events.values():
                item = ev.render(SE_VERSIONS[-1])
                item["Approvals"] = list(ev.approvals)
                item["StartedBy"] = ev.started_by
                events.append(item)
            return {
                "incarnation": self.incarnation,
                "events": events,
                "vms": {name: {"url_prefix": f"/vm/{name}", "default": name == self.default_vm, **vm.compute()}
                        for name, vm in self.vms.items()},
                "requests": {vm: {**c, "by_status": dict(c["by_status"]), "by_endpoint": dict(c["by_endpoint"])}
                             for vm, c in self.requests.items()},
                "start_requests": [dict(r) for r in self.start_requests],
                "token_requests": self.token_requests,
                "tokens_in_flight": {vm: n for vm, n in self._tokens_in_flight.items() if n},
                "history": [dict(h) for h in self.history],
                "scenario": self._scenario.name if self._scenario else None,
                "finished": self.finished.is_set(),
            }
