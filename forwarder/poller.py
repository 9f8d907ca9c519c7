"""The poll loop: IMDS document → changes → records → outbox, then commit the document as seen."""
from __future__ import annotations

import logging
import os
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from forwarder.differ import Change, diff
from forwarder.document import Document, parse_document
from forwarder.delivery import Outbox
from forwarder.errors import DocumentError, ForwarderError, ImdsError
from forwarder.identity import VmIdentity
from forwarder.imds import RETRY_AFTER_CAP, ImdsClient
from forwarder.logutil import RateLimitedLog
from forwarder.records import RecordFactory, utcnow
from forwarder.retry import Backoff
from forwarder.sinkapi import Record
from forwarder.state import AgentState, StateStore

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
    consecutive_failures: int = 0
    last_ok_wall: datetime | None = None


class Poller:
    """Polls IMDS at a fixed rate and turns every change of the document into records.

    The document is committed as seen (state saved) only after the outbox has taken its records,
    so a crash in between re-derives the same changes, with the same ids, on the next start.
    """

    def __init__(
        self,
        imds: ImdsClient,
        store: StateStore,
        state: AgentState,
        factory: RecordFactory,
        outbox: Outbox,
        *,
        poll_interval: float,
        heartbeat: float = 300.0,
        compute_refresh: float = 3600.0,
        stop: threading.Event | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.imds = imds
        self.store = store
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
        self.on_changes: Callable[[list[Change], list[Record]], None] | None = None
        self.spool_dir: Path | None = None
        self._spool_mtime: int | None = None

    # -- one cycle -------------------------------------------------------------------------
    def poll_once(self) -> float:
        """One poll; returns how long to wait before the next one."""
        if self.state.pending:
            self.flush_pending()
        try:
            fetch = self.imds.scheduled_events()
        except ImdsError as exc:
            return self._failed(exc)
        self.stats.consecutive_failures = 0
        self.stats.last_ok_wall = self._wall()
        self._errors.clear("imds")
        body = fetch.body
        if body is None or body == self._last_body:  # 304, or byte-identical: the cheap common path
            self.stats.unchanged += 1
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
        changes = diff(self.current, document, self._wall())
        built: list[Record] = []

        def build() -> list[Record]:
            built[:] = self.factory.for_changes(changes, document)
            return built

        if self._emit(build, document=document, body=body):
            self.stats.changed_documents += 1
            self.stats.records += len(changes)
            if changes and self.on_changes is not None:
                self.on_changes(changes, built)
        self._notify()
        return self.poll_interval

    # -- audit entries from other threads and from `sefwd approve` -------------------------
    def submit_audit(self, entry: dict[str, Any]) -> None:
        """Thread-safe: the entry becomes an approval.* record on the poller's next turn."""
        self.inbox.append(entry)

    def drain_inbox(self, *, spool: bool = True) -> None:
        """Journal queued audit entries and (with ``spool``) spooled ones, written by `sefwd approve`."""
        spooled = self._spooled() if spool else []
        if not spooled and not self.inbox:
            return
        queued: list[dict[str, Any]] = []
        while self.inbox:
            queued.append(self.inbox.popleft())
        from_spool: list[dict[str, Any]] = []
        for path in spooled:
            try:
                from_spool.append(orjson.loads(path.read_bytes()))
            except (OSError, ValueError) as exc:
                log.error("setting aside unreadable approval spool file %s: %s", path, exc)
                path.rename(path.with_suffix(".bad"))
        entries = [e for e in queued + from_spool if isinstance(e, dict) and e.get("Outcome")]
        if not entries:
            return
        if self._emit(lambda: [self.factory.approval(e) for e in entries]):
            for path in spooled:
                path.unlink(missing_ok=True)  # (a file set aside above is already gone)
        else:
            self.inbox.extendleft(reversed(queued))  # spool files stay on disk and are retried

    def _spooled(self) -> list[Path]:
        # One stat per turn, not a directory listing: the listing (and, with no spool directory
        # yet, the exception) cost more CPU than the poll itself. A new file changes the mtime.
        if self.spool_dir is None:
            return []
        try:
            mtime = os.stat(self.spool_dir).st_mtime_ns
        except FileNotFoundError:
            return []
        if mtime == self._spool_mtime:
            return []
        try:
            with os.scandir(self.spool_dir) as it:
                spooled = sorted(Path(e.path) for e in it if e.name.endswith(".json"))
        except FileNotFoundError:
            return []
        # Only an empty listing of a directory untouched for a while is final: files left behind
        # are retried, and a file renamed in within the same coarse mtime tick is not missed.
        if not spooled and time.time_ns() - mtime > 2_000_000_000:
            self._spool_mtime = mtime
        return spooled

    def _emit(self, build: Callable[[], list[Record]], *, document: Document | None = None, body: bytes | None = None) -> bool:
        """Commit the new state with its records as a write-ahead, then journal them.

        The records are saved in ``state.json`` together with the document they came from, so a
        crash or a full disk between the two steps re-journals exactly the same bytes (same ids,
        same times, same sequence numbers) instead of deriving them again from a later document.
        """
        if not self.flush_pending():
            return False  # keep order: nothing new until the older records are in the journal
        sequence_before = self.factory.sequence
        records = build()
        new_state = AgentState(
            sequence=self.factory.sequence,
            document=body.decode() if body is not None else self.state.document,
            api_version=self.factory.api_version,
            vm=self.factory.vm.to_dict(),
            pending=[r.body.decode() for r in records],
            pending_index=self.outbox.position(),
        )
        try:
            self.store.save(new_state)
        except (OSError, ForwarderError) as exc:
            self.factory.sequence = sequence_before
            self.stats.outbox_errors += 1
            self._errors.log(logging.ERROR, "outbox", "could not save state, will retry: %s", exc)
            return False
        self.state = new_state
        if body is not None:
            self._last_body = body
            self.current = document
        self.flush_pending()
        return True

    def flush_pending(self) -> bool:
        """Journal the records of the last commit if they are not there yet (startup, after ENOSPC)."""
        state = self.state
        if not state.pending:
            return True
        if state.pending_index is not None and self.outbox.position() > state.pending_index:
            state.pending = []  # a previous run journaled them before it stopped
            return True
        try:
            self.outbox.append([Record.from_body(b.encode()) for b in state.pending])
        except (OSError, ForwarderError) as exc:
            self.stats.outbox_errors += 1
            self._errors.log(logging.ERROR, "outbox", "could not journal %d record(s), will retry: %s", len(state.pending), exc)
            return False
        self._errors.clear("outbox")
        state.pending = []  # on disk it is cleared by the next save; the index check covers a restart
        return True

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
            compute = self.imds.compute()
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
            if self.stop.wait(max(0.0, next_poll - self._mono())):
                break

    def _cycle(self) -> float:
        """One turn: audits, one poll, heartbeat and identity refresh when due; returns the wait."""
        self.drain_inbox()  # audits that arrived while we waited go before the next document
        wait = self.poll_once()
        self.drain_inbox(spool=False)  # what the poll's own approvals queued, without a disk look
        now = self._mono()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat
            self.emit_lifecycle("heartbeat", **self.heartbeat_data())
        if now >= self._next_refresh:
            self._next_refresh = now + self.compute_refresh
            self.refresh_identity()
        return wait

    def _cycle_failed(self, exc: Exception, in_a_row: int) -> float:
        """Log an unexpected exception once per minute per kind and place, count it, back off."""
        self.stats.cycle_errors += 1
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self._errors.log(logging.ERROR, f"cycle:{type(exc).__name__}:{where}",
                         "unexpected error in the poll cycle (counted as cycle_errors; polling goes on): %s",
                         "".join(traceback.format_exception(exc)).rstrip())
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

