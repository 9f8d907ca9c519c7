"""Compare two documents and say what changed: a pure function, no I/O, no clock of its own."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from datetime import datetime

from forwarder.imds.document import Document, Event
from forwarder.imds.outcome import CANCELED as OUTCOME_CANCELED
from forwarder.imds.outcome import COMPLETED as OUTCOME_COMPLETED
from forwarder.imds.outcome import EvidenceContext, Outcome, decide, early_start, unseen_states

SCHEDULED = "scheduled"
STARTED = "started"
UPDATED = "updated"
COMPLETED = "completed"
CANCELED = "canceled"
GONE = "ended"  # gone, and no evidence says whether it ran (data.Outcome "unknown")
KINDS = (SCHEDULED, STARTED, UPDATED, COMPLETED, CANCELED, GONE)
TERMINAL_KINDS = (COMPLETED, CANCELED, GONE)
_KIND_OF_OUTCOME = {OUTCOME_COMPLETED: COMPLETED, OUTCOME_CANCELED: CANCELED}

# Why an event left the document; "Completed" is never sent by IMDS, so this is inferred.
ENDED = "ended"  # it had been seen Started
# Where the event was, never a conclusion: completed and ended records carry it too (data.Outcome says how it ended).
GONE_BEFORE_NOT_BEFORE = "gone_before_notbefore"  # gone while Scheduled, before NotBefore
GONE_AFTER_NOT_BEFORE = "ran_or_canceled_unobserved"  # gone while Scheduled, after NotBefore


@dataclass(frozen=True, slots=True)
class Change:
    """One change of one event between two documents."""

    kind: str
    event: Event  # the event as it is now (for removals: as last seen)
    previous: Event | None
    changed_fields: tuple[str, ...] = ()
    removal_reason: str | None = None
    initial: bool = False
    outcome: Outcome | None = None  # terminal changes: the decision and its evidence
    early_start: dict[str, Any] | None = None  # started changes: data.EarlyStart (outcome.early_start)

    @property
    def previous_status(self) -> str | None:
        return self.previous.status if self.previous else None


def changed_fields(before: Event, after: Event) -> tuple[str, ...]:
    """IMDS field names whose values differ (fields that appeared or vanished count)."""
    a, b = before.comparable(), after.comparable()
    return tuple(sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) or (k in a) != (k in b)))


def _removal_reason(event: Event, now: datetime) -> str:
    if event.started:
        return ENDED
    if event.not_before is not None and now < event.not_before:
        return GONE_BEFORE_NOT_BEFORE
    return GONE_AFTER_NOT_BEFORE


def diff(previous: Document | None, current: Document, now: datetime,
         evidence: EvidenceContext | None = None) -> list[Change]:
    """Changes from ``previous`` to ``current``; ``previous=None`` means a fresh install.

    A status change is one ``started`` change listing every other changed field, never an
    extra ``updated`` beside it. Order: current events in document order, then removals, whose
    kind (completed / canceled / ended) ``forwarder.imds.outcome.decide`` takes from ``evidence``
    (default: a continuously running agent that approved nothing).
    """
    if previous is None:
        return [
            Change(STARTED if e.started else SCHEDULED, e, None, initial=True) for e in current.events
        ]
    before = previous.by_id()
    changes: list[Change] = []
    for event in current.events:
        old = before.get(event.event_id)
        if old is None:
            # Hardware failure skips Scheduled and appears as Started.
            changes.append(Change(STARTED if event.started else SCHEDULED, event, None))
            continue
        fields = changed_fields(old, event)
        if not fields:
            continue
        if event.started and not old.started:
            changes.append(Change(STARTED, event, old, fields))
        else:
            changes.append(Change(UPDATED, event, old, fields))
    present = {e.event_id for e in current.events}
    gone = [old for old in previous.events if old.event_id not in present]
    context = evidence or EvidenceContext(now=now)
    unseen = unseen_states(previous.incarnation, current.incarnation)
    for i, change in enumerate(changes):
        if change.kind == STARTED and change.previous is not None:
            early = early_start(change.previous, change.event, context, unseen)
            if early is not None:
                changes[i] = replace(change, early_start=early)
    if gone:
        for old in gone:
            outcome = decide(old, context, unseen)
            kind = _KIND_OF_OUTCOME.get(outcome.outcome, GONE)
            changes.append(Change(kind, old, old, removal_reason=_removal_reason(old, now), outcome=outcome))
    return changes
