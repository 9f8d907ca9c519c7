"""`sefwd run` as a subprocess against the emulator, for every built-in scenario.

All scenarios run at once (each in its own emulator and agent) so the module stays quick; each
test then asserts the exact sequence of record types and the key fields of its scenario.
"""
from __future__ import annotations


import pytest

from forwarder.emulator import Emulator, builtin_scenarios, load_scenario
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config

# Every built-in scenario replayed in real time (Spot's 30 s notice included): left out of the inner loop.
pytestmark = pytest.mark.slow

EXPECTED = {
    "live-migration-freeze": [("C7061BAC-AFDC-4513-B24B-AA5F13A16123", ["scheduled", "started", "completed"])],
    "user-reboot": [("5DD55B64-45AD-49D3-BBC9-F57D4EA97BD7", ["scheduled", "started", "completed"])],
    "user-redeploy": [("F020BA2E-3BC0-4C40-A10B-86575A9EABD5", ["scheduled", "started", "completed"])],
    "host-maintenance-reboot": [("602D9444-D2CD-49C7-8624-8643E7171297", ["scheduled", "updated", "started", "completed"])],
    "spot-preempt": [("9B47C2F1-6E3A-4D4B-8F0C-1A2B3C4D5E6F", ["scheduled", "started", "completed"])],
    "scale-set-terminate": [("3E1F7A52-0C4D-4B8E-9A6F-2D5C8B7E4A10", ["scheduled", "started", "completed"])],
    "canceled-maintenance": [("B2E4C6A8-1357-4D9F-8E2A-6C4B0D8F1A3E", ["scheduled", "canceled"])],
    "hardware-failure": [("0A1B2C3D-4E5F-4061-8273-94A5B6C7D8E9", ["started", "completed"])],
    "demo": [
        ("A1F0E5A7-0001-4C5D-9E8F-000000000001", ["scheduled", "started", "completed"]),
        ("B2D1C6E8-0002-4C5D-9E8F-000000000002", ["scheduled", "started", "completed"]),
        ("C3E2D7F9-0003-4C5D-9E8F-000000000003", ["scheduled", "canceled"]),
    ],
}


def test_every_builtin_scenario_has_an_expectation():
    assert sorted(builtin_scenarios()) == sorted(EXPECTED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every scenario against its own agent; returns {name: (records, logs, exit code, stats)}."""
    started = {}
    for name in EXPECTED:
        tmp = tmp_path_factory.mktemp(name)
        scenario = load_scenario(name)
        emu = Emulator(vms=list(scenario.vms)).start()
        first_vm = scenario.vms[0].name
        config = write_config(tmp / "config.toml", emu.vm_url(first_vm), tmp / "state")
        agent = AgentProcess(config, tmp / "agent.log")
        started[name] = (emu, scenario, agent, tmp)
    results = {}
    try:
        for name, (emu, scenario, agent, tmp) in started.items():
            out = tmp / "out.jsonl"
            # Start the timeline only once the agent is polling, so nothing is "Initial".
            wait_until(lambda: any(r["type"] == "forwarder.started" for r in read_jsonl(out)), 60, f"{name}: agent start")
            wait_until(lambda: emu.stats()["requests"], 30, f"{name}: first poll")
            emu.run_scenario(scenario)
        for name, (emu, scenario, agent, tmp) in started.items():
            assert emu.wait_finished(90), f"{name}: scenario did not finish"
            out = tmp / "out.jsonl"
            want = sum(len(kinds) for _, kinds in EXPECTED[name])
            wait_until(lambda: len([r for r in read_jsonl(out) if r["type"].startswith("scheduledevent.")]) >= want,
                       60, f"{name}: {want} records")
            rc = agent.terminate()
            results[name] = (read_jsonl(out), agent.logs(), rc, emu.stats())
    finally:
        for emu, _, agent, _ in started.values():
            if agent.alive():
                agent.kill()
            emu.stop()
    return results


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_record_sequence(runs, name):
    records, logs, rc, stats = runs[name]
    assert rc == 0, logs[-3000:]
    assert records[0]["type"] == "forwarder.started" and records[-1]["type"] == "forwarder.stopped"
    events = [r for r in records if r["type"].startswith("scheduledevent.")]
    for event_id, kinds in EXPECTED[name]:
        mine = [r for r in events if r["subject"] == event_id]
        assert [r["data"]["Change"] for r in mine] == kinds, [r["type"] for r in mine]
        assert [r["type"] for r in mine] == [f"scheduledevent.{k}" for k in kinds]
        for r in mine:
            d = r["data"]
            assert d["EventId"] == event_id and d["Initial"] is False
            terminal = d["Change"] in ("completed", "canceled", "ended")  # one fleet-wide key, outcome in data
            assert r["eventkey"].startswith(f"{event_id}:{'ended' if terminal else d['Change']}")
            assert (d.get("Outcome") == ("unknown" if d["Change"] == "ended" else d["Change"])) == terminal
            assert d["ApiVersion"] == "2024-07-09" and d["Vm"]["VmId"]  # api_version "auto", served here
            assert r["source"] == d["Vm"]["ResourceId"]
    seqs = [int(r["sequence"]) for r in records]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence must count up without gaps"
    assert len({r["id"] for r in records}) == len(records)


def _by_kind(runs, name, kind):
    records = runs[name][0]
    return [r["data"] for r in records if r["type"] == f"scheduledevent.{kind}"]


def test_freeze_fields(runs):
    (s,) = _by_kind(runs, "live-migration-freeze", "scheduled")
    assert s["EventType"] == "Freeze" and s["DurationInSeconds"] == 5 and s["EventSource"] == "Platform"
    assert s["Resources"] == ["WestNO_0", "WestNO_1"] and s["AffectsThisVm"] is True
    assert s["NotBefore"].endswith("Z") and s["NotBeforeRaw"].endswith("GMT")
    (st,) = _by_kind(runs, "live-migration-freeze", "started")
    assert st["PreviousStatus"] == "Scheduled" and st["NotBefore"] is None and "EventStatus" in st["ChangedFields"]
    (c,) = _by_kind(runs, "live-migration-freeze", "completed")
    assert c["RemovalReason"] == "ended"


def test_host_maintenance_not_before_moved(runs):
    (s,) = _by_kind(runs, "host-maintenance-reboot", "scheduled")
    (u,) = _by_kind(runs, "host-maintenance-reboot", "updated")
    assert u["ChangedFields"] == ["NotBefore"] and u["NotBefore"] > s["NotBefore"]


def test_user_events_carry_source_user(runs):
    for name in ("user-reboot", "user-redeploy"):
        (s,) = _by_kind(runs, name, "scheduled")
        assert s["EventSource"] == "User"


def test_spot_preempt_short_notice(runs):
    from datetime import datetime

    records = runs["spot-preempt"][0]
    (r,) = [r for r in records if r["type"] == "scheduledevent.scheduled"]
    notice = datetime.fromisoformat(r["data"]["NotBefore"].replace("Z", "+00:00")) - datetime.fromisoformat(r["time"].replace("Z", "+00:00"))
    assert r["data"]["EventType"] == "Preempt" and 20 <= notice.total_seconds() <= 31


def test_scale_set_terminate_identity(runs):
    (s,) = _by_kind(runs, "scale-set-terminate", "scheduled")
    assert s["EventType"] == "Terminate" and s["Resources"] == ["myss_3"]
    assert s["Vm"]["VmScaleSetName"] == "myss" and s["AffectsThisVm"] is True


def test_canceled_and_hardware_failure(runs):
    (c,) = _by_kind(runs, "canceled-maintenance", "canceled")
    assert c["RemovalReason"] == "gone_before_notbefore" and c["EventStatus"] == "Scheduled"
    (h,) = _by_kind(runs, "hardware-failure", "started")
    assert h["PreviousStatus"] is None and h["EventStatus"] == "Started" and h["ChangedFields"] == []


def test_demo_other_vm_event_does_not_affect_this_vm(runs):
    canceled = _by_kind(runs, "demo", "canceled")
    assert [c["AffectsThisVm"] for c in canceled] == [False]
