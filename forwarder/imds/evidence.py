"""What the poller observes for ``forwarder.imds.outcome``: reboots, pauses, approvals IMDS accepted.

The part that must survive a restart is one JSON-able dict (``evidence_to_dict`` /
``evidence_from_dict``) that the state keeps beside the last document.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from forwarder.imds.outcome import EvidenceContext

log = logging.getLogger(__name__)

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
PROC_STAT_PATH = Path("/proc/stat")
MAX_APPROVALS = 256  # approvals remembered (oldest dropped); an event lives hours at most
FORMAT = 1
# Boot times of one boot read at two moments agree within this (whole seconds in /proc/stat, and a
# wall clock that time sync may have stepped a little in between); a reboot moves it further.
BOOT_TIME_TOLERANCE = 5.0

# How the agent knows whether the machine rebooted since the event was last seen (data.Evidence.RebootedBy).
BY_PROCESS = "process"  # this very process saw it: it outlived no boot
BY_BOOT_ID = "boot_id"
BY_BOOT_TIME = "boot_time"


def read_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """The kernel's boot id (changes on every boot); None where there is none (Windows, some containers)."""
    try:
        return path.read_text(encoding="ascii").strip()[:64] or None
    except (OSError, UnicodeDecodeError):
        return None


def read_boot_time(proc_stat: Path = PROC_STAT_PATH) -> float | None:
    """When the machine booted, in Unix seconds; None where it cannot be told cheaply.

    Linux: ``btime`` of ``/proc/stat`` (also the host's boot in a container). Windows: now minus
    ``GetTickCount64`` (milliseconds since boot, sleep included). Both follow wall-clock steps, which
    is why boot times are compared with ``BOOT_TIME_TOLERANCE``.
    """
    try:
        with proc_stat.open("rb") as stat:
            for line in stat:
                if line.startswith(b"btime "):
                    return float(int(line.split()[1]))
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "win32":
        import ctypes

        try:
            ticks = getattr(ctypes, "windll").kernel32.GetTickCount64
            ticks.restype = ctypes.c_ulonglong
            return time.time() - ticks() / 1000.0
        except (AttributeError, OSError):
            return None
    return None


def rebooted_by_boot_time(boot_time: float | None, seen_boot_time: float | None,
                          seen_at: float | None) -> bool | None:
    """Whether the machine booted between ``seen_at`` and now, from two readings of the boot time.

    The same boot: both readings agree (within the tolerance). Rebooted: the boot time moved forward
    and now lies after the moment the document was seen. Anything else (a clock stepped far, a
    reading missing) is unknown, so it can never make a cancel.
    """
    if boot_time is None or seen_boot_time is None:
        return None
    if abs(boot_time - seen_boot_time) <= BOOT_TIME_TOLERANCE:
        return False
    if boot_time > seen_boot_time and seen_at is not None and boot_time > seen_at - BOOT_TIME_TOLERANCE:
        return True
    return None


class EvidenceTracker:
    """Gathers the poller's evidence; owned and called by the poller thread only."""

    def __init__(self, boot_id: str | None, seen_boot_id: str | None,
                 approvals: dict[str, datetime] | None = None, *, boot_time: float | None = None,
                 seen_boot_time: float | None = None, seen_at: float | None = None) -> None:
        self.boot_id = boot_id
        # The boot id when the saved document was seen (None: unknown); differs after a reboot.
        self.seen_boot_id = seen_boot_id
        # The same for machines without a boot id: boot time (Unix s) then, and when it was seen.
        self.boot_time = boot_time
        self.seen_boot_time = seen_boot_time
        self.seen_at = seen_at
        # This process saw the current document itself: no boot can lie in between.
        self.seen_in_process = False
        self.approvals: dict[str, datetime] = dict(approvals or {})
        # Events seen starting early without this agent's approval (outcome.APPROVED_ELSEWHERE).
        self.approved_elsewhere: dict[str, datetime] = {}
        self.pause_seconds = 0.0
        self._last: tuple[float, datetime] | None = None  # clocks at the start of the last good poll
        self._overslept = 0.0  # sleep beyond what was asked, since that poll

    @property
    def rebooted_by(self) -> str | None:
        """Which evidence tells whether the machine rebooted since the document was seen; None: nothing."""
        if self.seen_in_process:
            return BY_PROCESS
        if self.boot_id is not None and self.seen_boot_id is not None:
            return BY_BOOT_ID
        if rebooted_by_boot_time(self.boot_time, self.seen_boot_time, self.seen_at) is not None:
            return BY_BOOT_TIME
        return None

    @property
    def rebooted(self) -> bool | None:
        by = self.rebooted_by
        if by == BY_PROCESS:
            return False
        if by == BY_BOOT_ID:
            return self.boot_id != self.seen_boot_id
        if by == BY_BOOT_TIME:
            return rebooted_by_boot_time(self.boot_time, self.seen_boot_time, self.seen_at)
        return None

    # -- pauses ---------------------------------------------------------------------------------
    def observe_sleep(self, asked: float, slept: float) -> None:
        """The poller slept ``slept`` monotonic seconds when it asked for ``asked``.

        A VM whose monotonic clock counts a Freeze wakes up late by the length of the Freeze. Work
        between polls (a slow IMDS answer, a store commit, an identity refresh) is not sleep, so it
        never counts.
        """
        self._overslept += max(0.0, slept - asked)

    def observe_poll(self, mono: float, wall: datetime) -> None:
        """A good poll, with both clocks read before its request; closes one span of observation.

        The span's stall is how far the wall clock ran ahead of the monotonic clock (a guest whose
        monotonic clock stood still during a Freeze has its wall clock stepped forward by time
        sync afterwards), plus the oversleep inside it. Both clocks run alike while the agent
        merely waits for a slow answer, so that is no stall.
        """
        stall = self._overslept
        if self._last is not None and mono >= self._last[0]:
            mono_gap = mono - self._last[0]
            wall_gap = (wall - self._last[1]).total_seconds()
            stall += max(0.0, wall_gap - mono_gap)
        self.pause_seconds = max(self.pause_seconds, stall)
        self._overslept = 0.0
        self._last = (mono, wall)

    # -- approvals, context ---------------------------------------------------------------------
    def approval_accepted(self, event_ids: Iterable[str], at: datetime) -> None:
        for event_id in event_ids:
            self.approvals.setdefault(event_id.lower(), at)
        self.approvals = _newest(self.approvals)

    def approval_seen_elsewhere(self, event_ids: Iterable[str], at: datetime) -> None:
        """These events started early without an approval of this agent (``outcome.early_start``)."""
        for event_id in event_ids:
            self.approved_elsewhere.setdefault(event_id.lower(), at)
        self.approved_elsewhere = _newest(self.approved_elsewhere)

    def context(self, now: datetime, vm_names: Iterable[str]) -> EvidenceContext:
        return EvidenceContext(now=now, approvals=dict(self.approvals), rebooted=self.rebooted,
                               rebooted_by=self.rebooted_by, pause_seconds=self.pause_seconds,
                               vm_names=frozenset(n.lower() for n in vm_names if n),
                               approved_elsewhere=dict(self.approved_elsewhere))

    def document_seen(self, at: float) -> bool:
        """This process saw the saved document again (an unchanged poll); True the first time.

        The first time, the caller saves the evidence (``evidence_to_dict``), so that a later
        restart compares boots with this sighting, not with an older boot that saw it first.
        """
        if self.seen_in_process:
            return False
        self._seen_now(at)
        return True

    def document_committed(self, at: float | None = None) -> None:
        """The new document is now the one last seen: by this process, with no pause behind it."""
        self._seen_now(at if at is not None else time.time())
        self.pause_seconds = 0.0

    def _seen_now(self, at: float) -> None:
        self.seen_in_process = True
        self.seen_boot_id = self.boot_id
        self.seen_boot_time = self.boot_time
        self.seen_at = at


def _newest(moments: dict[str, datetime]) -> dict[str, datetime]:
    """At most ``MAX_APPROVALS`` entries, the oldest dropped (an event lives hours at most)."""
    if len(moments) <= MAX_APPROVALS:
        return moments
    return dict(sorted(moments.items(), key=lambda kv: kv[1])[-MAX_APPROVALS:])


def _moments(items: object) -> dict[str, datetime]:
    """A saved ``{EventId: RFC 3339}`` map; unreadable entries are dropped (they only weaken evidence)."""
    out: dict[str, datetime] = {}
    for key, value in (items.items() if isinstance(items, dict) else ()):
        try:
            moment = datetime.fromisoformat(str(value))
        except ValueError:
            continue
        if isinstance(key, str) and moment.tzinfo is not None:
            out[key.lower()] = moment
    return out


def evidence_to_dict(tracker: EvidenceTracker) -> dict[str, Any]:
    """What must survive a restart: the boot the last document was seen at, and accepted approvals."""
    return {
        "format": FORMAT,
        "seen_boot_id": tracker.seen_boot_id,
        "seen_boot_time": tracker.seen_boot_time,
        "seen_at": tracker.seen_at,
        "approvals": {k: v.isoformat() for k, v in tracker.approvals.items()},
        "approved_elsewhere": {k: v.isoformat() for k, v in tracker.approved_elsewhere.items()},
    }


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def evidence_from_dict(raw: object, boot_id: str | None, boot_time: float | None = None) -> EvidenceTracker:
    """The tracker after a restart; anything unreadable is dropped (it only weakens evidence)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        # Nothing saved: whether the machine rebooted since the saved document is unknown.
        return EvidenceTracker(boot_id, None, boot_time=boot_time)
    seen = raw.get("seen_boot_id")
    tracker = EvidenceTracker(boot_id, seen if isinstance(seen, str) else None, _newest(_moments(raw.get("approvals"))),
                              boot_time=boot_time, seen_boot_time=_number(raw.get("seen_boot_time")),
                              seen_at=_number(raw.get("seen_at")))
    tracker.approved_elsewhere = _newest(_moments(raw.get("approved_elsewhere")))
    return tracker
