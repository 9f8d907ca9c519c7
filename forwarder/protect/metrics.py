"""Metrics of this VM's hold, from its protect.* records as they are journaled.

* ``sefwd.protect.drain_slack`` (histogram, s): NotBefore minus the moment enter finished, one point
  per hold with a NotBefore: how close each drain came to the deadline (negative: it finished late).
* ``sefwd.protect.drain_slack.last`` (gauge, s): the last hold's slack (absent until one finished).
* ``sefwd.protect.held`` (gauge): 1 from the moment enter finished until leave did, else 0.
* ``sefwd.protect.missed`` {reason} (counter): protections that failed (an enter failed or hit its
  deadline, an event started before the enter finished, a leave failed); bounded reason values.
"""
from __future__ import annotations

from typing import Any

import orjson

from forwarder.agent.alert_metrics import BoundedLabel
from forwarder.sinkapi import Record

SLACK_BUCKETS = (-60.0, -10.0, 0.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 86400.0)


class ProtectMetrics:
    """The instruments on ``meter``; :meth:`observe` takes every journaled record (ignores all but protect.*)."""

    def __init__(self, meter: Any) -> None:
        from opentelemetry.metrics import CallbackOptions, Observation

        self._slack = meter.create_histogram(
            "sefwd.protect.drain_slack", "s", "NotBefore minus the moment this VM's enter (drain) finished",
            explicit_bucket_boundaries_advisory=SLACK_BUCKETS)
        self._missed = meter.create_counter("sefwd.protect.missed", "1",
                                            "Protections that failed (protect.missed records), by reason")
        self._reason = BoundedLabel()
        self.last_slack: float | None = None
        self.held: int | None = None

        def last(options: CallbackOptions) -> list[Observation]:
            return [] if self.last_slack is None else [Observation(self.last_slack)]

        def held(options: CallbackOptions) -> list[Observation]:
            return [] if self.held is None else [Observation(self.held)]

        meter.create_observable_gauge("sefwd.protect.drain_slack.last", [last], "s",
                                      "The last drain's slack: NotBefore minus the moment enter finished")
        meter.create_observable_gauge("sefwd.protect.held", [held], "1",
                                      "1 while this VM is out of service (enter finished, leave not yet)")

    def observe(self, record: Record) -> None:
        if not record.type.startswith("protect."):
            return
        try:
            data = orjson.loads(record.body).get("data") or {}
        except (ValueError, AttributeError):
            return
        if data.get("DryRun"):
            return
        outcome = record.type.partition(".")[2]
        if outcome == "entered":
            self.held = 1
            slack = data.get("DrainSlackSeconds")
            if isinstance(slack, int | float) and not isinstance(slack, bool):
                self.last_slack = float(slack)
                self._slack.record(float(slack))
        elif outcome == "left":
            self.held = 0
        elif outcome == "missed":
            self._missed.add(1, {"reason": self._reason(data.get("Reason"))})
