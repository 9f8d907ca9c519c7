"""Plan actions from committed changes: hook runs, approvals by policy, undo hooks.

``Planner.plan`` runs inside the poller's transaction (the one committing the changes' records),
so a change and the actions it calls for are durable together or not at all. Nothing runs here:
rows are inserted ``planned`` with a due time; the audit entries of what was planned
(``approval.planned``, ``.held``, ``.superseded``) are returned, and the poller commits them as
records in the same transaction. An ``updated`` change supersedes the event's pending actions
(``approval.superseded``) and plans afresh; a terminal change supersedes what never ran.
"""
from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forwarder.approval.approver import HELD, audit_entry
from forwarder.approval.policy import APPROVE, HOLD, decide
from forwarder.approval.settings import UNDO_KINDS, ApprovalConfig, HookSpec, Rule
from forwarder.imds.differ import SCHEDULED, STARTED, TERMINAL_KINDS, UPDATED, Change
from forwarder.imds.document import Document, Event
from forwarder.imds.identity import VmIdentity
from forwarder.records import rfc3339
from forwarder.sinkapi import Record
from forwarder.store import actions as rows
from forwarder.store.actions import HOOK, UNDO, Action, NewAction
from forwarder.store.database import Store

log = logging.getLogger(__name__)

PLANNED, SUPERSEDED, SKIPPED, RAN = "planned", "superseded", "skipped", "ran"


def _when(epoch: float | None) -> str | None:
    from datetime import datetime, timezone

    return rfc3339(datetime.fromtimestamp(epoch, timezone.utc)) if epoch is not None else None


def action_audit(outcome: str, reason: str, action: Action | NewAction, *, action_id: int | None = None,
                 state: str | None = None, **fields: Any) -> dict[str, Any]:
    """The audit entry of an action's step (planned, superseded, ran, skipped, approved ...)."""
    aid = action.id if isinstance(action, Action) else action_id
    info = {
        "Id": aid, "Kind": action.kind, "State": state or (action.state if isinstance(action, Action) else rows.PLANNED),
        "Change": action.change, "HookName": action.hook, "Due": _when(action.due), "Deadline": _when(action.deadline),
        "Attempts": action.attempts if isinstance(action, Action) else 0,
    }
    actor = fields.pop("actor", None) or action.actor or ("hook" if action.kind in (HOOK, UNDO) else "policy")
    fields.setdefault("DocumentIncarnation", action.incarnation)
    fields.setdefault("DryRun", action.dry_run)
    return audit_entry(outcome, actor, reason, EventIds=[action.event_id], Rule=action.rule, Action=info, **fields)


def hook_due(spec: HookSpec | Rule, event: Event, now: float) -> float:
    """Not earlier than NotBefore − ``at``; at once when the notice is shorter (or there is no ``at``)."""
    if spec.at is None or event.not_before is None:
        return now
    return max(now, event.not_before.timestamp() - spec.at)


class Planner:
    """Turns committed changes into action rows (inside the committing transaction)."""

    def __init__(self, config: ApprovalConfig, vm: Callable[[], VmIdentity], store: Store,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.vm = vm
        self.store = store
        self.clock = clock
        self._entries: list[dict[str, Any]] | None = None  # collected by plan(); None: queued in the inbox
        # With [protect]: the enter action of this VM's hold holding the event (None: the event is not
        # held), planned earlier in the same transaction; an approval after hooks waits for it.
        self.gate_for: Callable[[sqlite3.Connection, Event], int | None] | None = None

    # -- the poller's transaction ------------------------------------------------------------
    def plan(self, c: sqlite3.Connection, changes: Sequence[Change], records: Sequence[Record],
             document: Document) -> list[dict[str, Any]]:
        """Insert the rows the changes call for; returns their audit entries."""
        now = self.clock()
        entries: list[dict[str, Any]] = []
        self._entries = entries
        try:
            for change, record in zip(changes, records, strict=True):
                self._plan_change(c, change, record.to_dict(), document, now)
        finally:
            self._entries = None
        return entries

    def _plan_change(self, c: sqlite3.Connection, change: Change, record: Mapping[str, Any], document: Document,
                     now: float) -> None:
        event = change.event
        replan: list[str] = []
        if change.kind in (UPDATED, STARTED) or change.kind in TERMINAL_KINDS:
            reason = "event_updated" if change.kind == UPDATED else f"event_{change.kind}"
            for old in self._supersede(c, event.event_id, reason, now):
                if change.kind == UPDATED and old.kind == HOOK and old.hook and old.hook not in replan:
                    replan.append(old.hook)  # the drain planned for the old version, planned afresh
        gate: int | None = None
        own = self.config.hooks.get(change.kind)
        names = replan + ([change.kind] if own is not None and change.kind not in replan else [])
        for name in names:
            spec = self.config.hooks.get(name)
            if spec is not None and not (event.started and name != change.kind):
                planned = self._plan_hook(c, name, spec, change, record, document, now)
                gate = planned if planned is not None and name not in UNDO_KINDS else gate
        if self._policy_applies(change):
            self._plan_policy(c, change, record, document, now, gate)

    def _policy_applies(self, change: Change) -> bool:
        return bool(self.config.rules) and change.kind in (SCHEDULED, UPDATED) and change.event.status == "Scheduled"

    def _queue(self, c: sqlite3.Connection, entry: dict[str, Any]) -> None:
        if self._entries is not None:
            self._entries.append(entry)
        else:  # at start, outside the poller's commit: the inbox, in the same transaction
            self.store.inbox_put(c, entry)

    def _supersede(self, c: sqlite3.Connection, event_id: str, reason: str, now: float) -> list[Action]:
        gone: list[Action] = []
        for old in rows.pending_of(c, event_id):
            if rows.finish(c, old.id, rows.SUPERSEDED, {"Outcome": SUPERSEDED, "Reason": reason}, now,
                           only_from=(rows.PLANNED, rows.DUE)):
                self._queue(c, action_audit(SUPERSEDED, reason, old, state=rows.SUPERSEDED))
                gone.append(old)
                if old.kind == HOOK and reason == "event_started":
                    # It started (approved elsewhere, or the platform did not wait) before this hook ran.
                    log.warning("%s started before its %s hook (action %d) ran: the hook will not run",
                                event_id, old.hook, old.id)
        return gone

    def _insert(self, c: sqlite3.Connection, action: NewAction, now: float) -> int:
        action_id = rows.insert(c, action, now)
        self._queue(c, action_audit(PLANNED, "dry_run" if action.dry_run else "planned", action, action_id=action_id))
        log.info("%splanned %s action %d for %s (%s%s), due %s", "dry run: " if action.dry_run else "", action.kind,
                 action_id, action.event_id, action.hook or "", action.rule or "", _when(action.due))
        return action_id

    def _plan_hook(self, c: sqlite3.Connection, name: str, spec: HookSpec, change: Change,
                   record: Mapping[str, Any], document: Document, now: float) -> int | None:
        event = change.event
        if spec.event_types is not None and event.event_type not in spec.event_types:
            return None
        if spec.affects_this_vm and event.resources and self.vm().affected_by(event.resources) is False:
            return None  # another VM's event (an unknown own name, or Resources naming none, counts as ours)
        kind = UNDO if name in UNDO_KINDS else HOOK
        if kind == UNDO and c.execute("SELECT 1 FROM actions WHERE kind = ? AND event_id = ? AND hook = ?",
                                      (UNDO, event.event_id, name)).fetchone():
            return None  # an undo runs once per event
        deadline = event.not_before.timestamp() if kind == HOOK and event.not_before and not event.started else None
        # One event's hooks run in order: an undo (or a re-planned hook) waits for a drain still running,
        # so an event canceled during its drain is undone after it, never before; and an approval after
        # the newest hook waits for the older one too.
        before = c.execute("SELECT id FROM actions WHERE kind = ? AND event_id = ? AND state IN (?, ?, ?) "
                           "ORDER BY id DESC LIMIT 1", (HOOK, event.event_id, *rows.OPEN_STATES)).fetchone()
        return self._insert(c, NewAction(
            kind=kind, event_id=event.event_id, change=change.kind, event=dict(event.raw),
            due=hook_due(spec, event, now) if kind == HOOK else now, deadline=deadline, hook=name,
            incarnation=document.incarnation, record=record, after=int(before[0]) if before else None,
            dry_run=self.config.dry_run), now)

    def _plan_policy(self, c: sqlite3.Connection, change: Change, record: Mapping[str, Any], document: Document,
                     now: float, gate: int | None, *, reconsidering: bool = False) -> None:
        event = change.event
        decision = decide(self.config.rules, event, self.vm())
        if decision.action == HOLD:
            if change.kind == SCHEDULED and not reconsidering:
                self._queue(c, audit_entry(HELD, "policy", "rule_hold" if decision.rule else "no_matching_rule",
                                           EventIds=[event.event_id], Rule=decision.rule,
                                           DocumentIncarnation=document.incarnation, DryRun=self.config.dry_run,
                                           Detail="left to a remote approver or to NotBefore"))
            return
        if decision.action != APPROVE:
            return
        rule = next(r for r in self.config.rules if r.name == decision.rule)
        if decision.after_hooks and self.gate_for is not None:
            held = self.gate_for(c, event)
            gate = held if held is not None else gate
        if decision.after_hooks and gate is None:
            last = c.execute("SELECT id FROM actions WHERE kind = ? AND event_id = ? AND state != ? ORDER BY id DESC "
                             "LIMIT 1", (HOOK, event.event_id, rows.SUPERSEDED)).fetchone()
            gate = int(last[0]) if last else None
            if gate is None:
                self._queue(c, audit_entry(HELD, "hook", "no_hook_configured", EventIds=[event.event_id],
                                           Rule=rule.name, DocumentIncarnation=document.incarnation,
                                           DryRun=self.config.dry_run))
                return
        due = max(now + rule.delay, hook_due(rule, event, now))
        self._insert(c, NewAction(
            kind=rows.APPROVE, event_id=event.event_id, change=change.kind, event=dict(event.raw), due=due,
            deadline=event.not_before.timestamp() if event.not_before else None, rule=rule.name,
            actor="hook" if decision.after_hooks else "policy", incarnation=document.incarnation, record=record,
            after=gate if decision.after_hooks else None, dry_run=self.config.dry_run), now)

    # -- at start ----------------------------------------------------------------------------
    def reconsider(self, document: Document, record: Callable[[Change], Record], approved: Callable[[str], bool]) -> None:
        """Scheduled events of the saved document no action was ever planned for (e.g. the rule is
        new since the last run): the policy decides now, and a hook runs first when the rule waits for one."""
        if not self.config.rules:
            return
        now = self.clock()
        with self.store.transaction() as c:
            for event in document.events:
                if event.status != "Scheduled" or approved(event.event_id):
                    continue
                # (rows a dry run left do not count for a live run: the event is planned afresh)
                if c.execute("SELECT 1 FROM actions WHERE event_id = ? AND dry_run = ?",
                             (event.event_id, int(self.config.dry_run))).fetchone():
                    continue
                change = Change(SCHEDULED, event, None, initial=True)
                rec = record(change).to_dict()
                decision = decide(self.config.rules, event, self.vm())
                gate = None
                spec = self.config.hooks.get(SCHEDULED)
                held = self.gate_for(c, event) if self.gate_for is not None else None
                if decision.action == APPROVE and decision.after_hooks and spec is not None and held is None:
                    gate = self._plan_hook(c, SCHEDULED, spec, change, rec, document, now)
                self._plan_policy(c, change, rec, document, now, gate, reconsidering=True)
