"""What the poller observes for ``forwarder.imds.outcome``: boot id, pauses, approvals IMDS accepted.

The part that must survive a restart is one JSON-able dict (``evidence_to_dict`` /
``evidence_from_dict``) that the state keeps beside the last document.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from forwarder.imds.outcome import EvidenceContext

log = logging.getLogger(__name__)

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
MAX_APPROVALS = 256  # approvals remembered (oldest dropped); an event lives hours at most
FORMAT = 1


def read_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """The kernel's boot id (changes on every boot); None where there is none (Windows, containers)."""
    try:
        return path.read_text(encoding="ascii").strip()[:64] or None
    except (OSError, UnicodeDecodeError):
        return None


class EvidenceTracker:
    """Gathers the poller's evidence; owned and called by the poller thread only."""

    def __init__(self, boot_id: str | None, seen_boot_id: str | None,
                 approvals: dict[str, datetime] | None = None) -> None:
        self.boot_id = boot_id
        # The boot id when the saved document was seen (None: unknown); differs after a reboot.
        self.seen_boot_id = seen_boot_id
        self.approvals: dict[str, datetime] = dict(approvals or {})
        self.pause_seconds = 0.0
        self._last: tuple[float, datetime] | None = None

    @property
    def rebooted(self) -> bool | None:
        if self.boot_id is None or self.seen_boot_id is None:
            return None
        return self.boot_id != self.seen_boot_id

    def observe_poll(self, mono: float, wall: datetime, expected_gap: float) -> None:
        """A successful poll: a stall since the previous one (Freeze) counts as a pause."""
        if self._last is not None:
            mono_gap = mono - self._last[0]
            wall_gap = (wall - self._last[1]).total_seconds()
            # A paused VM: the wall clock moved on while the monotonic clock did not, or both moved
            # but the poll came late.
            stall = max(0.0, wall_gap - mono_gap) + max(0.0, mono_gap - expected_gap)
            self.pause_seconds = max(self.pause_seconds, stall)
        self._last = (mono, wall)

    def approval_accepted(self, event_ids: Iterable[str], at: datetime) -> None:
        for event_id in event_ids:
            self.approvals.setdefault(event_id.lower(), at)
        if len(self.approvals) > MAX_APPROVALS:
            keep = sorted(self.approvals.items(), key=lambda kv: kv[1])[-MAX_APPROVALS:]
            self.approvals = dict(keep)

    def context(self, now: datetime, vm_names: Iterable[str]) -> EvidenceContext:
        return EvidenceContext(now=now, approvals=dict(self.approvals), rebooted=self.rebooted,
                               pause_seconds=self.pause_seconds,
                               vm_names=frozenset(n.lower() for n in vm_names if n))

    def document_committed(self) -> None:
        """The new document is now the one last seen: at this boot, with no pause behind it."""
        self.seen_boot_id = self.boot_id
        self.pause_seconds = 0.0


def evidence_to_dict(tracker: EvidenceTracker) -> dict[str, Any]:
    """What must survive a restart: the boot id the last document was seen at, and accepted approvals."""
    return {
        "format": FORMAT,
        "seen_boot_id": tracker.seen_boot_id,
        "approvals": {k: v.isoformat() for k, v in tracker.approvals.items()},
    }


def evidence_from_dict(raw: object, boot_id: str | None) -> EvidenceTracker:
    """The tracker after a restart; anything unreadable is dropped (it only weakens evidence)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        # No saved boot id: whether the machine rebooted since the saved document is unknown.
        return EvidenceTracker(boot_id, None)
    seen = raw.get("seen_boot_id")
    approvals: dict[str, datetime] = {}
    items = raw.get("approvals")
    for key, value in (items.items() if isinstance(items, dict) else ()):
        try:
            moment = datetime.fromisoformat(str(value))
        except ValueError:
            continue
        if isinstance(key, str) and moment.tzinfo is not None:
            approvals[key.lower()] = moment
    return EvidenceTracker(boot_id, seen if isinstance(seen, str) else None, approvals)
