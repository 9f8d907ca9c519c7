"""The metrics people alert on: pending events, seconds to NotBefore, maintenance, actions.

Every label takes values from a fixed, small set (never an EventId, a VM name or free text: a
per-event label ran a peer tool out of memory), so the number of series is fixed however many
events come and go:

* ``sefwd.events.pending`` {type, status, affects_this_vm}: events in the committed document; every
  combination is reported, zeros included (7 types × 3 statuses × 2 = 42 series).
* ``sefwd.events.seconds_to_notbefore``: seconds to the earliest NotBefore of a Scheduled event that
  affects this VM (negative once it passed); absent while there is none.
* ``sefwd.maintenance.active``: 1 while the maintenance probe would answer 503 (forwarder.agent.maintenance).
* ``sefwd.actions`` {kind, outcome}: actions finished (hooks, approvals, undos), counted by
  :meth:`ActionCounter.finished`; at most ``MAX_LABEL_VALUES`` distinct values per label, later ones
  count as "other".
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forwarder.agent.maintenance import MaintenanceTracker

MAX_LABEL_VALUES = 16
_LABEL = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class BoundedLabel:
    """Maps free label values onto at most ``limit`` distinct ones (snake_case, ≤ 32 chars); the rest → "other"."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: object) -> str:
        text = str(value).strip().lower().replace("-", "_").replace(".", "_") if value is not None else ""
        if not _LABEL.match(text):
            return "other"
        if text in self._seen:
            return text
        with self._lock:
            if len(self._seen) >= self.limit:
                return "other"
            self._seen.add(text)
        return text


class ActionCounter:
    """``sefwd.actions`` by kind and outcome, with bounded label values."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self._kind = BoundedLabel()
        self._outcome = BoundedLabel()

    def finished(self, kind: str, outcome: str) -> None:
        self._counter.add(1, {"kind": self._kind(kind), "outcome": self._outcome(outcome)})


def register(meter: Any, tracker: Callable[[], MaintenanceTracker | None]) -> ActionCounter:
    """Create the instruments on ``meter``; the gauges read ``tracker()`` when collected (none yet: no points)."""
    from opentelemetry.metrics import CallbackOptions, Observation

    def pending(options: CallbackOptions) -> list[Observation]:
        current = tracker()
        if current is None:
            return []
        return [Observation(n, {"type": t, "status": s, "affects_this_vm": a})
                for (t, s, a), n in current.pending().items()]

    def seconds_to_not_before(options: CallbackOptions) -> list[Observation]:
        current = tracker()
        seconds = current.seconds_to_not_before() if current is not None else None
        return [] if seconds is None else [Observation(round(seconds, 3))]

    def active(options: CallbackOptions) -> list[Observation]:
        current = tracker()
        return [] if current is None else [Observation(0 if current.view().serving else 1)]

    meter.create_observable_gauge("sefwd.events.pending", [pending], "1",
                                  "Events in the current Scheduled Events document, by type, status and affects_this_vm")
    # Unit left empty: the name says seconds already (with "s" Prometheus would append another _seconds).
    meter.create_observable_gauge("sefwd.events.seconds_to_notbefore", [seconds_to_not_before], "",
                                  "Seconds to the earliest NotBefore of a Scheduled event affecting this VM "
                                  "(absent when there is none)")
    meter.create_observable_gauge("sefwd.maintenance.active", [active], "1",
                                  "1 while the maintenance probe answers 503 (an event of a configured type "
                                  "affecting this VM is pending, running or settling)")
    return ActionCounter(meter.create_counter("sefwd.actions", "1", "Actions finished, by kind and outcome"))
