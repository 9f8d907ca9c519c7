"""Is this VM about to be, or being, maintained? Derived from the committed document and the clock only.

The poller hands every committed document to :class:`MaintenanceTracker` right after the commit
(and once per cycle, so time-driven turns — ``NotBefore − lead`` reached, the settle time over —
happen without a new document). The tracker keeps the events that matter (of a configured type,
affecting this VM) and those that ended recently; :func:`evaluate` turns them and "now" into a
:class:`MaintenanceView`. Three readers publish it, read-only: the probe endpoint
(forwarder.agent.probe), the state file (:class:`StateFile`) and the telemetry gauges.

States: ``serving`` (probe 200), ``maintenance`` (503: an event is Started, or Scheduled and its
window has opened: at once without ``lead``, else from ``NotBefore − lead``; an unknown NotBefore
opens it at once), ``settling`` (503: such an event ended less than ``settle`` ago).
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from forwarder.common.logs import RateLimitedLog
from forwarder.imds.document import Document, Event
from forwarder.imds.event_types import EVENT_TYPES
from forwarder.imds.identity import VmIdentity
from forwarder.records import rfc3339, utcnow

log = logging.getLogger(__name__)

KNOWN_TYPES = EVENT_TYPES  # metric labels; any other type is counted as "other"
# The types that take the VM away for longer than a pause; a Freeze (seconds, memory kept) is left out.
DEFAULT_TYPES = ("Reboot", "Redeploy", "Preempt", "Terminate")
ALL_TYPES = "*"
SERVING, MAINTENANCE, SETTLING = "serving", "maintenance", "settling"
STATE_FILE_NAME = "maintenance.json"
RUN_DIR = Path("/run/sefwd")


@dataclass(frozen=True)
class MaintenancePolicy:
    """Which events take the VM out of rotation, and when."""

    event_types: frozenset[str] | None = frozenset(DEFAULT_TYPES)  # None: every type, future ones too
    lead: float | None = None  # None: from the moment the event is Scheduled; else from NotBefore − lead
    settle: float = 30.0  # after the event ended

    def wants(self, event_type: str | None) -> bool:
        return self.event_types is None or (event_type or "") in self.event_types


@dataclass(frozen=True, slots=True)
class Tracked:
    """An event of a configured type that affects this VM, as the last committed document shows it."""

    event_id: str
    event_type: str | None
    status: str | None
    not_before: datetime | None

    def window_opens(self, policy: MaintenancePolicy) -> datetime | None:
        """When the probe turns 503 for it; None = it already has (Started, no lead, or no NotBefore)."""
        if self.status != "Scheduled" or policy.lead is None or self.not_before is None:
            return None
        return self.not_before - timedelta(seconds=policy.lead)

    def active(self, policy: MaintenancePolicy, now: datetime) -> bool:
        opens = self.window_opens(policy)
        return opens is None or now >= opens


@dataclass(frozen=True, slots=True)
class Ended:
    """A tracked event that left the document while it held the VM out of rotation."""

    event: Tracked
    settle_until: datetime


@dataclass(frozen=True)
class MaintenanceView:
    """What the probe, the state file and the gauge say at one moment."""

    state: str
    event: Tracked | None = None
    until: datetime | None = None  # when this state is expected to change by the clock alone
    seconds_left: float | None = None
    changes_at: datetime | None = None  # the next moment evaluate() gives another answer (cache bound)
    incarnation: int | str | None = None  # DocumentIncarnation of the committed document it came from

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    def as_dict(self) -> dict[str, Any]:
        event = self.event
        return {
            "state": self.state,
            "EventId": event.event_id if event else None,
            "EventType": event.event_type if event else None,
            "EventStatus": (event.status if self.state != SETTLING else "Ended") if event else None,
            "NotBefore": rfc3339(event.not_before) if event else None,
            "seconds_left": None if self.seconds_left is None else int(self.seconds_left + 0.999),
            "until": rfc3339(self.until),
            "DocumentIncarnation": self.incarnation,
        }


def relevant_events(document: Document | None, vm: VmIdentity, policy: MaintenancePolicy) -> tuple[Tracked, ...]:
    """The document's events of a configured type whose Resources name this VM (unknown own name: all)."""
    if document is None:
        return ()
    out = []
    for event in document.events:
        if policy.wants(event.event_type) and affects(vm, event) is not False:
            out.append(Tracked(event.event_id, event.event_type, event.status, event.not_before))
    return tuple(out)


def affects(vm: VmIdentity, event: Event) -> bool | None:
    """Whether the event is this VM's: its Resources name this VM, or name none (an event for nobody in
    particular is everyone's); None when the VM does not know its own name. The hold (forwarder.protect)
    uses the same answer, so the probe and the drain agree."""
    if not event.resources:
        return True
    return vm.affected_by(event.resources)


def evaluate(events: Iterable[Tracked], ended: Iterable[Ended], policy: MaintenancePolicy,
             now: datetime, incarnation: int | str | None = None) -> MaintenanceView:
    """The view at ``now``: a pure function of the tracked events, the recently ended ones and the clock."""
    active: list[Tracked] = []
    upcoming: list[tuple[datetime, Tracked]] = []
    for event in events:
        opens = event.window_opens(policy)
        if opens is None or now >= opens:
            active.append(event)
        else:
            upcoming.append((opens, event))
    next_open = min((at for at, _ in upcoming), default=None)
    second = now.replace(microsecond=0) + timedelta(seconds=1)  # seconds_left ticks once a second
    if active:
        # Started first (it is happening), then the earliest NotBefore.
        def order(e: Tracked) -> tuple[int, datetime]:
            return (0 if e.status == "Started" else 1, e.not_before or now)

        event = min(active, key=order)
        until = event.not_before if event.status == "Scheduled" and event.not_before is not None else None
        left = max(0.0, (until - now).total_seconds()) if until is not None else None
        return MaintenanceView(MAINTENANCE, event, until, left, second if until is not None and left else None,
                               incarnation)
    settling = [e for e in ended if e.settle_until > now]
    if settling:
        last = max(settling, key=lambda e: e.settle_until)
        left = (last.settle_until - now).total_seconds()
        changes = min(second, last.settle_until, next_open or last.settle_until)
        return MaintenanceView(SETTLING, last.event, last.settle_until, left, changes, incarnation)
    if upcoming:
        opens, event = min(upcoming, key=lambda pair: pair[0])
        return MaintenanceView(SERVING, event, opens, (opens - now).total_seconds(), min(second, opens), incarnation)
    return MaintenanceView(SERVING, incarnation=incarnation)


@dataclass
class _Snapshot:
    document: Document | None
    events: tuple[Tracked, ...]
    ended: tuple[Ended, ...]
    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    earliest_not_before: datetime | None = None


PENDING_TYPES = (*KNOWN_TYPES, "other")
PENDING_STATUSES = ("Scheduled", "Started", "other")
PENDING_SCOPES = ("true", "false")  # affects this VM (an unknown own name counts as "true")


def pending_counts(document: Document | None, vm: VmIdentity) -> dict[tuple[str, str, str], int]:
    """Events by (type, status, affects_this_vm), every combination present (zero or more): bounded labels."""
    counts = {(t, s, a): 0 for t in PENDING_TYPES for s in PENDING_STATUSES for a in PENDING_SCOPES}
    for event in document.events if document is not None else ():
        etype = event.event_type if event.event_type in KNOWN_TYPES else "other"
        status = event.status if event.status in ("Scheduled", "Started") else "other"
        scope = "false" if affects(vm, event) is False else "true"
        counts[(etype or "other", status or "other", scope)] += 1
    return counts


class MaintenanceTracker:
    """Follows the committed documents; answers :meth:`view` for any moment. Thread-safe.

    ``observe`` runs on the poller's thread; readers (probe handlers, metric collection) read one
    immutable snapshot, swapped whole.
    """

    def __init__(self, policy: MaintenancePolicy, vm: Callable[[], VmIdentity],
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.policy = policy
        self._vm = vm
        self.clock = clock
        self._snap = _Snapshot(None, (), (), pending_counts(None, VmIdentity()))
        self._lock = threading.Lock()  # observe() against observe() (start-up seeding vs the poller)
        self._listeners: list[Callable[[MaintenanceView, datetime], None]] = []

    def add_listener(self, listener: Callable[[MaintenanceView, datetime], None]) -> None:
        """Called (on the poller's thread) after every observe() with the view at that moment."""
        self._listeners.append(listener)

    def observe(self, document: Document | None, now: datetime | None = None) -> MaintenanceView:
        """Take the committed ``document`` (the same object again = nothing new) and publish the view."""
        now = now or self.clock()
        with self._lock:
            snap = self._snap
            if document is not snap.document:
                vm = self._vm()
                events = relevant_events(document, vm, self.policy)
                current = {e.event_id for e in events}
                ended = [e for e in snap.ended if e.settle_until > now and e.event.event_id not in current]
                settle = timedelta(seconds=self.policy.settle)
                for old in snap.events:
                    # Ended while it held the VM out: settle. Gone before its window opened: nothing happened.
                    if old.event_id not in current and old.active(self.policy, now) and settle:
                        ended.append(Ended(old, now + settle))
                nbs = [e.not_before for e in document.events if e.status == "Scheduled" and e.not_before is not None
                       and affects(vm, e) is not False] if document is not None else []
                snap = self._snap = _Snapshot(document, events, tuple(ended), pending_counts(document, vm),
                                              min(nbs, default=None))
        view = self._evaluate(snap, now)
        for listener in self._listeners:
            try:
                listener(view, now)
            except Exception:  # a reader must never stop the poller
                log.exception("maintenance: publishing the state failed")
        return view

    def view(self, now: datetime | None = None) -> MaintenanceView:
        return self._evaluate(self._snap, now or self.clock())

    def _evaluate(self, snap: _Snapshot, now: datetime) -> MaintenanceView:
        incarnation = snap.document.incarnation if snap.document is not None else None
        return evaluate(snap.events, snap.ended, self.policy, now, incarnation)

    @property
    def generation(self) -> object:
        """Changes (by identity) whenever a new document was taken: a cache of views keys on it."""
        return self._snap

    def pending(self) -> dict[tuple[str, str, str], int]:
        """Events in the committed document by (type, status, affects_this_vm): a fixed set of keys."""
        return self._snap.counts

    def seconds_to_not_before(self, now: datetime | None = None) -> float | None:
        """Seconds to the earliest NotBefore of a Scheduled event affecting this VM; None when there is none."""
        earliest = self._snap.earliest_not_before
        return None if earliest is None else (earliest - (now or self.clock())).total_seconds()


# -- the state file ---------------------------------------------------------------------------------

def default_state_file(state_dir: Path, *, is_root: bool | None = None) -> Path:
    """/run/sefwd/maintenance.json as root or when /run/sefwd is ours (systemd RuntimeDirectory), else in the state dir."""
    if is_root is None:
        is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if is_root or (RUN_DIR.is_dir() and os.access(RUN_DIR, os.W_OK)):
        return RUN_DIR / STATE_FILE_NAME
    return state_dir / STATE_FILE_NAME


class StateFile:
    """The view as JSON in a file, replaced atomically (temp file, fsync, rename) when it changes.

    Rewritten at least every ``refresh`` seconds, so ``written_at``/``stale_after`` tell a reader
    whether the agent is still behind it. Removed on a clean stop.
    """

    def __init__(self, path: Path, refresh: float) -> None:
        self.path = Path(path)
        self.refresh = refresh
        self._last_key: tuple[Any, ...] | None = None
        self._last_write: datetime | None = None
        self._errors = RateLimitedLog(log)

    def content(self, view: MaintenanceView, now: datetime) -> dict[str, Any]:
        body = view.as_dict()
        body["written_at"] = rfc3339(now)
        body["stale_after"] = rfc3339(now + timedelta(seconds=3 * self.refresh))
        return body

    def __call__(self, view: MaintenanceView, now: datetime) -> None:
        event = view.event
        key = (view.state, event, view.until, view.incarnation)
        due = self._last_write is None or (now - self._last_write).total_seconds() >= self.refresh or now < self._last_write
        if key == self._last_key and not due:
            return
        try:
            write_atomically(self.path, orjson.dumps(self.content(view, now), option=orjson.OPT_APPEND_NEWLINE))
        except OSError as exc:
            self._errors.log(logging.ERROR, "write", "maintenance: cannot write the state file %s: %s", self.path, exc)
            return
        self._errors.clear("write")
        self._last_key, self._last_write = key, now

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("maintenance: cannot remove the state file %s: %s", self.path, exc)


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Readers see the old file or the new one, never a part: temp file in the same directory, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if hasattr(os, "fchmod"):  # not on Windows, where the directory's ACL decides
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
