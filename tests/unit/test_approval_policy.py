"""Approval policy: every match field and action, first match wins, the seed sample's rules."""
from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.approval.policy import DEMO_RULES, SEED_SAMPLE_RULES, Decision, decide
from forwarder.approval.settings import Rule
from forwarder.imds.document import Event, parse_event
from forwarder.emulator import builtin_scenarios, load_scenario
from forwarder.imds.identity import VmIdentity
from tests.conftest import examples

VM = VmIdentity(name="myVM", computer_name="myvm")
NAMELESS = VmIdentity()


def event(**fields: Any) -> Event:
    raw: dict[str, Any] = {
        "EventId": "E-1", "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["myVM"],
        "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": "Platform", "DurationInSeconds": 5,
    }
    for key, value in fields.items():
        if value is _DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    return parse_event(raw, 0)


_DROP = object()


def verdict(rule: Rule, ev: Event, vm: VmIdentity = VM) -> str:
    return decide([rule], ev, vm).action


def approve(**match: Any) -> Rule:
    return Rule(name="r", action="approve", **match)


# -- no rules, actions, order ----------------------------------------------------------------------

def test_no_rules_holds() -> None:
    assert decide([], event(), VM) == Decision("hold", None)


def test_no_matching_rule_holds() -> None:
    assert decide([approve(event_type=("Reboot",))], event(), VM) == Decision("hold", None)


@pytest.mark.parametrize("action", ["approve", "hold", "ignore"])
def test_each_action_is_returned_with_the_rule_name(action: str) -> None:
    assert decide([Rule(name="only", action=action)], event(), VM) == Decision(action, "only")


def test_approve_carries_delay_and_after_hooks() -> None:
    rule = Rule(name="later", action="approve", delay=30.0, after_hooks=True)
    assert decide([rule], event(), VM) == Decision("approve", "later", 30.0, True)


def test_first_matching_rule_wins() -> None:
    rules = [
        Rule(name="reboots", action="approve", event_type=("Reboot",)),
        Rule(name="platform", action="ignore", event_source=("Platform",)),
        Rule(name="freezes", action="approve", event_type=("Freeze",)),
        Rule(name="rest", action="hold"),
    ]
    assert decide(rules, event(), VM) == Decision("ignore", "platform")
    assert decide(rules, event(EventType="Reboot"), VM) == Decision("approve", "reboots")
    assert decide(rules, event(EventSource="User"), VM) == Decision("approve", "freezes")
    assert decide(rules, event(EventSource="User", EventType="Preempt"), VM) == Decision("hold", "rest")


# -- match fields ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, key, good, bad", [
    ("event_type", "EventType", "Freeze", "Reboot"),
    ("event_source", "EventSource", "Platform", "User"),
    ("event_status", "EventStatus", "Scheduled", "Started"),
])
def test_string_fields_match_any_listed_value_case_sensitively(field: str, key: str, good: str, bad: str) -> None:
    assert verdict(approve(**{field: (good,)}), event(**{key: good})) == "approve"
    assert verdict(approve(**{field: ("Other", good)}), event(**{key: good})) == "approve"
    assert verdict(approve(**{field: (good,)}), event(**{key: bad})) == "hold"
    assert verdict(approve(**{field: (good,)}), event(**{key: good.lower()})) == "hold"
    # An event without the field never matches a rule that names values for it.
    assert verdict(approve(**{field: (good,)}), event(**{key: _DROP})) == "hold"


@pytest.mark.parametrize("duration, expected", [(-1, "hold"), (0, "approve"), (4, "approve"), (8, "approve"), (9, "hold")])
def test_duration_bounds_are_inclusive(duration: int, expected: str) -> None:
    assert verdict(approve(duration_min=0, duration_max=8), event(DurationInSeconds=duration)) == expected


def test_one_sided_duration_bounds() -> None:
    assert verdict(approve(duration_min=10), event(DurationInSeconds=10)) == "approve"
    assert verdict(approve(duration_min=10), event(DurationInSeconds=9)) == "hold"
    assert verdict(approve(duration_max=10), event(DurationInSeconds=-1)) == "approve"
    assert verdict(approve(duration_max=10), event(DurationInSeconds=11)) == "hold"


@pytest.mark.parametrize("rule", [approve(duration_min=-100), approve(duration_max=100),
                                  approve(duration_min=-100, duration_max=100)])
def test_event_without_duration_never_matches_a_duration_bound(rule: Rule) -> None:
    assert verdict(rule, event(DurationInSeconds=_DROP)) == "hold"
    assert verdict(rule, event(DurationInSeconds="")) == "hold"
    assert verdict(approve(), event(DurationInSeconds=_DROP)) == "approve"


def test_affects_this_vm() -> None:
    mine, other = event(Resources=["_MYVM", "otherVM"]), event(Resources=["otherVM"])
    assert verdict(approve(affects_this_vm=True), mine) == "approve"
    assert verdict(approve(affects_this_vm=True), other) == "hold"
    assert verdict(approve(affects_this_vm=False), other) == "approve"
    assert verdict(approve(affects_this_vm=False), mine) == "hold"
    # A VM that does not know its own name cannot tell: neither true nor false matches.
    assert verdict(approve(affects_this_vm=True), mine, NAMELESS) == "hold"
    assert verdict(approve(affects_this_vm=False), other, NAMELESS) == "hold"
    assert verdict(approve(), other, NAMELESS) == "approve"


@pytest.mark.parametrize("count, expected", [(0, "hold"), (1, "approve"), (2, "approve"), (3, "hold")])
def test_resources_count_bounds_are_inclusive(count: int, expected: str) -> None:
    ev = event(Resources=[f"vm{i}" for i in range(count)])
    assert verdict(approve(resources_min=1, resources_max=2), ev) == expected


def test_description_is_searched_as_a_regex() -> None:
    assert verdict(approve(description=re.compile("Live Migration")), event()) == "approve"
    assert verdict(approve(description=re.compile(r"^Virtual .* paused")), event()) == "approve"
    assert verdict(approve(description=re.compile("^Live")), event()) == "hold"
    assert verdict(approve(description=re.compile("live migration")), event()) == "hold"
    assert verdict(approve(description=re.compile("(?i)live migration")), event()) == "approve"
    assert verdict(approve(description=re.compile(".*")), event(Description=_DROP)) == "hold"


def test_every_field_must_hold() -> None:
    rule = approve(event_type=("Freeze",), event_source=("Platform",), event_status=("Scheduled",),
                   duration_min=0, duration_max=8, affects_this_vm=True, resources_min=1, resources_max=1,
                   description=re.compile("Migration"))
    assert verdict(rule, event()) == "approve"
    for spoiler in ({"EventType": "Reboot"}, {"EventSource": "User"}, {"EventStatus": "Started"},
                    {"DurationInSeconds": 9}, {"Resources": ["otherVM"]}, {"Resources": ["myVM", "b"]},
                    {"Description": "Host maintenance"}):
        assert verdict(rule, event(**spoiler)) == "hold", spoiler


# -- the seed's advanced sample ------------------------------------------------------------------------

def seed_sample(raw: dict[str, Any]) -> str:
    """The decision branch of the seed's advanced_sample(), verbatim in its tests and order."""
    if raw["EventStatus"] == "Started":
        return "ignore"  # log(event)
    elif raw["EventSource"] == "User":
        return "approve"  # confirm_scheduled_event
    elif (raw["EventType"] == "Freeze" and int(raw["DurationInSeconds"]) >= 0
          and int(raw["DurationInSeconds"]) < 9):
        return "approve"
    else:
        return "hold"  # custom handling: left to NotBefore or a remote approver


def scenario_events() -> list[tuple[str, Event]]:
    found = []
    for name in builtin_scenarios():
        for step in load_scenario(name).steps:
            if step.action != "schedule":
                continue
            a = step.args
            raw = {
                "EventId": a["id"], "EventType": a["type"], "ResourceType": "VirtualMachine",
                "Resources": list(a["resources"]), "EventStatus": a.get("status", "Scheduled"),
                "NotBefore": "", "Description": a["description"], "EventSource": a["source"],
                "DurationInSeconds": a["duration"],
            }
            found.append((name, parse_event(raw, 0)))
            found.append((name + "/started", parse_event({**raw, "EventStatus": "Started"}, 0)))
    return found


SCENARIO_EVENTS = scenario_events()


def test_scenarios_cover_the_interesting_cases() -> None:
    names = {name for name, _ in SCENARIO_EVENTS}
    assert {"user-reboot", "live-migration-freeze", "hardware-failure", "host-maintenance-reboot"} <= names


@pytest.mark.parametrize("name, ev", SCENARIO_EVENTS, ids=[n for n, _ in SCENARIO_EVENTS])
def test_seed_sample_rules_behave_like_the_seed_on_builtin_scenarios(name: str, ev: Event) -> None:
    vm = VmIdentity(name=ev.resources[0])
    assert decide(SEED_SAMPLE_RULES, ev, vm).action == seed_sample(dict(ev.raw))


@pytest.mark.parametrize("fields, expected", [
    ({"EventType": "Reboot", "EventSource": "User", "DurationInSeconds": -1}, Decision("approve", "user-initiated")),
    ({"EventType": "Freeze", "EventSource": "Platform", "DurationInSeconds": 5}, Decision("approve", "short-freeze")),
    ({"EventType": "Freeze", "EventSource": "Platform", "DurationInSeconds": -1}, Decision("hold", "everything-else")),
    ({"EventType": "Freeze", "EventSource": "Platform", "DurationInSeconds": 9}, Decision("hold", "everything-else")),
    ({"EventType": "Reboot", "EventSource": "Platform", "EventStatus": "Started"}, Decision("ignore", "log-started")),
    ({"EventType": "Reboot", "EventSource": "User", "EventStatus": "Started"}, Decision("ignore", "log-started")),
    ({"EventType": "Reboot", "EventSource": "Platform", "DurationInSeconds": -1}, Decision("hold", "everything-else")),
])
def test_seed_sample_rules_named_cases(fields: dict[str, Any], expected: Decision) -> None:
    assert decide(SEED_SAMPLE_RULES, event(**fields), VM) == expected


@settings(max_examples=examples(300), deadline=None)
@given(
    status=st.sampled_from(["Scheduled", "Started"]),
    source=st.sampled_from(["Platform", "User"]),
    type_=st.sampled_from(["Reboot", "Redeploy", "Freeze", "Preempt", "Terminate"]),
    duration=st.integers(min_value=-5, max_value=20),
)
def test_seed_sample_rules_agree_with_the_seed_everywhere(status: str, source: str, type_: str, duration: int) -> None:
    ev = event(EventStatus=status, EventSource=source, EventType=type_, DurationInSeconds=duration)
    assert decide(SEED_SAMPLE_RULES, ev, VM).action == seed_sample(dict(ev.raw))


def test_demo_rules() -> None:
    assert decide(DEMO_RULES, event(DurationInSeconds=5), VM) == Decision("approve", "short-freeze")
    assert decide(DEMO_RULES, event(EventType="Reboot", EventSource="User"), VM).action == "approve"
    assert decide(DEMO_RULES, event(DurationInSeconds=9), VM).action == "hold"
    assert decide(DEMO_RULES, event(EventType="Redeploy", DurationInSeconds=-1), VM).action == "hold"
    # A Started event cannot be approved any more.
    assert decide(DEMO_RULES, event(EventStatus="Started"), VM).action == "hold"
