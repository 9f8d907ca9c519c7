"""This VM's hold, derived from the committed document: which events hold it, and its enter/leave rows.

A hold is one ``enter`` row of the actions table and at most one live ``leave`` row whose ``after``
names it (the generation of the hold is the enter row's id). :func:`plan` runs inside the
transaction that commits a document (and once at start, on the saved one) and moves the rows
towards what the document says:

- events hold the VM and no hold is open: a new ``enter`` (due at the earliest ``NotBefore − at``,
  ``after`` the last ``leave`` so a new drain never overtakes the previous undo);
- events still hold it: the open hold's enter follows them (due, deadline = earliest NotBefore, the
  event ids), and a ``leave`` planned while settling is superseded (held again: no undo, no new drain);
- no event holds it: an enter that never started is superseded (nothing to undo); otherwise a
  ``leave`` is planned ``after`` the enter, due when the settle time is over.

So ``leave`` never starts before ``enter`` is over (``after``), never while an event holds the VM
(superseded while planned), never for a hold whose enter never ran, and each runs at most once
per hold; rows are durable, so a restart or ``kill -9`` resumes exactly there.
"""
from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from forwarder.agent.maintenance import affects  # the probe's answer: the probe and the hold agree
from forwarder.imds.document import Document, Event
from forwarder.imds.identity import VmIdentity
from forwarder.protect.settings import ProtectConfig
from forwarder.store import actions as rows
from forwarder.store.actions import ENTER, LEAVE, Action, NewAction

log = logging.getLogger(__name__)

HOLD_SUBJECT = "(hold)"  # the event_id of hold rows: the approval planner's per-event queries never see them
FAMILY = "protect"
ENTERED, LEFT, MISSED = "entered", "left", "missed"


def holds_this_vm(event: Event, vm: VmIdentity, config: ProtectConfig) -> bool:
    """Of a protected type, and naming this VM in Resources (naming none, or our name unknown: ours)."""
    return config.wants(event.event_type) and affects(vm, event) is not False


def held_events(document: Document | None, vm: VmIdentity, config: ProtectConfig) -> list[Event]:
    return [e for e in (document.events if document is not None else ()) if holds_this_vm(e, vm, config)]


def enter_due(events: Iterable[Event], config: ProtectConfig, now: float) -> float:
    """The earliest NotBefore − at of the events; now when one is Started, has no NotBefore, or ``at`` is unset."""
    due = []
    for event in events:
        if event.started or event.not_before is None or config.at is None:
            return now
        due.append(event.not_before.timestamp() - config.at)
    return max(now, min(due, default=now))


def deadline(events: Iterable[Event]) -> float | None:
    """The earliest NotBefore of the Scheduled events (None: none has one)."""
    return min((e.not_before.timestamp() for e in events if not e.started and e.not_before is not None), default=None)


@dataclass(frozen=True)
class Hold:
    """One generation: its enter row and its live leave row (None: not planned yet)."""

    enter: Action
    leave: Action | None

    @property
    def generation(self) -> int:
        return self.enter.id

    @property
    def event_ids(self) -> list[str]:
        ids = self.enter.event.get("EventIds")
        return [str(i) for i in ids] if isinstance(ids, list) else []

    @property
    def open(self) -> bool:
        """The VM is (to be) held: the enter is not superseded and no leave has started."""
        if self.enter.state == rows.SUPERSEDED:
            return False
        return self.leave is None or self.leave.state in (rows.PLANNED, rows.DUE)

    @property
    def enter_started(self) -> bool:
        """Whether the enter command ever began (done, failed, running, or taken up before a stop)."""
        return self.enter.state not in (rows.PLANNED, rows.DUE, rows.SUPERSEDED) or self.enter.attempts > 0


def current(c: sqlite3.Connection, dry_run: bool) -> Hold | None:
    """The latest hold of this mode (a dry run's rows never count for a live run, nor the reverse)."""
    found = _latest(c, ENTER, "dry_run = ?", (int(dry_run),))
    if found is None:
        return None
    leave = _latest(c, LEAVE, "after = ? AND state != ?", (found.id, rows.SUPERSEDED))
    return Hold(found, leave)


def _latest(c: sqlite3.Connection, kind: str, where: str, args: tuple[Any, ...]) -> Action | None:
    row = c.execute(f"SELECT id FROM actions WHERE kind = ? AND {where} ORDER BY id DESC LIMIT 1", (kind, *args)).fetchone()
    return rows.get(c, int(row[0])) if row else None


def _info(events: list[Event], before: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The hold's events as its rows keep them: every id it ever held (for the records), the current ones whole."""
    ids = [str(i) for i in (before or {}).get("EventIds") or []]
    for event in events:
        if event.event_id not in ids:
            ids.append(event.event_id)
    return {"EventIds": ids, "Current": [e.event_id for e in events], "Events": [dict(e.raw) for e in events]}


def _set(c: sqlite3.Connection, action_id: int, now: float, **columns: Any) -> None:
    values = {k: (orjson.dumps(v, default=str) if k == "event" else v) for k, v in columns.items()}
    sets = ", ".join(f"{k} = ?" for k in values)
    c.execute(f"UPDATE actions SET {sets}, updated = ? WHERE id = ?", (*values.values(), now, action_id))


def missed(reason: str, detail: str, hold: Hold | None, **fields: Any) -> dict[str, Any]:
    """A protect.missed audit entry: protection did not (fully) happen."""
    return entry(MISSED, reason, hold.enter if hold is not None else None, Detail=detail, **fields)


def entry(outcome: str, reason: str, enter: Action | None, **fields: Any) -> dict[str, Any]:
    """The audit entry of a hold's step (the poller makes it a protect.<outcome> record)."""
    ids = [str(i) for i in (enter.event.get("EventIds") or [])] if enter is not None else []
    base: dict[str, Any] = {"Family": FAMILY, "Outcome": outcome, "Actor": "hold", "Reason": reason,
                            "Hold": enter.id if enter is not None else None, "EventIds": ids,
                            "EventId": ids[0] if ids else None, "DryRun": bool(enter.dry_run) if enter else False}
    base.update(fields)
    return base


def plan(c: sqlite3.Connection, document: Document | None, vm: VmIdentity, config: ProtectConfig, *, now: float,
         dry_run: bool = False, started: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Move the hold's rows to what ``document`` says (inside the committing transaction); returns audit entries.

    ``started``: ids of events that became Started in this commit (a start before the enter finished is a miss).
    """
    events = held_events(document, vm, config)
    hold = current(c, dry_run)
    entries: list[dict[str, Any]] = []
    incarnation = document.incarnation if document is not None else None
    if events:
        if hold is None or not hold.open:
            # After the last leave of any earlier hold (even one whose enter was later called off): a new
            # drain never overtakes an undo still running.
            last_leave = _latest(c, LEAVE, "dry_run = ? AND state != ?", (int(dry_run), rows.SUPERSEDED))
            after = last_leave.id if last_leave is not None else None
            info = _info(events)
            action_id = rows.insert(c, NewAction(
                kind=ENTER, event_id=HOLD_SUBJECT, change="hold", event=info, due=enter_due(events, config, now),
                deadline=deadline(events), hook=ENTER, incarnation=incarnation, after=after, dry_run=dry_run), now)
            log.info("%sthis VM is held by %s: enter (action %d) due in %.0fs", "dry run: " if dry_run else "",
                     ", ".join(info["EventIds"]), action_id, max(0.0, enter_due(events, config, now) - now))
            hold = current(c, dry_run)
        else:
            enter = hold.enter
            columns: dict[str, Any] = {"event": _info(events, enter.event)}
            if enter.state in (rows.PLANNED, rows.DUE, rows.RUNNING):
                columns["deadline"] = deadline(events)  # a running enter's cut-off follows NotBefore
            if enter.state == rows.PLANNED:
                columns["due"] = enter_due(events, config, now)
            _set(c, enter.id, now, **columns)
            if hold.leave is not None and rows.finish(c, hold.leave.id, rows.SUPERSEDED,
                                                      {"Outcome": "superseded", "Reason": "held_again"}, now,
                                                      only_from=(rows.PLANNED, rows.DUE)):
                log.info("this VM is held again by %s before leaving: the undo (action %d) is called off",
                         ", ".join(e.event_id for e in events), hold.leave.id)
            hold = current(c, dry_run)
        assert hold is not None
        for event_id in started:
            if any(e.event_id == event_id for e in events) and hold.enter.state != rows.DONE \
                    and not (hold.enter.state == rows.SKIPPED and hold.enter.dry_run):
                log.warning("protect: %s started before this VM's enter (action %d) finished (%s): the VM was not "
                            "fully out of service", event_id, hold.generation, hold.enter.state)
                entries.append(missed("started_before_enter", f"{event_id} started while enter was {hold.enter.state}",
                                      hold, StartedEventId=event_id))
        return entries
    if hold is None or not hold.open:
        return entries
    enter = hold.enter
    if not hold.enter_started and rows.finish(c, enter.id, rows.SUPERSEDED,
                                              {"Outcome": "superseded", "Reason": "hold_over_before_enter"}, now,
                                              only_from=(rows.PLANNED, rows.DUE)):
        log.info("the events holding this VM ended before its enter (action %d) began: nothing to undo", enter.id)
        return entries
    if enter.state in (rows.PLANNED, rows.DUE):  # begun, then stopped (restart): over, and undone below
        rows.finish(c, enter.id, rows.FAILED, {"Outcome": "failed", "Reason": "interrupted",
                                               "Detail": "the hold ended while its enter waited to run again"}, now,
                    only_from=(rows.PLANNED, rows.DUE))
    if hold.leave is None:
        action_id = rows.insert(c, NewAction(
            kind=LEAVE, event_id=HOLD_SUBJECT, change="hold", event=dict(enter.event), due=now + config.settle,
            hook=LEAVE, incarnation=incarnation, after=enter.id, dry_run=dry_run), now)
        log.info("no event holds this VM any more: leave (action %d) after enter (action %d), due in %.0fs",
                 action_id, enter.id, config.settle)
    return entries


def gate(c: sqlite3.Connection, event: Event, vm: VmIdentity, config: ProtectConfig, dry_run: bool) -> int | None:
    """The enter action an approval of ``event`` waits for: the open hold's, when the event holds this VM."""
    if not holds_this_vm(event, vm, config):
        return None
    hold = current(c, dry_run)
    return hold.enter.id if hold is not None and hold.open else None


def status(c: sqlite3.Connection, dry_run: bool) -> dict[str, Any]:
    """What ``sefwd status`` shows: serving, or the hold with its events and where its transitions are."""
    hold = current(c, dry_run)
    if hold is None or (not hold.open and hold.leave is not None and hold.leave.state in rows.FINAL_STATES) \
            or hold.enter.state == rows.SUPERSEDED:
        return {"state": "serving", "hold": hold.generation if hold is not None else None}
    enter, leave = hold.enter, hold.leave
    if leave is not None:
        state = "leaving" if leave.state == rows.RUNNING else "settling"
    else:
        state = {rows.RUNNING: "entering", rows.DONE: "held", rows.FAILED: "held (enter failed)",
                 rows.SKIPPED: "held (dry run)"}.get(enter.state, "waiting")
    current_ids = enter.event.get("Current") if leave is None else []
    return {"state": state, "hold": hold.generation, "EventIds": current_ids or [], "AllEventIds": hold.event_ids,
            "enter": enter.state, "enter_due": _when(enter.due), "deadline": _when(enter.deadline),
            "leave": leave.state if leave is not None else None,
            "leave_due": _when(leave.due) if leave is not None else None}


def _when(epoch: float | None) -> str | None:
    from datetime import datetime, timezone

    from forwarder.records import rfc3339

    return rfc3339(datetime.fromtimestamp(epoch, timezone.utc)) if epoch is not None else None
