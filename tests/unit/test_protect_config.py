"""[protect] and what goes with it: validation with every problem listed, `config check`, the one list of
record types (records and filters), protect.* records and their notify messages, hooks for this VM only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from forwarder.agent.config import describe, parse_config
from forwarder.approval.planner import Planner
from forwarder.approval.settings import ApprovalConfig, HookSpec
from forwarder.delivery.filters import DEFAULT_FILTERS, parse_filter
from forwarder.errors import ConfigError
from forwarder.imds.differ import SCHEDULED, Change
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.protect.settings import DEFAULT_TYPES, parse_protect
from forwarder.record_types import RECORD_TYPES
from forwarder.records import RecordFactory
from forwarder.store.database import Store
from sinks.notify_messages import MessageRenderer

STATE = {"dir": "/tmp/unused-sefwd-state"}


def _toml() -> Any:
    """tomllib, or tomli on Python 3.10."""
    import importlib
    import sys

    return importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")


def problems(data: dict) -> list[str]:
    try:
        parse_config({"state": STATE, **data}, {}, "test.toml")
    except ConfigError as exc:
        return exc.problems
    return []


def test_every_problem_of_protect_is_listed_at_once():
    assert problems({"protect": {"leave": [], "at": "5m", "event_types": ["reboot", "Hibernate"], "settle": "-1s",
                                 "drain": "x", "hook_env": ["A B"]}}) == [
        "unknown key protect.drain",
        "protect.leave: expected a command string (run with /bin/sh -c) or a non-empty list of strings (run without "
        "a shell), got []",
        "protect.at: expected \"notbefore - DURATION\" (e.g. \"notbefore - 2m\"), got '5m'",
        "protect.event_types: unknown event type(s) 'reboot' (did you mean 'Reboot'?), 'Hibernate' (did you mean "
        "'Terminate'?): use Freeze, Reboot, Redeploy, Preempt, Terminate or \"*\"",
        problems({"protect": {"enter": "x", "settle": "-1s"}})[0],
        "protect.hook_env: expected a list of environment variable names, got ['A B']",
        "protect: missing 'enter' (the command taking this VM out of service, e.g. "
        "enter = [\"/usr/local/lib/sefwd/k8s-drain.sh\"])",
    ]
    assert problems({"protect": {"enter": "x", "settle": "-1s"}})[0].startswith("protect.settle:")
    assert problems({"protect": "drain"}) == ["protect must be a table ([protect]), got 'drain'"]


def test_defaults_and_event_types():
    config, found = parse_protect({"enter": ["/bin/drain"], "at": "notbefore - 5m", "event_types": ["*"]})
    assert not found and config is not None
    assert (config.enter, config.leave, config.at, config.event_types, config.settle) == (("/bin/drain",), None, 300.0,
                                                                                           None, 30.0)
    assert config.wants("Freeze") and config.wants("SomethingNew")
    plain, _ = parse_protect({"enter": "drain"})
    assert plain is not None and plain.event_types == DEFAULT_TYPES and not plain.wants("Freeze")


def test_after_hooks_may_wait_for_protect_and_config_check_says_what_runs_for_whom():
    rule = {"name": "r", "action": "approve", "after_hooks": True}
    assert problems({"approval": {"rules": [rule]}})[0].startswith("approval.rules[0].after_hooks: true, but")
    config = parse_config({"state": STATE, "approval": {"rules": [rule], "hooks": {"scheduled": "notify-me",
                                                                                   "completed": {"command": "x", "affects_this_vm": False}}},
                           "protect": {"enter": "drain", "leave": "undo", "at": "notbefore - 5m"}}, {}, "test.toml")
    text = describe(config)
    assert "protect: this VM's hold for Reboot, Redeploy, Preempt, Terminate events naming it (or naming none): " \
           "enter drain from NotBefore - 5m" in text
    assert "hooks scheduled run only for events whose Resources name this VM (or name none): affects_this_vm = true, " \
           "the default" in text
    assert config.approval.hooks["completed"].affects_this_vm is False


def test_one_list_of_record_types_for_records_and_filters():
    for rtype in ("approval.planned", "approval.ran", "approval.superseded", "approval.skipped", "protect.missed",
                  "protect", "scheduledevent.ended", "forwarder.data_lost"):
        assert rtype in RECORD_TYPES
        parsed, found = parse_filter({"record_types": [rtype]}, "sinks[0]")
        assert not found and parsed is not None
    factory = RecordFactory(VmIdentity(name="vm1"), "2020-07-01")
    missed = factory.approval({"Family": "protect", "Outcome": "missed", "Reason": "enter_deadline", "EventId": "E1"})
    assert missed.type == "protect.missed" and "Family" not in missed.to_dict()["data"]
    assert factory.approval({"Outcome": "planned", "Actor": "policy"}).type == "approval.planned"
    with pytest.raises(ValueError, match="unknown audit record type 'approval.maybe'"):
        factory.approval({"Outcome": "maybe"})
    notify, _ = parse_filter(DEFAULT_FILTERS["notify"], "sinks[0]")
    assert notify is not None and notify.reason(missed) is None  # people hear about a failed protection


def test_notify_messages_of_the_hold():
    render = MessageRenderer(None).render
    vm = {"Name": "vm1"}
    missed = render({"type": "protect.missed", "data": {"Reason": "enter_deadline", "EventIds": ["E1"], "Vm": vm,
                                                        "Detail": "enter was cut off at its deadline"}})
    assert (missed.title, missed.notify_type) == ("Protection FAILED: vm1 (E1)", "failure")
    assert "enter was cut off" in missed.body and "Check the workload on vm1 now." in missed.body
    entered = render({"type": "protect.entered", "data": {"EventIds": ["E1", "E2"], "DrainSlackSeconds": 123.4, "Vm": vm}})
    assert entered.body == "vm1 left service for E1, E2, 123 s before NotBefore."
    left = render({"type": "protect.left", "data": {"EventIds": ["E1"], "Vm": vm}})
    assert (left.title, left.notify_type) == ("Back in service: vm1 (E1)", "success")


def _event(resources: list[str]) -> dict:
    return {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": resources,
            "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}


@pytest.mark.parametrize(("resources", "affects_this_vm", "runs"), [
    (["other"], True, False), (["other"], False, True), (["vm1"], True, True), ([], True, True)])
def test_per_change_hooks_run_for_this_vms_events_unless_told(tmp_path: Path, resources, affects_this_vm, runs):
    store = Store.open(tmp_path, fsync=False)
    try:
        config = ApprovalConfig(hooks={"scheduled": HookSpec("drain", affects_this_vm=affects_this_vm)})
        planner = Planner(config, lambda: VmIdentity(name="vm1"), store, clock=lambda: 1_000.0)
        document = parse_document({"DocumentIncarnation": 2, "Events": [_event(resources)]})
        change = Change(SCHEDULED, document.events[0], None)
        record = RecordFactory(VmIdentity(name="vm1"), "2020-07-01").for_changes([change], document)
        with store.transaction() as c:
            planner.plan(c, [change], record, document)
        assert bool(store.query("SELECT count(*) FROM actions WHERE kind = 'hook'")[0][0]) is runs
    finally:
        store.close()


def test_the_protect_examples_of_the_docs_pass_config_check():
    import re

    tomllib = _toml()

    text = (Path(__file__).resolve().parents[2] / "docs" / "approvals.md").read_text()
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if re.search(r"^\[protect\]$", b, re.M)]
    assert len(blocks) >= 4
    for block in blocks:
        data = tomllib.loads(block)
        config = parse_config({"state": STATE, **data}, {}, "test.toml")
        assert config.protect is not None and config.protect.enter


def test_the_vm_extension_maps_protect_settings_to_a_valid_config():
    import importlib.util
    import re

    tomllib = _toml()
    import json

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("sefwd_handler_for_protect", root / "deploy" / "vm-extension" / "handler.py")
    assert spec is not None and spec.loader is not None
    handler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(handler)
    readme = (root / "deploy" / "vm-extension" / "README.md").read_text()
    example = next(b for b in re.findall(r"```json\n(.*?)```", readme, re.S) if '"protect"' in b)
    data = tomllib.loads(handler.render_config(json.loads(example)["settings"]))
    config = parse_config({"state": STATE, **data}, {}, "test.toml")
    assert config.protect is not None and config.protect.at == 300.0 and config.protect.hook_env == ("KUBECONFIG", "NODE_NAME")


def test_environment_overrides_of_protect():
    def parse(env: dict[str, str], protect: object = None) -> tuple[Any, list[str]]:
        try:
            config = parse_config({"state": STATE, **({"protect": protect} if protect is not None else {})}, env, "t.toml")
        except ConfigError as exc:
            return None, exc.problems
        return config.protect, []

    found, none = parse({"SEFWD_PROTECT_SETTLE": "2m", "SEFWD_PROTECT_AT": "notbefore - 1m"}, {"enter": "drain"})
    assert not none and found is not None and (found.settle, found.at) == (120.0, 60.0)
    assert parse({"SEFWD_PROTECT_SETTLE": "soon"}, {"enter": "drain"})[1][0].startswith("environment SEFWD_PROTECT_SETTLE:")
    unknown, = parse({"SEFWD_PROTECT_ENTER": "rm -rf /"}, {"enter": "drain"})[1]  # commands: from the file only
    assert unknown.startswith("unknown environment variable SEFWD_PROTECT_ENTER: [protect] has no overridable key 'enter'")
    assert parse({"SEFWD_PROTECT_SETTLE": "5s"})[1] == [
        "environment SEFWD_PROTECT_SETTLE: set, but there is no [protect] table"]
