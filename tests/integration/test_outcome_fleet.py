"""Two agents, one emulator, one availability set: one folded outcome per EventId (issue 13)."""
from __future__ import annotations

import sys
from pathlib import Path

import requests

from forwarder.common.fleet_keys import as_secret
from forwarder.emulator import Emulator
from forwarder.imds.outcome import fold
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config
from tests.conftest import ROOT
from tests.fleet import MASTER_SECRET, record_key

APP_DIR = ROOT / "deploy" / "consumers" / "remote-approver"

TERMINAL = ("scheduledevent.completed", "scheduledevent.canceled", "scheduledevent.ended")


def _terminal(out: Path, event_id: str) -> list[dict]:
    return [r for r in read_jsonl(out) if r["type"] in TERMINAL and r["subject"] == event_id]


def _kinds(out: Path, event_id: str) -> list[str]:
    return [r["type"].split(".", 1)[1] for r in read_jsonl(out) if r.get("subject") == event_id
            and r["type"].startswith("scheduledevent.")]


def _keys(vm: str) -> dict[str, str]:
    """The VM's own record key (the remote approver ignores records without a valid sefwdauth)."""
    return {"SEFWD_AGENT_RECORD_KEY_ENV": "SEFWD_RECORD_KEY", "SEFWD_RECORD_KEY": as_secret(record_key(vm))}


def test_two_agents_one_availability_set_fold_to_one_outcome_per_event(tmp_path: Path) -> None:
    with Emulator(vms=["vm-a", "vm-b"]) as emu:
        agents, outs, configs = {}, {}, {}
        for vm in ("vm-a", "vm-b"):
            (tmp_path / vm).mkdir()
            configs[vm] = write_config(tmp_path / vm / "c.toml", emu.vm_url(vm), tmp_path / vm / "state")
            outs[vm] = tmp_path / vm / "out.jsonl"
            agents[vm] = AgentProcess(configs[vm], tmp_path / vm / "agent.log", env=_keys(vm))
        ran = emu.schedule(type="Reboot", resources=["vm-a", "vm-b"], not_before="+15m", complete_after=600)
        called_off = emu.schedule(type="Redeploy", resources=["vm-a", "vm-b"], not_before="+10m")
        for vm in agents:
            wait_until(lambda: "scheduled" in _kinds(outs[vm], ran) and "scheduled" in _kinds(outs[vm], called_off),
                       60, f"{vm}: scheduled records")
        # Azure calls the Redeploy off while both agents watch: both can prove it.
        emu.cancel(called_off)
        for vm in agents:
            wait_until(lambda: _terminal(outs[vm], called_off), 30, f"{vm}: terminal record of the Redeploy")
        # vm-a's agent is down while another party on vm-b approves the Reboot early and it runs.
        agents["vm-a"].kill()
        http = requests.Session()
        http.trust_env = False
        r = http.post(emu.vm_url("vm-b") + "/metadata/scheduledevents", params={"api-version": "2020-07-01"},
                      headers={"Metadata": "true"}, json={"StartRequests": [{"EventId": ran}]}, timeout=10)
        assert r.status_code == 200
        wait_until(lambda: "started" in _kinds(outs["vm-b"], ran), 30, "vm-b: started record")
        emu.complete(ran)
        wait_until(lambda: _terminal(outs["vm-b"], ran), 30, "vm-b: terminal record of the Reboot")
        agents["vm-a"] = AgentProcess(configs["vm-a"], tmp_path / "vm-a" / "agent2.log", env=_keys("vm-a"))
        wait_until(lambda: _terminal(outs["vm-a"], ran), 60, "vm-a: terminal record after its restart")
        for agent in agents.values():
            assert agent.terminate() == 0

    records = {vm: {eid: _terminal(out, eid) for eid in (ran, called_off)} for vm, out in outs.items()}
    for vm, by_event in records.items():
        for eid, terminal in by_event.items():
            assert len({r["id"] for r in terminal}) == 1, (vm, eid)  # one terminal record per VM and event
            assert {r["eventkey"] for r in terminal} == {f"{eid}:ended"}  # the same key on every VM
    outcome = {vm: {eid: t[0]["data"]["Outcome"] for eid, t in by_event.items()} for vm, by_event in records.items()}
    # vm-b saw the Reboot Started; vm-a, down across it, saw only a jump before NotBefore: it does not guess.
    assert outcome["vm-b"][ran] == "completed" and outcome["vm-a"][ran] == "unknown"
    # Approved by another party (not vm-b's agent) and seen Started long before NotBefore (issue 23).
    assert records["vm-b"][ran][0]["data"]["Evidence"]["Used"] == ["seen_started", "approved_elsewhere"]
    assert records["vm-a"][ran][0]["data"]["Evidence"]["UnseenStates"] == 1
    assert outcome["vm-a"][called_off] == outcome["vm-b"][called_off] == "canceled"
    assert records["vm-a"][called_off][0]["data"]["Evidence"]["Used"] == [
        "gone_before_notbefore", "no_approval", "no_unseen_states", "no_reboot"]
    # The fleet rule: completed beats unknown beats canceled -> one outcome per EventId.
    folded = {eid: fold(outcome[vm][eid] for vm in outcome) for eid in (ran, called_off)}
    assert folded == {ran: "completed", called_off: "canceled"}

    # The remote-approver Function applies the same rule to the stream of both VMs' records, in
    # any order, per VM (issue 29: a VM's record moves only that VM's outcome): one "outcome"
    # decision per VM and EventId, each VM's the one it reported.
    if str(APP_DIR) not in sys.path:
        sys.path.insert(0, str(APP_DIR))
    import pipeline

    for order in (("vm-a", "vm-b"), ("vm-b", "vm-a")):
        settings = pipeline.Settings.from_env({"CALLBACK_URL_TEMPLATE": "https://{vm_lower}.invalid/approvals",
                                               "SEFWD_MASTER_SECRET": MASTER_SECRET,
                                               "SEEN_RECORDS_PATH": str(tmp_path / "-".join(order) / "seen.db")})
        approver = pipeline.RemoteApprover(settings, approve=lambda *a, **k: {"ok": False})
        stream = [r for vm in order for r in read_jsonl(outs[vm]) if r["type"] in TERMINAL]
        decided = [o for o in approver.handle_many(stream) if o["decision"] == "outcome"]
        per_vm = {(o["eventkey"].partition("|")[0].rpartition("/")[2], o["EventId"]): o["outcome"] for o in decided}
        assert len(per_vm) == len(decided), order  # no VM's outcome of an event decided twice
        assert per_vm == {(vm, eid): outcome[vm][eid] for vm in outcome for eid in (ran, called_off)}, order
        assert fold(per_vm[vm, ran] for vm in outcome) == folded[ran]


def test_an_approval_recorded_by_sefwd_approve_while_the_agent_is_down_makes_the_vanish_completed(
        tmp_path: Path) -> None:
    """The real capture's sequence, with the approval given by `sefwd approve` while the agent is down."""
    from tests.integration.test_cli import sefwd

    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.vm_url("myVM"), tmp_path / "state")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], not_before="+15m",
                                complete_after=600)
        agent = AgentProcess(config, tmp_path / "a1.log")
        wait_until(lambda: "scheduled" in _kinds(out, event_id), 60, "scheduled record")
        agent.kill()
        done = sefwd("approve", event_id, "--config", str(config))
        assert done.returncode == 0, done.stderr
        emu.complete(event_id)  # it ran and ended before the agent looked again: 2 -> 4
        agent = AgentProcess(config, tmp_path / "a2.log")
        wait_until(lambda: _terminal(out, event_id), 60, "terminal record after the restart")
        assert agent.terminate() == 0
    (terminal,) = _terminal(out, event_id)
    assert terminal["type"] == "scheduledevent.completed" and terminal["eventkey"] == f"{event_id}:ended"
    evidence = terminal["data"]["Evidence"]
    assert evidence["Used"] == ["approval_accepted", "incarnation_jump"] and evidence["UnseenStates"] == 1
    assert evidence["Rebooted"] is False and evidence["SecondsBeforeNotBefore"] > 600
