"""Approvals asked for now — by the CLI and the signed callback — go through ``Approver.approve``
(policy and hook approvals are action rows: forwarder.approval.planner and runner).

It re-reads the document from IMDS right before posting, so an approval never names an event
that is gone or already Started, applies the scope rule, posts StartRequests, and reports every
attempt, accepted or refused, as an audit entry (``approval.<outcome>`` record).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwarder.approval.settings import APPROVED, FAILED, HELD, OUTCOMES, REFUSED, ApprovalConfig
from forwarder.approval.scope import scope_refusal
from forwarder.imds.document import Event, parse_document
from forwarder.errors import DocumentError, ForwarderError, ImdsError
from forwarder.imds.identity import VmIdentity
from forwarder.imds.client import ImdsClient
from forwarder.store import actions as rows
from forwarder.store.database import Store

log = logging.getLogger(__name__)

AUDIT_FIELDS = (
    "EventId", "EventIds", "Outcome", "Actor", "Approver", "Rule", "Reason", "Detail", "Client",
    "HttpStatus", "ImdsStatus", "Hook", "DocumentIncarnation",
    "Count",  # refused callback requests of one reason and client aggregated over a window
    "Action", "DryRun",  # the action row behind a policy or hook audit (forwarder.approval.planner)
)


def audit_entry(outcome: str, actor: str, reason: str, **fields: Any) -> dict[str, Any]:
    """An audit entry with every field present (null when it does not apply)."""
    entry: dict[str, Any] = {name: None for name in AUDIT_FIELDS}
    entry.update(Outcome=outcome, Actor=actor, Reason=reason)
    for key, value in fields.items():
        if key not in AUDIT_FIELDS:
            raise KeyError(f"unknown audit field {key!r}")
        entry[key] = value
    ids = entry["EventIds"]
    if entry["EventId"] is None and ids and len(ids) == 1:
        entry["EventId"] = ids[0]
    return entry


@dataclass(frozen=True)
class Attempt:
    """What happened to one approval request (one or more EventIds)."""

    outcome: str
    reason: str
    status: int  # the HTTP status a caller of the callback gets
    approved: tuple[str, ...] = ()
    already_approved: tuple[str, ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)
    detail: str = ""

    def answer(self) -> dict[str, Any]:
        """The JSON answer of the callback endpoint and of ``sefwd approve --json``."""
        body: dict[str, Any] = {"status": self.outcome if self.outcome != APPROVED else "approved", "reason": self.reason}
        if self.approved:
            body["approved"] = list(self.approved)
        if self.already_approved:
            body["already_approved"] = list(self.already_approved)
        if self.refused:
            body["refused"] = dict(self.refused)
        if self.detail:
            body["detail"] = self.detail
        return body


class ApprovedLog:
    """EventIds this VM approved, kept in the store across restarts so a retry is answered "already approved"."""

    def __init__(self, state_dir: Path, keep: int = 1000) -> None:
        self.state_dir = state_dir
        self.keep = keep
        self._store: Store | None = None

    def _db(self) -> Store:
        if self._store is None:  # opened on first use: `sefwd approve` and the agent share the file
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._store = Store.open(self.state_dir)
        return self._store

    def __contains__(self, event_id: object) -> bool:
        try:
            return isinstance(event_id, str) and self._db().approved(event_id)
        except ForwarderError as exc:
            log.warning("cannot read approvals given: %s", exc)
            return False

    def add(self, event_ids: Sequence[str]) -> None:
        try:
            self._db().add_approvals(event_ids, self.keep)
        except (OSError, ForwarderError) as exc:
            log.warning("could not save approvals given: %s", exc)


class Approver:
    """Approves events after checking them against a fresh document, the scope, and what was done."""

    def __init__(
        self,
        config: ApprovalConfig,
        imds: ImdsClient,
        vm: Callable[[], VmIdentity],
        audit: Callable[[dict[str, Any]], None],
        state_dir: Path,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.imds = imds
        self.vm = vm
        self.audit = audit
        self.stop = stop
        self.approved = ApprovedLog(state_dir)
        self._lock = threading.Lock()  # one fresh GET + POST at a time
        self.posts = 0
        # The agent's store: an approval asked for now (the callback) is an action row marked
        # posting before its POST, and its outcome and audit commit together (crash-safe).
        self.actions: Store | None = None
        self._rows: list[int] = []
        self._actor = ""

    # -- the one way to approve ----------------------------------------------------------
    def approve(
        self,
        event_ids: Sequence[str],
        *,
        actor: str,
        approver: str | None = None,
        rule: str | None = None,
        client: str | None = None,
        hook: dict[str, Any] | None = None,
        scope: str | None = None,
        reason: str | None = None,
    ) -> Attempt:
        """Approve all of ``event_ids`` or none of them; audited either way."""
        ids = tuple(dict.fromkeys(event_ids))
        common = dict(EventIds=list(ids), Approver=approver, Rule=rule, Client=client, Hook=hook)
        with self._lock:
            self._rows, self._actor = [], actor
            attempt, incarnation, imds_status = self._attempt(ids, scope or self.config.scope)
            detail = attempt.detail or (reason or "")
            entry = audit_entry(
                attempt.outcome, actor, attempt.reason, Detail=detail or None,
                HttpStatus=attempt.status if actor == "callback" else None,
                ImdsStatus=imds_status, DocumentIncarnation=incarnation,
                DryRun=True if attempt.reason == "dry_run" else None, **common,
            )
            if not self._finish_rows(entry, attempt):
                self.audit(entry)
        level = logging.INFO if attempt.outcome == APPROVED else logging.WARNING
        log.log(level, "approval by %s%s of %s: %s (%s)", actor, f" ({approver})" if approver else "", ", ".join(ids), attempt.outcome, attempt.reason)
        return attempt

    def _mark_posting(self, events: Sequence[Event], incarnation: Any) -> None:
        """One action row per event, committed ``running``/``posting`` before the POST."""
        if self.actions is None:
            return
        now = time.time()
        try:
            with self.actions.transaction() as c:
                self._rows = [rows.insert_posting(c, rows.NewAction(
                    kind=rows.APPROVE, event_id=e.event_id, change=self._actor, event=dict(e.raw), due=now,
                    deadline=e.not_before.timestamp() if e.not_before else None, actor=self._actor,
                    incarnation=incarnation), now) for e in events]
        except ForwarderError as exc:  # the approval still goes out; only its crash-safety is lost
            log.error("could not record the approval as an action before posting: %s", exc)
            self._rows = []

    def _finish_rows(self, entry: dict[str, Any], attempt: Attempt) -> bool:
        """The outcome of the rows and the audit entry in one transaction; False if there are no rows."""
        if not self._rows or self.actions is None:
            return False
        state = rows.DONE if attempt.outcome == APPROVED else rows.FAILED
        result = {"Outcome": attempt.outcome, "Reason": attempt.reason, "Detail": attempt.detail or None}
        try:
            with self.actions.transaction() as c:
                for action_id in self._rows:
                    rows.finish(c, action_id, state, result, time.time())
                self.actions.inbox_put(c, entry)
        except ForwarderError as exc:
            log.error("could not commit the outcome of the approval with its audit: %s", exc)
            return False
        return True

    def _attempt(self, ids: tuple[str, ...], scope: str) -> tuple[Attempt, Any, int | None]:
        if not ids:
            return Attempt(REFUSED, "no_event_ids", 422), None, None
        try:
            # The body, never a 304; retried (one 429 from IMDS's 5/s, shared with the agent, must not
            # fail an approval), each attempt within the client's request budget.
            fetch = self.imds.read_scheduled_events()
            document = parse_document(fetch.body or b"")
        except (ImdsError, DocumentError) as exc:
            return Attempt(FAILED, "imds_unavailable", 503, detail=str(exc)), None, getattr(exc, "status", None)
        events = {e.event_id.lower(): e for e in document.events}
        vm = self.vm()
        refused: dict[str, str] = {}
        already: list[str] = []
        to_post: list[str] = []
        for event_id in ids:
            event = events.get(event_id.lower())
            if event is None:
                refused[event_id] = "unknown_event"
            elif event_id in self.approved:
                already.append(event.event_id)
            elif event.started:
                refused[event_id] = "already_started"
            elif (why := scope_refusal(event, vm, scope)) is not None:
                refused[event_id] = f"out_of_scope:{why}"
            else:
                to_post.append(event.event_id)
        if refused:
            reasons = sorted({r.split(":", 1)[0] for r in refused.values()})
            return Attempt(REFUSED, reasons[0] if len(reasons) == 1 else "several_reasons", 422, refused=refused), document.incarnation, None
        if not to_post:
            return Attempt(APPROVED, "already_approved", 200, already_approved=tuple(already)), document.incarnation, None
        if self.config.dry_run and self._actor == "callback":  # (`sefwd approve` is an explicit command)
            return Attempt(HELD, "dry_run", 409, detail=f"dry run: would post StartRequests for {', '.join(to_post)}"), \
                document.incarnation, None
        self._mark_posting([events[e.lower()] for e in to_post], document.incarnation)
        try:
            self.posts += 1
            self.imds.start_requests(to_post)
        except ImdsError as exc:
            return Attempt(FAILED, "imds_post_failed", 502, detail=str(exc)), document.incarnation, exc.status
        self.approved.add(to_post)
        return Attempt(APPROVED, "approved", 200, approved=tuple(to_post), already_approved=tuple(already)), document.incarnation, 200
