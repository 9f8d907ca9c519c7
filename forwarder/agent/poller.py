"""The poll loop: IMDS document → changes → records → outbox, then commit the document as seen."""
from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from forwarder.imds.differ import Change, diff
from forwarder.imds.document import Document, parse_document
from forwarder.store.outbox import Outbox
from forwarder.errors import DocumentError, ForwarderError, ImdsError
from forwarder.imds.evidence import evidence_from_dict, evidence_to_dict, read_boot_id, read_boot_time
from forwarder.imds.identity import VmIdentity
from forwarder.imds.client import RETRY_AFTER_CAP, ImdsClient
from forwarder.common.json_safe import json_safe
from forwarder.common.logs import RateLimitedLog
from forwarder.records import RecordFactory, utcnow
from forwarder.common.retry import Backoff
from forwarder.sinkapi import Record
from forwarder.store.database import SavedState

log = logging.getLogger(__name__)


@dataclass
class PollStats:
    """Counters that ``status``, heartbeats and telemetry read."""

    polls: int = 0
    unchanged: int = 0
    changed_documents: int = 0
    records: int = 0
    imds_errors: int = 0
    bad_documents: int = 0
    outbox_errors: int = 0
    cycle_errors: int = 0  # unexpected exceptions inside one cycle (a bug, or input nobody foresaw)
    bad_audits: int = 0  # audit entries that could not become a record even made safe: set aside, logged
    consecutive_failures: int = 0
    last_ok_wall: datetime | None = None


class Poller:
    """Polls IMDS at a fixed rate and turns every change of the document into records.

    A changed document is committed as seen together with its records and the sequence counter,
    in one store transaction: a crash leaves either all of it or none (then the same changes are
    derived again, with the same ids, on the next start).
    """

    def __init__(
        self,
        imds: ImdsClient,
        state: SavedState,
        factory: RecordFactory,
        outbox: Outbox,
        *,
        poll_interval: float,
        heartbeat: float = 300.0,
        compute_refresh: float = 3600.0,
        stop: threading.Event | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], datetime] = utcnow,
        boot_id: Callable[[], str | None] = read_boot_id,
        boot_time: Callable[[], float | None] = read_boot_time,
    ) -> None:
        self.imds = imds
        self.state = state
        self.factory = factory
        self.outbox = outbox
        self.poll_interval = poll_interval
        self.heartbeat = heartbeat
        self.compute_refresh = compute_refresh
        self.stop = stop or threading.Event()
        self._mono = monotonic
        self._wall = wallclock
        self._errors = RateLimitedLog(log)
        # Backing off must not make us miss short notices (Preempt gives 30 s): cap it, and a
        # Retry-After, low (docs/imds-transport.md: at most 5 s, or the poll interval if longer).
        cap = max(poll_interval, RETRY_AFTER_CAP)
        self._backoff = Backoff(initial=poll_interval, maximum=cap, retry_after_cap=cap)
        self._rng = random.Random()
        self.stats = PollStats()
        self.started_mono = monotonic()
        # Evidence for completed/canceled decisions (forwarder.imds.outcome), kept in the state.
        self.evidence = evidence_from_dict(state.evidence, boot_id(), boot_time())
        if state.document is None:
            # Fresh install: nothing was seen at another boot.
            self.evidence.document_committed(wallclock().timestamp())
        self.current: Document | None = None
        self._last_body: bytes | None = state.document.encode() if state.document is not None else None
        if state.document is not None:
            try:
                self.current = parse_document(state.document)
            except DocumentError as exc:  # cannot happen for a document we parsed before, but never crash-loop
                log.error("saved document is unreadable (%s); treating this start as a fresh install", exc)
                self._last_body = None
        self.polled = threading.Condition()
        self._poll_waiters = 0
        self.inbox: deque[dict[str, Any]] = deque()
        self._inbox_failures, self._inbox_due = 0, 0.0  # failed inbox commits in a row; next try (monotonic)
        self.on_changes: Callable[[list[Change], list[Record]], None] | None = None
        # Plans actions from committed changes inside their transaction (forwarder.approval.planner).
        # It returns the audit entries of what it planned, committed as approval.* records with them.
        self.plan: Callable[[sqlite3.Connection, list[Change], list[Record], Document], list[dict[str, Any]]] | None = None
        self.on_first_answer: Callable[[], None] | None = None  # e.g. rewrite the status report now
        # After every cycle's poll, with the committed document (the same object when nothing changed):
        # the maintenance state (forwarder.agent.maintenance) follows the commits and the clock.
        self.on_document: Callable[[Document | None], object] | None = None
        # After a poll whose document is committed (unchanged, or changed and committed): the action
        # workers wait for the first one before they run what a previous process left (approval.runner).
        self.on_checked: Callable[[Document | None], object] | None = None

    # -- one cycle -------------------------------------------------------------------------
    def poll_once(self) -> float:
        """One poll; returns how long to wait before the next one."""
        # Both clocks read before the request: pause evidence compares them from poll to poll.
        started_mono, started_wall = self._mono(), self._wall()
        try:
            fetch = self.imds.scheduled_events()
        except ImdsError as exc:
            return self._failed(exc)
        self.stats.consecutive_failures = 0
        # (api_version "auto": the records say which version this document was read with)
        self.factory.api_version = getattr(self.imds, "api_version", self.factory.api_version)
        first_answer = self.stats.last_ok_wall is None
        self.stats.last_ok_wall = self._wall()
        if first_answer and self.on_first_answer is not None:
            try:
                self.on_first_answer()
            except Exception as exc:  # noqa: BLE001 - advisory; the poll goes on
                log.warning("after the first IMDS answer: %s", exc)
        # A gap between two good polls longer than the waits in between (plus 1 s) is a pause.
        self.evidence.observe_poll(started_mono, started_wall)
        self._errors.clear("imds")
        body = fetch.body
        if body is None or body == self._last_body:  # 304, or byte-identical: the cheap common path
            self.stats.unchanged += 1
            if not self.evidence.seen_in_process and self._last_body is not None:
                self.evidence.document_seen(started_wall.timestamp())
                # Once per process: the saved document was seen by this process, at this boot.
                self._emit(lambda: [])
            self._checked()
            self._notify()
            return self.poll_interval
        try:
            document = parse_document(body)
        except DocumentError as exc:
            self.stats.bad_documents += 1
            self._errors.log(logging.ERROR, "document", "skipping a bad IMDS document, keeping the last good state: %s", exc)
            self._notify()
            return self.poll_interval
        self._errors.clear("document")
        try:
            now = self._wall()
            changes = diff(self.current, document, now, self.evidence.context(now, self.factory.vm.names()))
            self.evidence.approval_seen_elsewhere(
                [c.event.event_id for c in changes if c.early_start and c.early_start["ApprovedBy"] == "elsewhere"], now)
            built: list[Record] = []

            def build() -> list[Record]:
                built[:] = self.factory.for_changes(changes, document)
                return built

            def plan(c: sqlite3.Connection) -> list[Record]:
                if self.plan is None or not changes:
                    return []
                # The actions these changes call for, with their audit records, in the same transaction;
                # a planning bug costs the plan (logged), never the records.
                c.execute("SAVEPOINT plan")
                sequence = self.factory.sequence
                try:
                    audit = [self.factory.approval(entry) for entry in self.plan(c, changes, built, document)]
                except Exception:  # noqa: BLE001
                    log.exception("could not plan actions for %d change(s); the records are committed without them", len(changes))
                    c.execute("ROLLBACK TO plan")
                    self.factory.sequence, audit = sequence, []
                c.execute("RELEASE plan")
                return audit

            committed = self._emit(build, document=document, body=body, then=plan)
        finally:
            if self._last_body is not body:
                # Not committed (the store refused, or the cycle failed): the next poll must fetch
                # this body again, not be told "304, unchanged" against the validator of a
                # document the store never got (issue 20).
                self.imds.forget_etag()
        if committed:
            self.stats.changed_documents += 1
            self.stats.records += len(changes)
            if changes and self.on_changes is not None:
                self.on_changes(changes, built)
            self._checked()
        self._notify()
        return self.poll_interval

    def _checked(self) -> None:
        if self.on_checked is not None:
            try:
                self.on_checked(self.current)
            except Exception as exc:  # noqa: BLE001 - a listener must not cost the poll
                self._count_cycle_error(exc)

    # -- audit entries from other threads and from `sefwd approve` -------------------------
    def submit_audit(self, entry: dict[str, Any]) -> None:
        """Thread-safe: the entry becomes an approval.* record on the poller's next turn."""
        self.inbox.append(entry)

    def drain_inbox(self, *, spool: bool = True) -> None:
        """Commit queued audit entries and (with ``spool``) those `sefwd approve` put in the store's inbox."""
        stored: list[tuple[int, object]] = []
        if spool:
            try:
                stored = self.outbox.inbox()
            except (OSError, ForwarderError) as exc:
                self._errors.log(logging.ERROR, "inbox", "cannot read the approval inbox: %s", exc)
        if not stored and not self.inbox:
            return
        queued: list[dict[str, Any]] = []
        while self.inbox:
            queued.append(self.inbox.popleft())
        # Each entry made safe on its own (bounded, serializable: a refused client's 2**70 keeps its
        # digits as text); one that still cannot become a record is counted and set aside alone.
        kept = [(e, n < len(queued), json_safe(e)) for n, e in enumerate(queued + [e for _, e in stored])
                if isinstance(e, dict) and (e.get("Outcome") or e.get("Lifecycle") == "data_lost")]
        entries: list[dict[str, Any]] = [safe for _, _, safe in kept]
        if len(entries) < len(queued) + len(stored):
            log.error("dropping %d unreadable approval inbox entr(ies)", len(queued) + len(stored) - len(entries))
        for entry in entries:
            if entry.get("Outcome") == "approved" and isinstance(entry.get("EventIds"), list):
                # All-or-nothing: an "approved" entry means IMDS accepted (now or before) every id.
                ids = [i for i in entry["EventIds"] if isinstance(i, str)]
                self.evidence.approval_accepted(ids, self._wall())

        set_aside: list[int] = []  # indexes into entries, counted once however often the commit is retried

        def build() -> list[Record]:
            out: list[Record] = []
            for n, e in enumerate(entries):
                sequence = self.factory.sequence
                try:
                    # (start-up recovery queues its forwarder.data_lost announcement here: see forwarder.store.recovery)
                    out.append(self.factory.lifecycle("data_lost", e["Data"] if isinstance(e.get("Data"), dict) else {})
                               if e.get("Lifecycle") else self.factory.approval(e))
                except Exception as exc:  # noqa: BLE001 - one entry, never the batch
                    self.factory.sequence = sequence  # (no gap in the sequence)
                    if n not in set_aside:
                        set_aside.append(n)
                        self.stats.bad_audits += 1
                        log.error("setting aside an approval audit entry that cannot become a record (%s: %s): %.500r",
                                  type(exc).__name__, exc, e)
            return out

        if self._emit(build, inbox_ids=[i for i, _ in stored]):
            self._inbox_failures = 0
        else:
            # Inbox rows stay in the store and are retried; so are the queued entries, but those set aside.
            self.inbox.extendleft(reversed([e for n, (e, queued_here, _) in enumerate(kept)
                                            if queued_here and n not in set_aside]))
            self._inbox_failures += 1  # with the poller's backoff (the poll itself goes on meanwhile)
            self._inbox_due = self._mono() + self._backoff.delay(self._inbox_failures - 1, self._rng)

    def _emit(self, build: Callable[[], list[Record]], *, document: Document | None = None, body: bytes | None = None,
              inbox_ids: Sequence[int] = (), then: Callable[[sqlite3.Connection], list[Record]] | None = None) -> bool:
        """Commit the records with the state they came from in one transaction; False if the store refused."""
        sequence_before = self.factory.sequence
        records = build()
        new_state = SavedState(
            sequence=self.factory.sequence,
            document=body.decode() if body is not None else self.state.document,
            api_version=self.factory.api_version,
            vm=self.factory.vm.to_dict(),
            evidence=self._evidence_after(document),
        )
        planned: Callable[[sqlite3.Connection], list[Record]] | None = None
        if then is not None:
            def planned(c: sqlite3.Connection) -> list[Record]:
                extra = then(c)
                new_state.sequence = self.factory.sequence  # the audit records of the plan are numbered too
                return extra
        try:
            self.outbox.commit(records, new_state, inbox_ids=inbox_ids, then=planned)
        except (OSError, ForwarderError) as exc:
            self.factory.sequence = sequence_before
            self.stats.outbox_errors += 1
            self._errors.log(logging.ERROR, "outbox", "could not commit %d record(s), will retry: %s", len(records), exc)
            return False
        self._errors.clear("outbox")
        self.state = new_state
        if body is not None:
            self._last_body = body
            self.current = document
            self.evidence.document_committed(self._wall().timestamp())
        return True

    def _evidence_after(self, document: Document | None) -> dict[str, Any]:
        """The evidence to save with this commit: a new document is seen at this boot."""
        saved = evidence_to_dict(self.evidence)
        if document is not None:
            saved.update(seen_boot_id=self.evidence.boot_id, seen_boot_time=self.evidence.boot_time,
                         seen_at=self._wall().timestamp())
        return saved

    def _failed(self, exc: ImdsError) -> float:
        self.stats.imds_errors += 1
        self.stats.consecutive_failures += 1
        self._errors.log(logging.WARNING, "imds", "IMDS poll failed: %s", exc)
        self._notify()
        delay = self._backoff.delay(self.stats.consecutive_failures - 1, self._rng, exc.retry_after)
        return max(self.poll_interval, delay)

    def _notify(self) -> None:
        self.stats.polls += 1
        if self._poll_waiters:  # nobody waits but `demo` and tests: skip the lock on every poll
            with self.polled:
                self.polled.notify_all()

    # -- lifecycle -------------------------------------------------------------------------
    def emit_lifecycle(self, kind: str, **data: object) -> bool:
        return self._emit(lambda: [self.factory.lifecycle(kind, data)])

    def heartbeat_data(self) -> dict[str, object]:
        return {
            "UptimeSeconds": round(self._mono() - self.started_mono, 1),
            "Polls": self.stats.polls,
            "ImdsErrors": self.stats.imds_errors,
            "BadDocuments": self.stats.bad_documents,
            "CycleErrors": self.stats.cycle_errors,
            "LastPollOk": self.stats.last_ok_wall.isoformat().replace("+00:00", "Z") if self.stats.last_ok_wall else None,
            "CurrentEvents": len(self.current.events) if self.current else 0,
            "DocumentIncarnation": self.current.incarnation if self.current else None,
        }

    def refresh_identity(self) -> None:
        """Re-read instance metadata (rarely); keep the old identity if IMDS says nothing new."""
        try:
            # Inside the poll cycle: bounded by one request's deadline, not the 90 s a command may
            # retry for; polling stops meanwhile, and a Spot eviction gives 30 s. The old identity
            # stays until the next refresh.
            compute = self.imds.compute(deadline=float(getattr(self.imds, "timeout", 5.0)))
        except ImdsError as exc:
            log.warning("could not refresh instance metadata: %s", exc)
            return
        vm = VmIdentity.from_compute(compute)
        if vm.known and vm != self.factory.vm:
            log.info("VM identity changed: %s", vm.source)
            self.factory.vm = vm

    def run(self) -> None:
        """Poll at a fixed rate until ``stop`` is set; no exception inside a cycle ends the loop."""
        next_poll = self._mono()
        self._next_heartbeat = self._mono() + self.heartbeat if self.heartbeat > 0 else float("inf")
        self._next_refresh = self._mono() + self.compute_refresh if self.compute_refresh > 0 else float("inf")
        failed_cycles = 0
        while not self.stop.is_set():
            try:
                wait = self._cycle()
                failed_cycles = 0
            except Exception as exc:  # noqa: BLE001 - the watch must go on (see _cycle_failed)
                failed_cycles += 1
                wait = self._cycle_failed(exc, failed_cycles)
            now = self._mono()
            # Fixed rate, not fixed delay: a slow poll does not push every later poll back.
            next_poll = max(next_poll + wait, now) if wait == self.poll_interval else now + wait
            if self._sleep(max(0.0, next_poll - self._mono())):
                break

    def _sleep(self, seconds: float) -> bool:
        """Wait between cycles; True if stopped. A sleep that lasted longer than asked is pause evidence."""
        before = self._mono()
        if self.stop.wait(seconds):
            return True
        self.evidence.observe_sleep(seconds, self._mono() - before)
        return False

    def _cycle(self) -> float:
        """One turn: audits, one poll, heartbeat and identity refresh when due; returns the wait."""
        if self._mono() >= self._inbox_due:
            self.drain_inbox()  # audits that arrived while we waited go before the next document
        wait = self.poll_once()
        if self.on_document is not None:
            try:
                self.on_document(self.current)
            except Exception as exc:  # noqa: BLE001 - a listener (the maintenance probe) must not cost the
                # cycle its heartbeat, audits and identity refresh: counted and logged as a cycle error
                self._count_cycle_error(exc)
        self.drain_inbox(spool=False)  # what the poll's own approvals queued, without a disk look
        now = self._mono()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat
            self.emit_lifecycle("heartbeat", **self.heartbeat_data())
        if now >= self._next_refresh:
            self._next_refresh = now + self.compute_refresh
            self.refresh_identity()
        return wait

    def _count_cycle_error(self, exc: Exception) -> None:
        """Count an unexpected exception and log it once per minute per kind and place."""
        self.stats.cycle_errors += 1
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self._errors.log(logging.ERROR, f"cycle:{type(exc).__name__}:{where}",
                         "unexpected error in the poll cycle (counted as cycle_errors; polling goes on): %s",
                         "".join(traceback.format_exception(exc)).rstrip())

    def _cycle_failed(self, exc: Exception, in_a_row: int) -> float:
        """An exception ended the cycle: count and log it, back off."""
        self._count_cycle_error(exc)
        self._notify()  # whoever waits for polls must not wait for a cycle that will not come
        return max(self.poll_interval, self._backoff.delay(in_a_row - 1, self._rng))

    def wait_for_polls(self, count: int, timeout: float) -> bool:
        """Block until ``stats.polls`` reaches ``count`` (used by demo and tests)."""
        deadline = self._mono() + timeout
        with self.polled:
            self._poll_waiters += 1
            try:
                while self.stats.polls < count:
                    remaining = deadline - self._mono()
                    if remaining <= 0 or self.stop.is_set():
                        return self.stats.polls >= count
                    # (bounded: a count bumped between the check and the wait is seen within 50 ms)
                    self.polled.wait(min(remaining, 0.05))
            finally:
                self._poll_waiters -= 1
        return True

