"""Approval policy: the first ``[[approval.rules]]`` entry that matches an event decides."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forwarder.approval.settings import Rule
from forwarder.imds.document import Event
from forwarder.imds.identity import VmIdentity

APPROVE, HOLD, IGNORE = "approve", "hold", "ignore"


@dataclass(frozen=True)
class Decision:
    """What the policy says about one event; ``rule`` is None when no rule matched."""

    action: str  # "approve" | "hold" | "ignore"
    rule: str | None
    delay: float = 0.0
    after_hooks: bool = False


# Without rules nothing is approved automatically: the event proceeds at NotBefore.
NO_MATCH = Decision(HOLD, None)


def _in(allowed: tuple[str, ...] | None, value: str | None) -> bool:
    return allowed is None or (value is not None and value in allowed)


def matches(rule: Rule, event: Event, vm: VmIdentity) -> bool:
    """Whether every match field the rule sets holds for ``event`` as seen by ``vm``."""
    if not (_in(rule.event_type, event.event_type)
            and _in(rule.event_source, event.event_source)
            and _in(rule.event_status, event.status)):
        return False
    if rule.duration_min is not None or rule.duration_max is not None:
        # An event that does not say how long it lasts cannot be shown to be short.
        duration = event.duration_seconds
        if duration is None:
            return False
        if rule.duration_min is not None and duration < rule.duration_min:
            return False
        if rule.duration_max is not None and duration > rule.duration_max:
            return False
    if rule.affects_this_vm is not None and vm.affected_by(event.resources) is not rule.affects_this_vm:
        return False  # None (we do not know our own name) matches neither true nor false
    count = len(event.resources)
    if rule.resources_min is not None and count < rule.resources_min:
        return False
    if rule.resources_max is not None and count > rule.resources_max:
        return False
    if rule.description is not None:
        if event.description is None or rule.description.search(event.description) is None:
            return False
    return True


def decide(rules: Sequence[Rule], event: Event, vm: VmIdentity) -> Decision:
    """The first matching rule's action; hold when none matches."""
    for rule in rules:
        if matches(rule, event, vm):
            if rule.action == APPROVE:
                return Decision(APPROVE, rule.name, rule.delay, rule.after_hooks)
            return Decision(rule.action, rule.name)
    return NO_MATCH


# The seed's advanced sample (Windows 2020-07-01 doc): log Started events, approve user-initiated
# events at once, approve Freeze with 0 <= DurationInSeconds < 9, leave everything else.
SEED_SAMPLE_RULES: tuple[Rule, ...] = (
    Rule(name="log-started", action=IGNORE, event_status=("Started",)),
    Rule(name="user-initiated", action=APPROVE, event_source=("User",)),
    Rule(name="short-freeze", action=APPROVE, event_type=("Freeze",), duration_min=0, duration_max=8),
    Rule(name="everything-else", action=HOLD),
)

# ``sefwd demo``: the same decisions, limited to Scheduled events (a Started one cannot be approved).
DEMO_RULES: tuple[Rule, ...] = (
    Rule(name="short-freeze", action=APPROVE, event_type=("Freeze",), event_status=("Scheduled",),
         duration_min=0, duration_max=8),
    Rule(name="user-initiated", action=APPROVE, event_source=("User",), event_status=("Scheduled",)),
    Rule(name="everything-else", action=HOLD),
)
