"""Approvals end to end: policy rules, hooks, scope, `sefwd approve`, audit records, the demo loop."""
from __future__ import annotations

import orjson
import pytest

from forwarder.emulator import Emulator
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config
from tests.integration.test_cli import sefwd
from tests.conftest import FIXTURES

SEED_RULES = (FIXTURES / "seed-sample-policy.toml").read_text()


def agent_config(tmp_path, emu, vm="myVM", approval=SEED_RULES, poll="500ms"):
    return write_config(tmp_path / "c.toml", emu.vm_url(vm), tmp_path / "state", poll_interval=poll,
                        extra=approval)


def approvals(out):
    """Audit records of outcomes (``approval.planned`` records, one per action row, left out)."""
    return [r for r in read_jsonl(out) if r["type"].startswith("approval.") and r["type"] != "approval.planned"]


def posts(emu):
    return emu.stats()["start_requests"]


def test_seed_policy_approves_user_and_short_freeze_holds_the_rest(tmp_path):
    with Emulator(vms=["myVM", "other"], rate_limit=None) as emu:
        agent = AgentProcess(agent_config(tmp_path, emu), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        wait_until(lambda: read_jsonl(out), 60, "agent up")
        user = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600)
        freeze = emu.schedule(type="Freeze", source="Platform", duration=5, resources=["myVM"], start_after=600)
        long_freeze = emu.schedule(type="Freeze", source="Platform", duration=-1, resources=["myVM"], start_after=600)
        platform = emu.schedule(type="Reboot", source="Platform", resources=["myVM"], start_after=600)
        wait_until(lambda: len(approvals(out)) >= 4, 60, "four audit records")
        wait_until(lambda: {r["subject"] for r in read_jsonl(out) if r["type"] == "scheduledevent.started"} >= {user, freeze},
                   60, "approved events started")
        assert agent.terminate() == 0
    audit = {r["subject"]: r for r in approvals(out)}
    assert audit[user]["type"] == "approval.approved" and audit[user]["data"]["Rule"] == "user-initiated"
    assert audit[user]["data"]["Actor"] == "policy" and audit[user]["data"]["ImdsStatus"] == 200
    assert audit[freeze]["type"] == "approval.approved" and audit[freeze]["data"]["Rule"] == "short-freeze"
    assert audit[long_freeze]["type"] == "approval.held" and audit[platform]["type"] == "approval.held"
    assert sorted(e for p in posts(emu) for e in p["event_ids"]) == sorted([user, freeze])


def test_scope_refuses_events_of_other_vms(tmp_path):
    with Emulator(vms=["myVM", "aaa-leader"], rate_limit=None) as emu:
        agent = AgentProcess(agent_config(tmp_path, emu), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        wait_until(lambda: read_jsonl(out), 60, "agent up")
        shared = emu.schedule(type="Reboot", source="User", resources=["myVM", "aaa-leader"], start_after=600)
        others = emu.schedule(type="Reboot", source="User", resources=["aaa-leader"], start_after=600)
        wait_until(lambda: len(approvals(out)) >= 2, 60, "audit records")
        assert agent.terminate() == 0
    audit = {r["subject"]: r["data"] for r in approvals(out)}
    assert audit[shared]["Outcome"] == "refused" and audit[shared]["Reason"] == "out_of_scope"
    assert audit[others]["Outcome"] == "refused"
    assert posts(emu) == []


def test_hook_gates_approval_and_is_audited(tmp_path):
    ok_hook = tmp_path / "drain.sh"
    ok_hook.write_text('#!/bin/sh\nread -r record\necho "draining $SEFWD_EVENT_ID $SEFWD_EVENT_TYPE"\nexit "${HOOK_EXIT:-0}"\n')
    ok_hook.chmod(0o755)
    rules = f'''
[approval]
hook_timeout = "20s"
hook_env = ["HOOK_EXIT"]               # hooks inherit only what the operator names
[approval.hooks]
scheduled = ["{ok_hook}"]
[[approval.rules]]
name = "drain-then-approve"
event_type = "Reboot"
action = "approve"
after_hooks = true
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(agent_config(tmp_path, emu, approval=rules), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        wait_until(lambda: read_jsonl(out), 60, "agent up")
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: len(approvals(out)) >= 2, 60, "audit records")
        assert agent.terminate() == 0
        ran, audit = approvals(out)  # the hook action's outcome, then the approval's
        assert ran["type"] == "approval.ran" and ran["data"]["Reason"] == "hook_ok"
        assert audit["type"] == "approval.approved" and audit["data"]["Actor"] == "hook"
        hook = audit["data"]["Hook"]
        assert hook["ExitCode"] == 0 and f"draining {event_id} Reboot" in hook["Output"]
        assert [p["event_ids"] for p in posts(emu)] == [[event_id]]

    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        tmp2 = tmp_path / "failing"
        tmp2.mkdir()
        agent = AgentProcess(agent_config(tmp2, emu, approval=rules), tmp2 / "a.log", env={"HOOK_EXIT": "3"})
        out = tmp2 / "out.jsonl"
        wait_until(lambda: read_jsonl(out), 60, "agent up")
        emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: len(approvals(out)) >= 2, 60, "audit records")
        assert agent.terminate() == 0
        ran, audit = approvals(out)
        assert ran["type"] == "approval.ran" and ran["data"]["Reason"] == "hook_failed"
        assert audit["type"] == "approval.held" and audit["data"]["Reason"] == "hook_failed"
        assert audit["data"]["Hook"]["ExitCode"] == 3
        assert posts(emu) == []


def test_no_rules_means_nothing_is_approved(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(agent_config(tmp_path, emu, approval=""), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600)
        wait_until(lambda: any(r.get("subject") == event_id for r in read_jsonl(out)), 60, "scheduled record")
        polls = emu.stats()["requests"]["myVM"]["GET"]
        wait_until(lambda: emu.stats()["requests"]["myVM"]["GET"] >= polls + 5, 30, "more polls")
        assert agent.terminate() == 0
    assert posts(emu) == [] and approvals(out) == []


@pytest.mark.parametrize("agent_running", [True, False])
def test_cli_approve_is_audited_through_the_agent(tmp_path, agent_running):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = agent_config(tmp_path, emu, approval="")
        out = tmp_path / "out.jsonl"
        # It runs for a minute once approved: `sefwd approve` paces its requests to the IMDS budget
        # (docs/imds-transport.md), so the second command comes seconds after the first one's POST.
        event_id = emu.schedule(type="Redeploy", resources=["myVM"], start_after=600, complete_after=60)
        agent = AgentProcess(config, tmp_path / "a1.log") if agent_running else None
        if agent:
            wait_until(lambda: any(r.get("subject") == event_id for r in read_jsonl(out)), 60, "scheduled record")
        unknown = sefwd("approve", "00000000-0000-0000-0000-000000000000", "--config", str(config), "--json")
        assert unknown.returncode == 1
        assert orjson.loads(unknown.stdout)["refused"] == {"00000000-0000-0000-0000-000000000000": "unknown_event"}
        done = sefwd("approve", event_id, "--config", str(config), "--reason", "maintenance window")
        assert done.returncode == 0 and f"approved {event_id}" in done.stdout
        again = sefwd("approve", event_id, "--config", str(config))
        assert again.returncode == 0 and "already approved" in again.stdout
        if not agent:
            agent = AgentProcess(config, tmp_path / "a2.log")
        wait_until(lambda: len(approvals(out)) >= 3, 60, "three audit records")
        assert agent.terminate() == 0
    audit = approvals(out)
    assert [r["type"] for r in audit] == ["approval.refused", "approval.approved", "approval.approved"]
    assert audit[1]["data"]["Actor"] == "cli" and audit[1]["data"]["Approver"]
    assert audit[1]["data"]["Detail"] == "maintenance window"
    assert audit[2]["data"]["Reason"] == "already_approved"
    assert [p["event_ids"] for p in posts(emu)] == [[event_id]]


def test_demo_shows_the_whole_approval_loop():
    # Faster than a human sees it, with every change still two polls (>= 1 s) from the next: at 0.5 the
    # Reboot's completion and the Redeploy's cancel can share one poll (an incarnation jump: "ended").
    done = sefwd("demo", "--json", "--time-scale", "0.75", timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [orjson.loads(line) for line in done.stdout.splitlines()]
    freeze = "A1F0E5A7-0001-4C5D-9E8F-000000000001"
    mine = [r["type"] for r in records if r.get("subject") == freeze]
    assert mine[1] == "approval.planned"  # the approval action, audited before it is taken
    del mine[1]
    # The approval and the Started transition race (the POST makes IMDS start the event at once).
    assert mine[0] == "scheduledevent.scheduled" and mine[-1] == "scheduledevent.completed"
    assert sorted(mine[1:3]) == ["approval.approved", "scheduledevent.started"]
    approval = next(r for r in records if r["type"] == "approval.approved" and r["subject"] == freeze)
    assert approval["data"]["Actor"] == "policy" and approval["data"]["Rule"]


# -- the seed's advanced sample as policy behaves like the sample itself ------------------------

SAMPLE_SCENARIOS = ["live-migration-freeze", "user-reboot", "user-redeploy", "host-maintenance-reboot",
                    "spot-preempt", "scale-set-terminate", "canceled-maintenance", "hardware-failure", "demo"]


@pytest.fixture(scope="module")
def sample_vs_sefwd(tmp_path_factory):
    """Each built-in scenario twice, on two emulators: once with the seed sample, once with sefwd."""
    import os
    import subprocess
    import sys

    from forwarder.emulator import load_scenario
    from tests.agent import ROOT

    runs = {}
    ready = {}
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    try:
        for name in SAMPLE_SCENARIOS:
            tmp = tmp_path_factory.mktemp(f"seed-{name}")
            scenario = load_scenario(name)
            first = scenario.vms[0].name
            emu_sample = Emulator(vms=list(scenario.vms)).start()
            emu_sefwd = Emulator(vms=list(scenario.vms), rate_limit=None).start()
            config = write_config(tmp / "c.toml", emu_sefwd.vm_url(first), tmp / "state",
                                  extra='[approval]\nscope = "any"\n' + SEED_RULES)
            agent = AgentProcess(config, tmp / "a.log")
            sample = subprocess.Popen([sys.executable, str(ROOT / "tests" / "peers" / "seed_sample.py"),
                                       emu_sample.vm_url(first) + "/metadata/scheduledevents", "50"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            runs[name] = (emu_sample, emu_sefwd, agent, sample)
            ready[name] = (scenario, tmp)
        # All start at once; each scenario's timeline starts once both of its pollers are up.
        for name, (scenario, tmp) in ready.items():
            emu_sample, emu_sefwd, agent, sample = runs[name]
            wait_until(lambda: read_jsonl(tmp / "out.jsonl"), 60, "agent up")
            wait_until(lambda: emu_sample.stats()["requests"], 30, "sample polling")
            emu_sample.run_scenario(scenario)
            emu_sefwd.run_scenario(scenario)
        results = {}
        for name, (emu_sample, emu_sefwd, agent, sample) in runs.items():
            assert emu_sample.wait_finished(120) and emu_sefwd.wait_finished(120), name
            results[name] = (
                sorted(e for p in emu_sample.stats()["start_requests"] for e in p["event_ids"]),
                sorted(e for p in emu_sefwd.stats()["start_requests"] for e in p["event_ids"]),
            )
        return results
    finally:
        for emu_sample, emu_sefwd, agent, sample in runs.values():
            sample.kill()
            sample.wait()
            if agent.alive():
                agent.terminate()
            emu_sample.stop()
            emu_sefwd.stop()


@pytest.mark.slow  # every built-in scenario replayed in real time, twice
@pytest.mark.parametrize("name", SAMPLE_SCENARIOS)
def test_seed_policy_approves_what_the_seed_sample_approves(sample_vs_sefwd, name):
    by_sample, by_sefwd = sample_vs_sefwd[name]
    assert sorted(set(by_sample)) == by_sefwd  # the sample may approve one event twice; sefwd once


def test_restart_reconsiders_events_seen_before(tmp_path):
    """An event committed before a restart (here: before the rule existed) is decided after it."""
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600)
        agent = AgentProcess(agent_config(tmp_path, emu, approval=""), tmp_path / "a1.log")
        wait_until(lambda: any(r.get("subject") == event_id for r in read_jsonl(out)), 60, "scheduled record")
        assert agent.terminate() == 0
        assert posts(emu) == []
        agent = AgentProcess(agent_config(tmp_path, emu), tmp_path / "a2.log")
        wait_until(lambda: approvals(out), 60, "approval after restart")
        assert agent.terminate() == 0
    (audit,) = approvals(out)
    assert audit["type"] == "approval.approved" and audit["data"]["Rule"] == "user-initiated"
    assert [p["event_ids"] for p in posts(emu)] == [[event_id]]
