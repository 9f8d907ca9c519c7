"""Action workers: a bounded pool taking due actions from the store; the poll loop never waits.

A scheduler thread moves ``planned`` rows to ``due`` when their time has come (and the hook an
approval waits for is over); ``workers`` threads each claim one due row at a time (committed
``running`` before anything happens), perform it and commit its outcome with its audit entry
in one transaction. When all workers are busy, due rows wait in the store.

An approval is re-checked against a fresh document right before its POST: the event must still
be Scheduled, unchanged since the rule saw it, and still matched by that rule; otherwise the
action is ``superseded``. The row is marked ``posting`` (committed) before the POST: after a
crash, IMDS says what happened (Started: the approval took effect, audited once; still
Scheduled: it never arrived, and the re-checked approval is posted).

Nothing runs before the first poll: rows left ``planned``, ``due`` or ``running`` by a previous
process (and those ``reconsider`` planned from the saved document) wait until the poller has
committed a current document (``checked``) — its planner supersedes the rows of events that
changed or left meanwhile — and only then are promoted and claimed.

Deadlines are hard (docs/approvals.md, "Deadlines are hard"): a hook with a deadline (its event's
NotBefore) is gone by ``NotBefore − deadline_margin``: SIGKILL to its process group KILL_LEAD
before that, SIGTERM ``grace_for`` the time it has before the SIGKILL (5 s at most) or after
``hook_timeout``, whichever comes first; ``SEFWD_DEADLINE`` is the SIGTERM. A hook whose last
moment has passed before a worker took it does not run (``failed``, ``Reason: deadline_passed``).
When Azure moves NotBefore earlier, ``checked(document)`` (every committed document) moves the
deadline of every open hook row of that event, and a running hook's SIGTERM and SIGKILL with it;
``tighten_deadline(action_id, not_before)`` does the same for one action (e.g. a drain of this
VM's hold, from the document the hold was computed from).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from forwarder.approval.approver import APPROVED, FAILED, HELD, REFUSED
from forwarder.approval.hooks import HookDeadline, describe_command, run_hook
from forwarder.approval.planner import RAN, SKIPPED, SUPERSEDED, action_audit
from forwarder.approval.policy import APPROVE, decide
from forwarder.approval.scope import scope_refusal
from forwarder.approval.settings import ApprovalConfig
from forwarder.approval.wakeup import Wakeup
from forwarder.errors import DocumentError, ForwarderError, ImdsError
from forwarder.imds.client import ImdsClient
from forwarder.imds.differ import changed_fields
from forwarder.imds.document import Document, Event, parse_document, parse_event
from forwarder.imds.identity import VmIdentity
from forwarder.records import rfc3339
from forwarder.store import actions as rows
from forwarder.store.actions import APPROVE as APPROVE_KIND
from forwarder.store.actions import POSTING, Action
from forwarder.store.database import Store, put_approvals

log = logging.getLogger(__name__)

# SIGKILL this long before NotBefore − deadline_margin, so that the hook is gone by then even when a
# busy machine wakes this thread late (the kill itself takes microseconds).
KILL_LEAD = 0.5
MAX_ATTEMPTS = 5  # an action that keeps ending the agent (or failing to reach IMDS) gives up
IMDS_RETRY = 5.0  # an approval whose fresh document could not be read is tried again this much later
IDLE_WAIT = 30.0
KEEP_FINISHED = 30 * 86400.0  # finished rows are forgotten after this long (checked hourly)


class ActionRunner:
    """The scheduler and the worker pool; ``wake()`` after a commit that planned actions."""

    def __init__(
        self,
        config: ApprovalConfig,
        store: Store,
        imds: Callable[[], ImdsClient],
        vm: Callable[[], VmIdentity],
        stop: threading.Event,
        *,
        clock: Callable[[], float] = time.time,
        on_outcome: Callable[[str, str], None] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self._imds = imds
        self.vm = vm
        self.stop = stop
        self.clock = clock
        self.on_outcome = on_outcome  # (kind, final state) of every finished action: metrics
        self._wake = threading.Event()
        self._work = Wakeup()  # the scheduler's "due rows are there" to the workers
        self._threads: list[threading.Thread] = []
        # Set by the first checked(): until then no row is promoted or claimed (see the module docstring).
        self._checked = threading.Event()
        self._followed: Document | None = None  # the last document checked() followed
        self._running: dict[int, HookDeadline] = {}  # hooks running now, by action id
        self._running_lock = threading.Lock()
        self._posting_left: list[int] = []  # approvals a previous process left posting: due after the first poll

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ActionRunner:
        # Left running by a previous process: due again, so that the first poll's planner can supersede
        # them when their event changed or left meanwhile; but an approval that may have been posted
        # stays running until that poll is committed (then it is due, and IMDS says what happened).
        # (a hold's enter/leave is not ours: forwarder.protect recovers it, stopping what is still running)
        left = [a for a in rows.left_running(self.store) if a.kind in rows.WORKER_KINDS]
        self._posting_left = [a.id for a in left if a.phase == POSTING]
        rows.make_due(self.store, [a.id for a in left if a.phase != POSTING], self.clock())
        if left:
            log.warning("%d action(s) were running when the agent stopped: taking them up again after the first poll",
                        len(left))
        self._threads.append(threading.Thread(target=self._schedule, name="actions-scheduler", daemon=True))
        for n in range(self.config.workers):
            self._threads.append(threading.Thread(target=self._worker, name=f"action-worker-{n}", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def wake(self, *_: object) -> None:
        """Something was planned or finished: look at the store now."""
        self._wake.set()

    def checked(self, document: Document | None = None) -> None:
        """A poll's document is committed (after the planner re-checked the open rows against it):
        open hook rows follow its NotBefore, and the first call lets the rows recovered at start run."""
        if document is not None and document is not self._followed:
            self._followed = document
            try:
                self._follow(document)
            except ForwarderError as exc:
                log.error("cannot move the deadlines of running hooks: %s", exc)
        if not self._checked.is_set():
            try:
                rows.make_due(self.store, self._posting_left, self.clock())
            except ForwarderError as exc:
                log.error("cannot take up the approvals left posting: %s", exc)
                return  # the next committed poll tries again
            self._checked.set()
            self.wake()
            self._work.notify_all()

    def tighten_deadline(self, action_id: int, not_before: float) -> bool:
        """Action ``action_id`` must now be over by ``not_before`` (epoch seconds) less deadline_margin,
        when that is earlier than its deadline: the row's deadline moves (committed) and, if it is a
        hook running now, its SIGTERM and SIGKILL too. True when something moved."""
        moved = rows.tighten(self.store, action_id, not_before, self.clock())
        with self._running_lock:
            limit = self._running.get(action_id)
        if limit is not None:
            now, mono = self.clock(), time.monotonic()
            moved = limit.tighten(mono + self.kill_time(not_before) - now, mono) or moved
        if moved:
            log.warning("action %d: NotBefore moved earlier (%s): its deadline follows", action_id,
                        rfc3339(datetime.fromtimestamp(not_before, timezone.utc)))
        return moved

    def _follow(self, document: Document) -> None:
        """Open hook rows whose event's NotBefore is now earlier than their deadline: tightened."""
        events = {e.event_id.lower(): e for e in document.events if e.not_before is not None and not e.started}
        if not events:
            return
        with self.store.transaction() as c:
            open_rows = rows.rows(c, "kind != ? AND state IN ('planned', 'due', 'running') AND deadline IS NOT NULL",
                                  (APPROVE_KIND,))
        for row in open_rows:
            event = events.get(row.event_id.lower())
            if event is not None and event.not_before is not None and row.deadline is not None \
                    and event.not_before.timestamp() < row.deadline:
                self.tighten_deadline(row.id, event.not_before.timestamp())

    def close(self, timeout: float = 8.0) -> None:
        """Stop (``stop`` must be set): running hooks are terminated and their rows left to rerun."""
        self._wake.set()
        self._work.notify_all()
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        left = [t.name for t in self._threads if t.is_alive()]
        if left:
            log.warning("action threads still running at shutdown: %s", ", ".join(left))

    # -- scheduler ---------------------------------------------------------------------------
    def _schedule(self) -> None:
        next_prune = 0.0
        while not self.stop.is_set():
            if not self._checked.is_set():  # the first poll has not checked the rows yet
                if self._wake.wait(IDLE_WAIT):
                    self._wake.clear()
                continue
            wait = IDLE_WAIT
            try:
                now = self.clock()
                if now >= next_prune:
                    next_prune = now + 3600.0
                    rows.prune(self.store, now - KEEP_FINISHED)
                nxt = rows.next_due(self.store)
                if nxt is not None and nxt <= now:
                    rows.promote(self.store, now)
                    nxt = rows.next_due(self.store)
                if nxt is not None:
                    # (a row still planned at its time waits for the hook before it: look again soon)
                    left = nxt - self.clock()
                    wait = 1.0 if left <= 0 else min(IDLE_WAIT, max(0.05, left))
                waiting = self.store.query("SELECT count(*) FROM actions WHERE state = 'due'")[0][0]
                if waiting:
                    self._work.notify(int(waiting))
            except ForwarderError as exc:
                log.error("action scheduler: %s", exc)
                wait = 1.0
            if self._wake.wait(wait):
                self._wake.clear()

    # -- workers -----------------------------------------------------------------------------
    def _worker(self) -> None:
        client: ImdsClient | None = None
        try:
            while not self.stop.is_set():
                # Marked before the look: a notify between the look and the wait is not slept through.
                mark = self._work.mark()
                action = None
                if self._checked.is_set():
                    try:
                        action = rows.claim(self.store, self.clock())
                    except ForwarderError as exc:
                        log.error("cannot take an action from the store: %s", exc)
                if action is None:
                    self._work.wait(mark, IDLE_WAIT, self.stop)
                    continue
                if client is None and action.kind == APPROVE_KIND:
                    client = self._imds()
                try:
                    self._execute(action, client)
                finally:
                    self.wake()
        finally:
            if client is not None:
                client.close()

    def _execute(self, action: Action, client: ImdsClient | None) -> None:
        try:
            if action.attempts > MAX_ATTEMPTS:
                self._finish(action, rows.FAILED, action_audit(
                    FAILED, "too_many_attempts", action, state=rows.FAILED,
                    Detail=f"taken up {action.attempts - 1} times without an outcome"))
            elif action.kind == APPROVE_KIND:
                assert client is not None
                self._approve(action, client)
            else:
                self._hook(action)
        except Exception as exc:  # never let an action kill a worker
            log.exception("action %d (%s for %s) failed", action.id, action.kind, action.event_id)
            try:
                self._finish(action, rows.FAILED, action_audit(FAILED, "internal_error", action, state=rows.FAILED,
                                                               Detail=f"{type(exc).__name__}: {exc}"))
            except ForwarderError:
                pass

    def _finish(self, action: Action, state: str, entry: dict[str, Any], *, approved: str | None = None) -> None:
        """The outcome, its audit entry (and an accepted approval) in one transaction."""
        now = self.clock()
        result = {k: entry.get(k) for k in ("Outcome", "Reason", "Detail", "Hook", "ImdsStatus")}
        with self.store.transaction() as c:
            if rows.finish(c, action.id, state, result, now):
                self.store.inbox_put(c, entry)
                if approved is not None:
                    put_approvals(c, [approved], now)
        level = logging.INFO if state == rows.DONE or (entry["Outcome"] == SKIPPED and state == rows.SKIPPED) \
            else logging.WARNING
        log.log(level, "%saction %d (%s %s for %s): %s (%s)", "dry run: " if action.dry_run else "", action.id,
                action.kind, action.hook or action.rule or "", action.event_id, entry["Outcome"], entry["Reason"])
        if self.on_outcome is not None:
            try:
                self.on_outcome(action.kind, state)  # done, failed, skipped, superseded: alertable, bounded
            except Exception:  # noqa: BLE001 - metrics must never stop an action
                log.exception("action outcome observer failed")

    # -- hooks and undo hooks ----------------------------------------------------------------
    def kill_time(self, not_before: float) -> float:
        """When a hook for an event at ``not_before`` gets SIGKILL (epoch seconds)."""
        return not_before - self.config.deadline_margin - KILL_LEAD

    def hook_deadline(self, action: Action, now: float, mono: float) -> HookDeadline | None:
        """When the hook gets SIGTERM and SIGKILL (monotonic); None when its last moment has passed."""
        if action.deadline is None:
            return HookDeadline.after(self.config.hook_timeout, mono)
        left = self.kill_time(action.deadline) - now
        return HookDeadline.by(mono + left, self.config.hook_timeout, mono) if left > 0 else None

    @staticmethod
    def hook_variables(action: Action, limit: HookDeadline, now: float, mono: float) -> dict[str, str]:
        """``SEFWD_DEADLINE`` (RFC 3339) and ``SEFWD_SECONDS_LEFT``: when SIGTERM comes; ``SEFWD_ACTION_ID``."""
        left = max(0.0, limit.times()[0] - mono)
        end = datetime.fromtimestamp(now + left, timezone.utc)
        return {"SEFWD_DEADLINE": rfc3339(end) or "", "SEFWD_SECONDS_LEFT": str(int(left)),
                "SEFWD_ACTION_ID": str(action.id)}

    def _hook(self, action: Action) -> None:
        spec = self.config.hooks.get(action.hook or "")
        if spec is None:
            self._finish(action, rows.SKIPPED, action_audit(SKIPPED, "hook_not_configured", action, state=rows.SKIPPED))
            return
        if action.dry_run or self.config.dry_run:
            self._finish(action, rows.SKIPPED, action_audit(
                SKIPPED, "dry_run", action, state=rows.SKIPPED, DryRun=True,
                Detail=f"would run: {describe_command(spec.command)}"))
            return
        now = self.clock()
        if self.stop.is_set():  # taken just as the agent stops: it runs at the next start
            rows.release(self.store, action.id, now, now)
            return
        mono = time.monotonic()
        limit = self.hook_deadline(action, now, mono)
        if limit is None:  # too late: it would not be gone by NotBefore − deadline_margin
            self._finish(action, rows.FAILED, action_audit(
                SKIPPED, "deadline_passed", action, state=rows.FAILED,
                Detail=f"not run: NotBefore less deadline_margin ({self.config.deadline_margin:g} s) had passed "
                       f"when a worker took it"))
            return
        with self._running_lock:
            self._running[action.id] = limit
        try:
            # A tighten_deadline() between the claim and the line above moved only the row: read it again.
            fresh = self._get(action.id)
            if fresh is not None and fresh.deadline is not None and (action.deadline is None or fresh.deadline < action.deadline):
                limit.tighten(mono + self.kill_time(fresh.deadline) - now, mono)
            env = self.hook_variables(action, limit, now, mono)
            result = run_hook(spec.command, action.record or {}, deadline=limit, output_limit=self.config.hook_output_limit,
                              stop=self.stop, extra_env=env, env_allow=self.config.hook_env)
        finally:
            with self._running_lock:
                self._running.pop(action.id, None)
        if self.stop.is_set() and not result.ok and not result.timed_out:
            # Interrupted by the agent stopping: the row stays to run again at the next start.
            rows.release(self.store, action.id, self.clock(), self.clock())
            log.info("action %d (%s hook for %s) interrupted by the stop; it runs again at the next start",
                     action.id, action.hook, action.event_id)
            return
        reason = "hook_ok" if result.ok else "hook_timed_out" if result.timed_out else "hook_failed"
        state = rows.DONE if result.ok else rows.FAILED
        self._finish(action, state, action_audit(RAN, reason, action, state=state, Hook=result.to_audit()))

    # -- approvals ---------------------------------------------------------------------------
    def _approve(self, action: Action, client: ImdsClient) -> None:
        hook_audit: Mapping[str, Any] | None = None
        if action.after is not None:
            gate = self._get(action.after)
            hook_audit = (gate.result or {}).get("Hook") if gate is not None else None
            dry = gate is not None and gate.state == rows.SKIPPED and (gate.result or {}).get("Reason") == "dry_run"
            if gate is None or not (gate.state == rows.DONE or dry):
                reason = "hook_failed" if gate is not None and gate.state == rows.FAILED else "hook_did_not_run"
                self._finish(action, rows.SKIPPED, action_audit(HELD, reason, action, state=rows.SKIPPED, Hook=hook_audit,
                                                                Detail=f"hook action {action.after}: {gate.state if gate else 'gone'}"))
                return
        try:
            client.forget_etag()  # the body is needed, not a 304
            fetch = client.scheduled_events()
            document = parse_document(fetch.body or b"")
        except (ImdsError, DocumentError) as exc:
            if action.deadline is not None and self.clock() + IMDS_RETRY < action.deadline and action.attempts < MAX_ATTEMPTS:
                log.warning("action %d: cannot read the document before approving (%s); trying again in %gs",
                            action.id, exc, IMDS_RETRY)
                rows.release(self.store, action.id, self.clock() + IMDS_RETRY, self.clock())
                return
            self._finish(action, rows.FAILED, action_audit(FAILED, "imds_unavailable", action, state=rows.FAILED,
                                                           Detail=str(exc), Hook=hook_audit,
                                                           ImdsStatus=getattr(exc, "status", None)))
            return
        current = next((e for e in document.events if e.event_id.lower() == action.event_id.lower()), None)
        fields: dict[str, Any] = {"Hook": hook_audit, "DocumentIncarnation": document.incarnation}
        if action.phase == POSTING:  # a POST may have left before the agent stopped: what did IMDS do?
            if current is not None and current.started:
                self._finish(action, rows.DONE, action_audit(
                    APPROVED, "approved_before_restart", action, state=rows.DONE, **fields,
                    Detail="the approval was posted before the agent stopped; IMDS shows the event Started"),
                    approved=current.event_id)
                return
            if current is None:
                self._finish(action, rows.FAILED, action_audit(
                    FAILED, "outcome_unknown", action, state=rows.FAILED, **fields,
                    Detail="the approval may have been posted before the agent stopped; the event has left the document"))
                return
            # An earlier POST (a failed one retried here, or one a stop or crash cut short) left no trace.
            log.info("action %d: an earlier approval POST did not take effect (the event is still Scheduled); "
                     "checking again", action.id)
        refusal = self._recheck(action, current)
        if refusal is not None:
            outcome, reason, detail = refusal
            state = rows.DONE if outcome == APPROVED else rows.FAILED if outcome == REFUSED else rows.SUPERSEDED
            self._finish(action, state, action_audit(outcome, reason, action, state=state, Detail=detail, **fields))
            return
        assert current is not None
        if action.dry_run or self.config.dry_run:
            self._finish(action, rows.SKIPPED, action_audit(
                SKIPPED, "dry_run", action, state=rows.SKIPPED, DryRun=True, **fields,
                Detail=f"would post StartRequests for {current.event_id} (rule {action.rule})"))
            return
        rows.mark_posting(self.store, action.id, self.clock())
        try:
            # One request's time: the client does not send the POST again on its own (a lost answer
            # may hide an accepted POST); this worker asks IMDS before any further attempt.
            client.start_requests([current.event_id], deadline=client.timeout)
        except ImdsError as exc:
            if self._started(client, current.event_id):
                # No answer (a timeout, a dropped connection) or an error, but IMDS did act on the POST.
                self._finish(action, rows.DONE, action_audit(
                    APPROVED, "approved_unanswered", action, state=rows.DONE, **fields,
                    Detail=f"the POST failed ({exc}) but IMDS shows the event Started"), approved=current.event_id)
                return
            if exc.retryable and action.attempts < MAX_ATTEMPTS and (
                    action.deadline is None or self.clock() + IMDS_RETRY < action.deadline):
                log.warning("action %d: the approval POST failed (%s); asking IMDS again in %gs", action.id, exc, IMDS_RETRY)
                rows.release(self.store, action.id, self.clock() + IMDS_RETRY, self.clock())
                return
            self._finish(action, rows.FAILED, action_audit(FAILED, "imds_post_failed", action, state=rows.FAILED,
                                                           Detail=str(exc), **{**fields, "ImdsStatus": exc.status}))
            return
        self._finish(action, rows.DONE, action_audit(APPROVED, "approved", action, state=rows.DONE, ImdsStatus=200, **fields),
                     approved=current.event_id)

    @staticmethod
    def _started(client: ImdsClient, event_id: str) -> bool:
        """Whether IMDS shows the event Started now (False when it cannot say)."""
        try:
            client.forget_etag()
            document = parse_document(client.scheduled_events().body or b"")
        except (ImdsError, DocumentError):
            return False
        return any(e.event_id.lower() == event_id.lower() and e.started for e in document.events)

    def _get(self, action_id: int) -> Action | None:
        with self.store.transaction() as c:
            return rows.get(c, action_id)

    def _recheck(self, action: Action, current: Event | None) -> tuple[str, str, str] | None:
        """None when ``current`` may still be approved under the action's rule, else (outcome, reason, detail)."""
        if current is None:
            return SUPERSEDED, "event_gone", "the event is no longer in the document"
        if current.started:
            return SUPERSEDED, "already_started", "the event is already Started"
        if self.store.approved(current.event_id):
            return APPROVED, "already_approved", "this VM approved the event before"
        seen = parse_event(action.event, 0)
        changed = changed_fields(seen, current)
        if changed:
            return SUPERSEDED, "event_changed", f"changed since the rule saw it: {', '.join(changed)}"
        if action.rule is not None:  # (asked for by the callback: no rule to re-check, only the event and the scope)
            decision = decide(self.config.rules, current, self.vm())
            if decision.action != APPROVE or decision.rule != action.rule:
                return SUPERSEDED, "rule_no_longer_matches", f"the policy now says {decision.action} (rule {decision.rule})"
        why = scope_refusal(current, self.vm(), self.config.scope)
        if why is not None:
            return REFUSED, "out_of_scope", why
        return None
