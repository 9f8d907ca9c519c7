"""Pure approval decisions over sefwd records: whom a record speaks for, which events to approve,
once, and on which VM."""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import streamauth

DECIDED_TYPES = ("scheduledevent.scheduled", "scheduledevent.updated")
# Terminal records: every VM sends one per event, all with eventkey "<EventId>:ended" and the VM's
# conclusion in data.Outcome. The fleet's outcome is the strongest: completed > unknown > canceled.
TERMINAL_TYPES = ("scheduledevent.completed", "scheduledevent.canceled", "scheduledevent.ended")
FOLD_ORDER = {"completed": 2, "unknown": 1, "canceled": 0}
ALL_EVENT_TYPES = frozenset({"Freeze", "Reboot", "Redeploy", "Preempt", "Terminate"})


def _csv(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class Policy:
    """What this approver approves; the default is the seed's advanced sample."""

    # Events from these sources are approved (the seed: every user-initiated event).
    approve_sources: frozenset[str] = frozenset({"User"})
    # Freeze events with 0 <= DurationInSeconds <= this are approved (the seed: < 9); None = never.
    max_freeze_seconds: float | None = 8.0
    # Types this approver may approve at all; a type outside it is never approved, whatever the source.
    event_types: frozenset[str] = ALL_EVENT_TYPES

    @classmethod
    def from_settings(cls, env: Mapping[str, str]) -> Policy:
        """From app settings: APPROVE_EVENT_TYPES, APPROVE_EVENT_SOURCES, MAX_FREEZE_SECONDS."""
        types = env.get("APPROVE_EVENT_TYPES", "").strip()
        sources = env.get("APPROVE_EVENT_SOURCES")
        freeze = env.get("MAX_FREEZE_SECONDS", "").strip()
        max_freeze: float | None = cls.max_freeze_seconds
        if freeze:
            # "off" (or a negative number) turns the short-freeze rule off entirely.
            max_freeze = None if freeze.lower() in ("off", "none", "never") or float(freeze) < 0 else float(freeze)
        return cls(
            approve_sources=_csv(sources) if sources is not None else cls.approve_sources,
            max_freeze_seconds=max_freeze,
            event_types=ALL_EVENT_TYPES if types in ("", "*") else _csv(types),
        )


def _duration(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def should_approve(record: Mapping[str, Any], policy: Policy) -> tuple[bool, str]:
    """(approve?, snake_case reason) for one sefwd CloudEvents record."""
    if record.get("type") not in DECIDED_TYPES:
        return False, "not_a_scheduling_record"
    data = record.get("data")
    if not isinstance(data, Mapping):
        return False, "no_data"
    if data.get("EventStatus") != "Scheduled":
        return False, "not_scheduled"
    if not data.get("EventId"):
        return False, "no_event_id"
    resources = data.get("Resources")
    if not isinstance(resources, list) or not any(isinstance(r, str) and r.lstrip("_") for r in resources):
        return False, "no_resources"
    event_type = data.get("EventType")
    if event_type not in policy.event_types:
        return False, "event_type_not_allowed"
    if data.get("EventSource") in policy.approve_sources:
        return True, "user_initiated" if data.get("EventSource") == "User" else "event_source_allowed"
    if event_type == "Freeze" and policy.max_freeze_seconds is not None:
        seconds = _duration(data.get("DurationInSeconds"))
        # -1 (or no field) means "unknown": an unknown freeze is never a short one.
        if seconds is None or seconds < 0:
            return False, "freeze_duration_unknown"
        if seconds <= policy.max_freeze_seconds:
            return True, "short_freeze"
        return False, "freeze_too_long"
    return False, "no_rule_matched"


_VM_ID = re.compile(
    r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.Compute/"
    r"(?:virtualMachineScaleSets/(?P<set>[^/]+)/virtualMachines/(?P<instance>[^/]+)|virtualMachines/(?P<vm>[^/]+))$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class VmIdentity:
    """A VM as the stream's authentication knows it: the resourceId its key was derived for.

    ``name`` is the VM as IMDS names it in ``Resources``: the VM name, or ``<scale set>_<instance>``
    for a scale-set instance (FACTS: Resources names).
    """

    resource_id: str
    name: str
    subscription_id: str
    resource_group: str

    @classmethod
    def from_resource_id(cls, resource_id: str) -> VmIdentity | None:
        """None for anything that is not a VM's resourceId (a ``/vm/<vmId>`` source names no VM)."""
        match = _VM_ID.match(resource_id.strip())
        if match is None:
            return None
        name = match["vm"] or f"{match['set']}_{match['instance']}"
        return cls(resource_id.strip(), name, match["sub"], match["rg"])

    def named_in(self, resources: Iterable[Any]) -> bool:
        """Whether ``Resources`` names this VM ("_" prefix of 2017-03-01 stripped, any case)."""
        mine = self.name.lower()
        return any(isinstance(r, str) and r.lstrip("_").lower() == mine for r in resources)


def authenticated_vm(record: Mapping[str, Any], masters: Iterable[bytes]) -> VmIdentity | None:
    """The VM that authenticated ``record`` (its ``sefwdauth`` made with the key derived for the
    resourceId in ``source``), or None: then the record is untrusted and nothing may act on it.

    Only the identity is proven; every field the VM wrote (Resources, EventSource, EventType,
    DurationInSeconds, NotBefore, Vm...) is that VM's claim about its own IMDS document.
    """
    source = record.get("source")
    if not isinstance(source, str) or not streamauth.verify(record, masters):
        return None
    return VmIdentity.from_resource_id(source)


def record_age(record: Mapping[str, Any], now: datetime | None = None) -> float | None:
    """Seconds since the record's ``time`` (negative: from the future); None when it has none."""
    text = record.get("time")
    if not isinstance(text, str):
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return ((now or datetime.now(timezone.utc)) - when).total_seconds()


def target_vm(record: Mapping[str, Any]) -> str:
    """The VM allowed to approve the event under sefwd's default scope: the leader.

    The leader is the first of the sorted Resources, leading "_" stripped (2017-03-01 names),
    compared case-insensitively — the same rule the agent applies (``VmIdentity.is_leader``), so
    every copy of an availability-set event, from whichever VM, points at the same VM. For an
    event of one VM alone (scope ``self``) that VM is its own leader.
    """
    data = record.get("data")
    resources = data.get("Resources") if isinstance(data, Mapping) else None
    names = [r.lstrip("_") for r in resources or () if isinstance(r, str) and r.lstrip("_")]
    if not names:
        raise ValueError("record has no Resources to pick the approving VM from")
    return min(names, key=lambda name: (name.lower(), name))


# The signed event fields an update can change: two different updates of one event are two changes.
UPDATE_FIELDS = ("EventType", "Resources", "EventStatus", "NotBefore", "NotBeforeRaw", "Description", "EventSource",
                 "DurationInSeconds")


def dedupe_key(vm: VmIdentity, record: Mapping[str, Any]) -> str:
    """The de-duplication key of a change: the authenticated VM, the signed ``data.EventId`` and the
    change (the record type's kind; an update also a digest of the signed event fields), never a
    free-text field such as ``eventkey``: a VM's record can only ever take its own key, so no VM can
    make another VM's genuine record a "duplicate"."""
    raw = record.get("data")
    data: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    kind = str(record.get("type", "")).rpartition(".")[2]
    key = f"{vm.resource_id.lower()}|{str(data.get('EventId', '')).lower()}:{kind}"
    if kind == "updated":
        values = {f: sorted(map(str, data[f])) if f == "Resources" and isinstance(data.get(f), list) else data.get(f)
                  for f in UPDATE_FIELDS}
        key += ":" + hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return key


@dataclass
class Deduper:
    """Remembers keys already decided for ``ttl`` seconds (bounded); thread-safe.

    ``claim`` marks a key as taken; ``release`` gives it back after a transient failure so the next
    copy of the record (another VM of the set sends one too) gets another chance.
    """

    ttl: float = 6 * 3600.0  # longer than any notice period (Redeploy/Reboot/Freeze: 10-15 min)
    max_keys: int = 100_000
    clock: Callable[[], float] = time.monotonic
    _seen: OrderedDict[str, float] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def claim(self, key: str) -> bool:
        """True the first time ``key`` is seen within ``ttl``; False for a duplicate."""
        now = self.clock()
        with self._lock:
            while self._seen:
                oldest, when = next(iter(self._seen.items()))
                if now - when < self.ttl and len(self._seen) < self.max_keys:
                    break
                self._seen.popitem(last=False)
            if key in self._seen:
                return False
            self._seen[key] = now
            return True

    def settle(self, key: str) -> None:
        """A claim here lasts until ``release`` or ``ttl``: nothing to do."""

    def release(self, key: str) -> None:
        with self._lock:
            self._seen.pop(key, None)


def record_outcome(record: Mapping[str, Any]) -> str | None:
    """This VM's conclusion in a terminal record (older agents: from the type); None otherwise."""
    rtype = record.get("type")
    if rtype not in TERMINAL_TYPES:
        return None
    data = record.get("data")
    outcome = data.get("Outcome") if isinstance(data, Mapping) else None
    if outcome in FOLD_ORDER:
        return str(outcome)
    return {"scheduledevent.completed": "completed", "scheduledevent.canceled": "canceled"}.get(str(rtype), "unknown")


@dataclass
class OutcomeFolder:
    """The strongest outcome per key in this process (fleet_state.Folds for one instance); thread-safe.

    ``fold`` returns the folded value and whether it changed, so a consumer acts (logs, alerts,
    closes a ticket) once per key and once more only if a stronger outcome arrives later.
    """

    ttl: float = 6 * 3600.0
    max_events: int = 100_000
    clock: Callable[[], float] = time.monotonic
    _outcomes: OrderedDict[str, tuple[str, int, float]] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fold(self, key: str, value: str, rank: int) -> tuple[str, bool]:
        now = self.clock()
        with self._lock:
            while self._outcomes:
                _, (_, _, when) = next(iter(self._outcomes.items()))
                if now - when < self.ttl and len(self._outcomes) < self.max_events:
                    break
                self._outcomes.popitem(last=False)
            previous = self._outcomes.get(key)
            if previous is not None and previous[1] >= rank:
                return previous[0], False
            self._outcomes[key] = (value, rank, previous[2] if previous else now)
            return value, True
