"""The hold's own worker: runs this VM's enter and leave rows, one at a time, never queued behind other hooks.

One thread, so a hold's transitions never overlap; ``after`` (forwarder.protect.hold) orders them
across restarts. A running enter is cut off at its deadline (the earliest NotBefore less
``deadline_margin``), re-read from its row while it runs: when Azure moves NotBefore, the cut-off
moves with it. A transition the agent's stop interrupts runs again at the next start; one a
``kill -9`` cut short is taken up again (its commands must be idempotent, as the recipes are).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forwarder.approval.hooks import describe_command, run_hook
from forwarder.protect.hold import ENTERED, LEFT, Hold, entry, missed
from forwarder.protect.settings import ProtectConfig
from forwarder.records import rfc3339
from forwarder.store import actions as rows
from forwarder.store.actions import ENTER, LEAVE, Action
from forwarder.store.database import Store
from forwarder.errors import ForwarderError

log = logging.getLogger(__name__)

KINDS = (ENTER, LEAVE)
MAX_ATTEMPTS = 5  # a transition that keeps ending the agent gives up (and says so)
IDLE_WAIT = 5.0
WATCH = 0.05  # how often a running transition's deadline and the stop are looked at
MIN_TIMEOUT = 1.0  # an enter started after its deadline still gets this long


def _when(epoch: float | None) -> str | None:
    return rfc3339(datetime.fromtimestamp(epoch, timezone.utc)) if epoch is not None else None


def hold_record(action: Action) -> dict[str, Any]:
    """What the command reads on stdin (and its SEFWD_EVENT_* variables): the hold and the events behind it."""
    events = [e for e in action.event.get("Events") or [] if isinstance(e, Mapping)]
    first = events[0] if events else {}
    return {
        "id": f"hold-{action.after or 0}-{action.id}", "type": f"protect.{action.kind}",
        "data": {**{k: first.get(k) for k in ("EventId", "EventType", "EventStatus", "EventSource", "Resources",
                                              "NotBefore", "DurationInSeconds", "Description")},
                 "Change": action.kind, "AffectsThisVm": True, "Hold": action.id if action.kind == ENTER else action.after,
                 "EventIds": action.event.get("EventIds") or [], "Events": events},
    }


class HoldWorker:
    """Takes due enter/leave rows from the store and runs them; ``wake()`` after a commit that planned one."""

    def __init__(self, config: ProtectConfig, store: Store, stop: threading.Event, *, output_limit: int = 4096,
                 env_allow: Sequence[str] = (), hold_dir: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.stop = stop
        self.output_limit = output_limit
        self.env_allow = tuple(dict.fromkeys((*env_allow, *config.hook_env)))
        self.hold_dir = hold_dir
        self.clock = clock
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def recover(store: Store, now: float, hold_dir: Path | None = None) -> int:
        """At start, before anything runs: transitions a crash left ``running`` are due again, and a
        command the killed agent left running is stopped first (two drains at once, or a drain still
        running when the undo starts, is what the hold exists to prevent)."""
        with store.transaction() as c:
            ids = [int(r[0]) for r in c.execute("SELECT id FROM actions WHERE state = 'running' AND kind IN (?, ?)",
                                                KINDS).fetchall()]
            c.execute("UPDATE actions SET state = 'due', updated = ? WHERE state = 'running' AND kind IN (?, ?)",
                      (now, *KINDS))
        if ids and hold_dir is not None:
            stop_leftovers(hold_dir, ids)
        return len(ids)

    def start(self) -> HoldWorker:
        if self.hold_dir is not None:
            self.hold_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="protect-worker", daemon=True)
        self._thread.start()
        return self

    def wake(self, *_: object) -> None:
        self._wake.set()

    def close(self, timeout: float = 8.0) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("protect worker still running at shutdown")

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stop.is_set():
            wait = IDLE_WAIT
            try:
                now = self.clock()
                rows.promote(self.store, now)
                action = rows.claim(self.store, now, kinds=KINDS)
                if action is not None:
                    self._run(action)
                    continue
                row = self.store.query("SELECT min(due) FROM actions WHERE state = 'planned' AND kind IN (?, ?)", KINDS)
                if row and row[0][0] is not None:
                    wait = min(IDLE_WAIT, max(0.01, float(row[0][0]) - self.clock()))
            except ForwarderError as exc:
                log.error("protect worker: %s", exc)
                wait = 1.0
            except Exception:  # noqa: BLE001 - the hold's worker must outlive a bug in one transition
                log.exception("protect worker: unexpected error")
                wait = 1.0
            if self._wake.wait(wait):
                self._wake.clear()

    def _finish(self, action: Action, state: str, audit: Mapping[str, Any] | None, result: Mapping[str, Any]) -> bool:
        now = self.clock()
        with self.store.transaction() as c:
            done = rows.finish(c, action.id, state, result, now)
            if done and audit is not None:
                self.store.inbox_put(c, dict(audit))
        return done

    def _enter_row(self, action: Action) -> Action | None:
        if action.kind == ENTER:
            return action
        with self.store.transaction() as c:
            return rows.get(c, action.after) if action.after is not None else None

    def _run(self, action: Action) -> None:
        enter = self._enter_row(action) or action
        hold = Hold(enter, action if action.kind == LEAVE else None)
        command = self.config.enter if action.kind == ENTER else self.config.leave
        if action.attempts > MAX_ATTEMPTS:
            self._finish(action, rows.FAILED, missed(f"{action.kind}_gave_up", f"taken up {action.attempts - 1} times "
                                                    "without an outcome", hold),
                         {"Outcome": "failed", "Reason": "too_many_attempts"})
            log.warning("protect: %s (action %d) gave up after %d attempts", action.kind, action.id, action.attempts - 1)
            return
        if command is None:  # no leave configured: the hold is over all the same
            self._finish(action, rows.DONE, entry(LEFT, "nothing_to_run", enter, **self._times(enter, action)),
                         {"Outcome": LEFT, "Reason": "nothing_to_run"})
            return
        if action.dry_run:
            outcome = ENTERED if action.kind == ENTER else LEFT
            self._finish(action, rows.SKIPPED, entry(outcome, "dry_run", enter, DryRun=True,
                                                     Detail=f"would run: {describe_command(command)}"),
                         {"Outcome": "skipped", "Reason": "dry_run"})
            log.info("dry run: protect %s (action %d) would run %s", action.kind, action.id, describe_command(command))
            return
        if self.stop.is_set():
            rows.release(self.store, action.id, self.clock(), self.clock())
            return
        self._execute(action, enter, hold, command)

    def _execute(self, action: Action, enter: Action, hold: Hold, command: Sequence[str] | str) -> None:
        now = self.clock()
        margin = self.config.deadline_margin
        timeout = self._cutoff(action, now, action.deadline) - now
        env = {
            "SEFWD_TRANSITION": action.kind,
            "SEFWD_HOLD_ID": str(enter.id),
            "SEFWD_HOLD_EVENTS": ",".join(str(i) for i in enter.event.get("EventIds") or []),
            "SEFWD_ACTION_ID": str(action.id),
            "SEFWD_DEADLINE": _when(now + timeout) or "",
            "SEFWD_SECONDS_LEFT": str(int(timeout)),
        }
        if self.hold_dir is not None:
            env["SEFWD_HOLD_DIR"] = str(self.hold_dir)
        cut, hit = threading.Event(), threading.Event()
        watcher = threading.Thread(target=self._watch, args=(action, now, cut, hit),
                                   name=f"protect-{action.kind}-watch", daemon=True)
        watcher.start()
        log.info("protect: %s (action %d, hold %d) for %s: running %s (at most %.0fs)", action.kind, action.id,
                 enter.id, env["SEFWD_HOLD_EVENTS"], describe_command(command), timeout)
        try:
            # Bounded by the watcher (the deadline as it moves, and the stop), not by run_hook's own timeout.
            result = run_hook(command, hold_record(action), timeout=self.config.timeout + 60.0,
                              output_limit=self.output_limit, stop=cut, extra_env=env, env_allow=self.env_allow)
        finally:
            cut.set()
            watcher.join()
        finished = self.clock()
        if self.stop.is_set() and not hit.is_set() and not result.ok:
            rows.release(self.store, action.id, finished, finished)
            log.info("protect: %s (action %d) interrupted by the stop; it runs again at the next start",
                     action.kind, action.id)
            return
        audit = result.to_audit()
        if hit.is_set():
            audit["TimedOut"] = True
            audit["Error"] = None
        times = self._times(enter, action if action.kind == LEAVE else None, finished=finished)
        if result.ok:
            outcome, reason = (ENTERED, "enter_ok") if action.kind == ENTER else (LEFT, "leave_ok")
            record = entry(outcome, reason, enter, Hook=audit, **times)
            self._finish(action, rows.DONE, record, {"Outcome": outcome, "Reason": reason, "Hook": audit,
                                                     "FinishedAt": finished})
            log.info("protect: %s (action %d) done%s", action.kind, action.id,
                     f"; slack to NotBefore {times['DrainSlackSeconds']:.1f}s"
                     if times.get("DrainSlackSeconds") is not None else "")
            return
        why = "deadline" if hit.is_set() or result.timed_out else "failed"
        reason = f"{action.kind}_{why}"
        cut_off = (f"enter was cut off at its deadline ({margin:g}s before NotBefore)" if action.kind == ENTER
                   else f"leave was cut off after timeout ({self.config.timeout:g}s)")
        detail = (cut_off if why == "deadline"
                  else f"{action.kind} failed: exit code {result.exit_code}{', ' + result.error if result.error else ''}")
        self._finish(action, rows.FAILED, missed(reason, detail, hold, Transition=action.kind, Hook=audit, **times),
                     {"Outcome": "failed", "Reason": reason, "Hook": audit, "FinishedAt": finished})
        log.warning("protect: %s (action %d, hold %d) %s: %s", action.kind, action.id, enter.id,
                    "hit its deadline" if why == "deadline" else "failed", detail)

    def _cutoff(self, action: Action, started: float, deadline: float | None) -> float:
        """When a transition started at ``started`` is cut off: NotBefore less the margin for an enter
        (at least MIN_TIMEOUT after its start), never later than ``timeout`` after it."""
        hard = started + self.config.timeout
        if action.kind != ENTER or deadline is None:
            return hard
        return min(hard, max(started + MIN_TIMEOUT, deadline - self.config.deadline_margin))

    def _watch(self, action: Action, started: float, cut: threading.Event, hit: threading.Event) -> None:
        """Cut the running transition at the agent's stop, or at its deadline as its row says now."""
        cutoff = self._cutoff(action, started, action.deadline)
        last_read = started
        while not cut.is_set():
            if self.stop.is_set():
                cut.set()
                return
            now = self.clock()
            if action.kind == ENTER and now - last_read >= 0.25:  # NotBefore may have moved since
                last_read = now
                try:
                    cutoff = self._cutoff(action, started, self._deadline(action.id))
                except ForwarderError:
                    pass
            if now >= cutoff:
                hit.set()
                cut.set()
                return
            cut.wait(WATCH)

    def _times(self, enter: Action, leave: Action | None, *, finished: float | None = None) -> dict[str, Any]:
        """When the hold's steps happened; for an enter: the slack to NotBefore (the drain slack)."""
        finished = self.clock() if finished is None else finished
        if leave is None:
            deadline = self._deadline(enter.id)
            return {"NotBefore": _when(deadline), "FinishedAt": _when(finished),
                    "DrainSlackSeconds": round(deadline - finished, 3) if deadline is not None else None}
        entered = self._entered_at(enter.id)
        return {"EnteredAt": _when(entered), "LeftAt": _when(finished),
                "OutOfServiceSeconds": round(finished - entered, 3) if entered is not None else None}

    def _deadline(self, action_id: int) -> float | None:
        found = self.store.query("SELECT deadline FROM actions WHERE id = ?", (action_id,))
        return float(found[0][0]) if found and found[0][0] is not None else None

    def _entered_at(self, action_id: int) -> float | None:
        """When the hold's enter finished (its result says; None if it never did)."""
        with self.store.transaction() as c:
            enter = rows.get(c, action_id)
        value = (enter.result or {}).get("FinishedAt") if enter is not None else None
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _environ(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def stop_leftovers(hold_dir: Path, action_ids: Sequence[int]) -> list[int]:
    """SIGTERM (then SIGKILL) the process groups still running one of ``action_ids`` for this state
    directory: found by the variables the agent gave them (SEFWD_HOLD_DIR, SEFWD_ACTION_ID), so never
    another agent's command nor an unrelated process that reused a pid. Linux only (/proc)."""
    wanted = {str(i) for i in action_ids}
    groups: set[int] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        env = _environ(pid)
        if env.get("SEFWD_HOLD_DIR") == str(hold_dir) and env.get("SEFWD_ACTION_ID") in wanted:
            try:
                groups.add(os.getpgid(int(pid)))
            except OSError:
                continue
    for pgid in sorted(groups):
        if pgid in (0, 1, os.getpgid(0)):
            continue  # (never our own group, nor init's)
        log.warning("protect: a transition the stopped agent started is still running (process group %d): "
                    "stopping it before it runs again", pgid)
        _end_group(pgid)
    return sorted(groups)


def _end_group(pgid: int, grace: float = 5.0) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _group_running(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _group_running(pgid: int) -> bool:
    """Whether a process of the group is alive and not a zombie (orphans wait for init to reap them)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def hold_dir(state_dir: Path) -> Path:
    """Where the recipes remember what they did for a hold (so they undo only that)."""
    return state_dir / "protect"

