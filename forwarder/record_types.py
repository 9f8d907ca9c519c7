"""Every record type the agent emits: the one list that the record factory and the sink filters both use."""
from __future__ import annotations

from forwarder.approval.settings import OUTCOMES as _DECISIONS
from forwarder.imds.differ import KINDS as _CHANGES

EVENT_TYPE_PREFIX = "scheduledevent."
SCHEDULED_EVENT = EVENT_TYPE_PREFIX.rstrip(".")
# approval.<outcome>: the decisions (approved, refused, failed, held) and the action steps the planner
# and the action workers audit (forwarder.approval.planner: planned, superseded, skipped, ran).
APPROVAL_OUTCOMES = (*_DECISIONS, "planned", "superseded", "skipped", "ran")
# protect.<what>: this VM's hold (forwarder.protect): out of service (entered), back (left), or a
# protection that failed (missed: a drain failed or hit its deadline, an event started first, an undo failed).
PROTECT_OUTCOMES = ("entered", "left", "missed")
LIFECYCLE_TYPES = ("forwarder.started", "forwarder.heartbeat", "forwarder.stopped", "forwarder.data_lost")
RECORD_FAMILIES = (SCHEDULED_EVENT, "approval", "protect", "forwarder")
RECORD_TYPES = (
    *RECORD_FAMILIES,
    *(EVENT_TYPE_PREFIX + kind for kind in _CHANGES),
    *(f"approval.{outcome}" for outcome in APPROVAL_OUTCOMES),
    *(f"protect.{outcome}" for outcome in PROTECT_OUTCOMES),
    *LIFECYCLE_TYPES,
)
