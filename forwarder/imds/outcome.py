"""How did an event that left the document end? ``completed``, ``canceled`` or ``unknown``, from evidence.

IMDS never says: a finished and a called-off event both just disappear. This module is pure (no
I/O, no clock): the poller gathers the facts (``EvidenceContext``), the differ asks ``decide``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from forwarder.imds.document import Event

COMPLETED = "completed"
CANCELED = "canceled"
UNKNOWN = "unknown"
OUTCOMES = (COMPLETED, CANCELED, UNKNOWN)
# Fleet folding: the same EventId seen by many VMs ends as the strongest outcome any VM reports.
FOLD_ORDER = {COMPLETED: 2, UNKNOWN: 1, CANCELED: 0}
TERMINAL_KEY_SUFFIX = "ended"  # eventkey of every terminal record: "<EventId>:ended"

# Evidence codes, as they appear in data.Evidence.Used.
SEEN_STARTED = "seen_started"
APPROVAL_ACCEPTED = "approval_accepted"
# Seen Started long before NotBefore with no approval of this agent: another VM, or Azure Resource
# Manager (Microsoft.Maintenance acknowledge), approved it.
APPROVED_ELSEWHERE = "approved_elsewhere"
INCARNATION_JUMP = "incarnation_jump"
REBOOTED = "rebooted"
PAUSED = "paused"
GONE_BEFORE_NOT_BEFORE = "gone_before_notbefore"
NO_APPROVAL = "no_approval"
NO_UNSEEN_STATES = "no_unseen_states"
NO_REBOOT = "no_reboot"

# These end the VM's process when they run; a changed boot id says they ran.
REBOOT_TYPES = frozenset({"Reboot", "Redeploy", "Preempt", "Terminate"})
# "Gone long before NotBefore": this much earlier, so clock skew cannot turn a run into a cancel.
CANCEL_MARGIN = 60.0
# A stall of the agent this long (wall clock ahead of the monotonic clock, or a sleep between polls
# that lasted this much longer than asked) is a pause.
PAUSE_MIN = 1.0


@dataclass(frozen=True)
class EvidenceContext:
    """What the agent knows at the poll that finds events gone (all of it from its own observations)."""

    now: datetime
    approvals: Mapping[str, datetime] = field(default_factory=dict)  # lower-case EventId -> accepted at
    rebooted: bool | None = False  # the machine booted since the events were last seen; None: cannot tell
    rebooted_by: str | None = None  # what tells: "process", "boot_id", "boot_time" (forwarder.imds.evidence)
    pause_seconds: float = 0.0  # longest stall of the agent since the last document change
    vm_names: frozenset[str] = frozenset()  # this VM's names (lower case); empty: unknown
    # lower-case EventId -> when the agent saw it start early without its own approval (early_start)
    approved_elsewhere: Mapping[str, datetime] = field(default_factory=dict)

    def affects_this_vm(self, event: Event) -> bool | None:
        if not self.vm_names:
            return None
        return any(r.lstrip("_").lower() in self.vm_names for r in event.resources)


@dataclass(frozen=True)
class Outcome:
    """The decision and what it rests on."""

    outcome: str
    used: tuple[str, ...]
    facts: Mapping[str, Any]

    def to_data(self) -> dict[str, Any]:
        """``Outcome`` and ``Evidence`` fields of a terminal record's data."""
        return {"Outcome": self.outcome, "Evidence": {"Used": list(self.used), **self.facts}}


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


def decide(event: Event, context: EvidenceContext, unseen_states: int | None) -> Outcome:
    """Outcome of ``event`` (as last seen) that is gone now.

    ``unseen_states``: documents between the last two that this agent never saw (``unseen_states``
    below); None when the incarnation is missing, opaque, went back or stood still. Only 0
    supports ``canceled``.
    """
    now = context.now
    approved_at = context.approvals.get(event.event_id.lower())
    approved = approved_at is not None
    elsewhere_at = None if approved else context.approved_elsewhere.get(event.event_id.lower())
    due = event.not_before is not None and now >= event.not_before
    ahead = (event.not_before - now).total_seconds() if event.not_before is not None else None
    affects = context.affects_this_vm(event)
    facts: dict[str, Any] = {
        "LastSeenStatus": event.status,
        "UnseenStates": unseen_states,
        "ApprovedAt": _iso(approved_at),
        "ApprovedElsewhereAt": _iso(elsewhere_at),
        "Rebooted": context.rebooted,
        "RebootedBy": context.rebooted_by,
        "PauseSeconds": round(context.pause_seconds, 3),
        "SecondsBeforeNotBefore": round(ahead, 3) if ahead is not None else None,
    }
    used: list[str] = []
    if event.started:
        used.append(SEEN_STARTED)
    if approved:
        used.append(APPROVAL_ACCEPTED)  # approval by a VM in Resources lets it start at once
    if elsewhere_at is not None:
        used.append(APPROVED_ELSEWHERE)
    if unseen_states and (due or approved):
        used.append(INCARNATION_JUMP)
    if context.rebooted and event.event_type in REBOOT_TYPES and affects:
        used.append(REBOOTED)
    if event.event_type == "Freeze" and context.pause_seconds >= PAUSE_MIN and affects:
        used.append(PAUSED)
    if used:
        return Outcome(COMPLETED, tuple(used), facts)
    if (ahead is not None and ahead >= CANCEL_MARGIN and unseen_states == 0 and context.rebooted is False
            and context.pause_seconds < PAUSE_MIN):
        return Outcome(CANCELED, (GONE_BEFORE_NOT_BEFORE, NO_APPROVAL, NO_UNSEEN_STATES, NO_REBOOT), facts)
    return Outcome(UNKNOWN, (), facts)


def early_start(before: Event, after: Event, context: EvidenceContext, unseen: int | None) -> dict[str, Any] | None:
    """``data.EarlyStart`` of a Scheduled -> Started change seen at least ``CANCEL_MARGIN`` before NotBefore.

    IMDS starts an unapproved event at its NotBefore, never before; seen Started a minute or more
    earlier, someone approved it: this agent (an accepted approval) or, without one, another VM of
    the event or Azure Resource Manager. Only when no state went unseen (``unseen == 0``): a NotBefore
    moved earlier in a document the agent missed would explain an early start too.
    """
    if before.started or not after.started or before.not_before is None or unseen != 0:
        return None
    ahead = (before.not_before - context.now).total_seconds()
    if ahead < CANCEL_MARGIN:
        return None
    mine = before.event_id.lower() in context.approvals
    return {"ApprovedBy": "this_vm" if mine else "elsewhere", "SecondsBeforeNotBefore": round(ahead, 3)}


def unseen_states(before: object, after: object) -> int | None:
    """Documents between the last two that this agent never saw: the incarnation step minus one.

    IMDS raises ``DocumentIncarnation`` once per document change, not once per event change: one
    step may add, update and remove several events, so a step larger than one means unseen
    documents whatever changed visibly (issue 20). None unless both are integers and the
    counter went up: a counter that went back (IMDS reset it) or stood still while the document
    changed proves nothing.
    """
    if not isinstance(before, int) or not isinstance(after, int) or isinstance(before, bool) or isinstance(after, bool):
        return None
    if after <= before:
        return None
    return after - before - 1


def fold(outcomes: Iterable[str]) -> str:
    """One outcome per event fleet-wide: completed beats unknown beats canceled."""
    best = None
    for outcome in outcomes:
        if outcome in FOLD_ORDER and (best is None or FOLD_ORDER[outcome] > FOLD_ORDER[best]):
            best = outcome
    return best or UNKNOWN


def terminal_key(event_id: str) -> str:
    """The one fleet-wide eventkey of an event's terminal record, whatever its outcome."""
    return f"{event_id}:{TERMINAL_KEY_SUFFIX}"
