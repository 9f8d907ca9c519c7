"""Actions as rows in the store, end to end: the real agent, the emulator, real hook processes, SIGKILL.

Each test drives `sefwd run` in a subprocess against the IMDS emulator and reads what the file
sink delivered; action rows are read from the agent's own store file.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests

from forwarder.emulator import Emulator
from forwarder.emulator.model import VmProfile
from tests.agent import AgentProcess, callback_url, read_jsonl, wait_until, write_config
from tests.integration.test_callback_agent import SECRET as CB_SECRET
from tests.integration.test_callback_agent import body_for, signed
from tests.integration.test_cli import sefwd

MY_VM = VmProfile("myVM").resource_id  # a signed approval names the VM it is for
SECRET = "whsec_" + "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3I="


def config(tmp_path: Path, emu: Emulator, approval: str, *, poll: str = "500ms", heartbeat: str = "0") -> Path:
    path = write_config(tmp_path / "c.toml", emu.vm_url("myVM"), tmp_path / "state", poll_interval=poll, extra=approval)
    path.write_text(path.read_text().replace('heartbeat = "0"', f'heartbeat = "{heartbeat}"'))
    return path


def audits(out: Path, kind: str | None = None, event_id: str | None = None) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(out) if r["type"].startswith("approval.")
            and (kind is None or r["type"] == f"approval.{kind}") and (event_id is None or r["subject"] == event_id)]


def posts(emu: Emulator) -> list[list[str]]:
    return [p["event_ids"] for p in emu.stats()["start_requests"]]


def action_rows(tmp_path: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(tmp_path / "state" / "state.db")
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM actions ORDER BY id")]
    finally:
        conn.close()


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def kill_pids(paths: list[Path], script_name: str) -> None:
    """Hooks a SIGKILLed agent left behind (they lead their own process groups): only a process
    still running ``script_name`` is signalled (a pid may have been reused since)."""
    for path in paths:
        try:
            pid = int(path.read_text().split()[0])
            if script_name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# -- re-check before the POST ---------------------------------------------------------------------

@pytest.mark.slow  # waits out a rule's real delay
def test_an_event_that_no_longer_matches_the_rule_at_post_time_is_not_approved(tmp_path):
    rules = '''
[[approval.rules]]
name = "short-freeze"
event_type = "Freeze"
duration_max = 8
action = "approve"
delay = "4s"
'''
    # Slow polls: the agent's worker, not its poller, is the first to see the change.
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, rules, poll="30s"), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Freeze", duration=5, resources=["myVM"], start_after=600)
        wait_until(lambda: audits(out, "planned", event_id), 60, "the approval planned")
        emu.update(event_id, type="Reboot", duration=-1)  # Azure turns it into a reboot nobody allowed
        (superseded,) = wait_until(lambda: audits(out, "superseded", event_id), 60, "the approval superseded")
        assert agent.terminate() == 0
    data = superseded["data"]
    assert data["Reason"] == "event_changed" and "EventType" in data["Detail"] and data["Rule"] == "short-freeze"
    assert data["Action"]["Kind"] == "approve" and data["Action"]["State"] == "superseded"
    assert posts(emu) == [] and audits(out, "approved") == []
    assert [r["state"] for r in action_rows(tmp_path)] == ["superseded"]


def test_an_updated_event_supersedes_pending_actions_and_plans_afresh(tmp_path):
    rules = '''
[[approval.rules]]
name = "user"
event_source = "User"
action = "approve"
at = "notbefore - 1m"
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, rules), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=3600)
        wait_until(lambda: audits(out, "planned", event_id), 60, "the approval planned an hour ahead")
        emu.update(event_id, start_after=30)  # NotBefore moved: the plan of the old version goes
        wait_until(lambda: audits(out, "approved", event_id), 60, "the approval of the new version")
        assert agent.terminate() == 0
    superseded = audits(out, "superseded", event_id)
    assert [a["data"]["Reason"] for a in superseded] == ["event_updated"]
    assert len(audits(out, "planned", event_id)) == 2 and posts(emu) == [[event_id]]


# -- the watch never waits ------------------------------------------------------------------------

def test_fifty_long_hooks_do_not_delay_a_new_event_or_the_heartbeat(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    hook = script(tmp_path, "long.sh", f'echo $$ > {pids}/$SEFWD_EVENT_ID\nsleep 60\n')
    approval = f'''
[approval]
workers = 50
hook_timeout = "5m"
[approval.hooks]
scheduled = ["{hook}"]
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval, poll="1s", heartbeat="1s"), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        try:
            for _ in range(50):
                emu.schedule(type="Reboot", resources=["myVM"], start_after=3600)
            wait_until(lambda: len(list(pids.iterdir())) == 50, 120, "50 hooks running")
            busy_since = time.time()
            scheduled_at = time.time()
            event_id = emu.schedule(type="Freeze", resources=["myVM"], start_after=3600)
            (record,) = wait_until(lambda: [r for r in read_jsonl(out) if r["subject"] == event_id
                                            and r["type"] == "scheduledevent.scheduled"], 30, "the new event's record")
            late = epoch(record["time"]) - scheduled_at
            print(f"new event recorded {late:.3f} s after it appeared, with 50 hooks running")
            # One poll interval (1 s) when the machine is idle; the slack is for a loaded test machine.
            # Before actions were rows, the poll loop waited for the hooks: not recorded within 120 s.
            assert late <= 1.0 + 2.0
            wait_until(lambda: [r for r in read_jsonl(out) if r["type"] == "forwarder.heartbeat"
                                and epoch(r["time"]) > busy_since + 3], 30, "heartbeats while busy")
            beats = [epoch(r["time"]) for r in read_jsonl(out) if r["type"] == "forwarder.heartbeat"
                     and epoch(r["time"]) > busy_since]
            gaps = [b - a for a, b in zip(beats, beats[1:])]
            print("heartbeat gaps:", [round(g, 2) for g in gaps])
            assert beats and max(gaps, default=0) <= 1 + 1 + 3  # every 1 s, checked every poll (1 s); slack for load
            assert len(list(pids.iterdir())) == 50 and all(r["state"] in ("running", "due", "planned", "done")
                                                           for r in action_rows(tmp_path))
            started = time.monotonic()
            assert agent.terminate() == 0
            print(f"stopped with 50 hooks running in {time.monotonic() - started:.1f} s")
        finally:
            if agent.alive():
                agent.kill()
            kill_pids(list(pids.iterdir()), "long.sh")
    # Stopped hooks are left to run again at the next start, not recorded as failed.
    assert not [a for a in audits(out, "ran")]
    assert {r["state"] for r in action_rows(tmp_path)} <= {"planned", "due"}


# -- a SIGKILL at each step of an approval --------------------------------------------------------

USER_RULE = '''
[[approval.rules]]
name = "user"
event_source = "User"
action = "approve"
'''


def test_sigkill_before_the_approval_was_taken_posts_once_after_restart(tmp_path):
    rule = USER_RULE + 'delay = "3s"\n'
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, rule)
        out = tmp_path / "out.jsonl"
        agent = AgentProcess(cfg, tmp_path / "a1.log")
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600)
        wait_until(lambda: audits(out, "planned", event_id), 60, "the approval planned")
        agent.kill()
        assert posts(emu) == [] and [r["state"] for r in action_rows(tmp_path)] == ["planned"]
        agent = AgentProcess(cfg, tmp_path / "a2.log")
        wait_until(lambda: audits(out, "approved", event_id), 60, "the approval after the restart")
        assert agent.terminate() == 0
    (approved,) = audits(out, "approved", event_id)
    assert approved["data"]["Reason"] == "approved" and posts(emu) == [[event_id]]
    assert len(audits(out, "planned", event_id)) == 1  # planned once, not again at the restart


@pytest.mark.slow  # waits out a POST's real deadline
def test_an_unanswered_post_is_resolved_by_asking_imds_never_by_posting_again(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        out = tmp_path / "out.jsonl"
        # Accepted by the platform (the event starts), but the answer trickles past the client's 5 s.
        emu.inject_fault("drip", path="scheduledevents", method="POST", delay=5)
        agent = AgentProcess(config(tmp_path, emu, USER_RULE), tmp_path / "a.log")
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600, complete_after=600)
        (approved,) = wait_until(lambda: audits(out, "approved", event_id), 60, "the outcome")
        # and a POST IMDS never received (held, then dropped) is tried again once IMDS says Scheduled
        emu.inject_fault("hang", path="scheduledevents", method="POST", delay=30)
        second = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600, complete_after=600)
        (again,) = wait_until(lambda: audits(out, "approved", second), 60, "the second event's outcome")
        assert agent.terminate() == 0
    assert approved["data"]["Reason"] == "approved_unanswered"
    assert again["data"]["Reason"] == "approved" and again["data"]["Action"]["Attempts"] == 2
    assert posts(emu) == [[event_id], [second]]  # one accepted POST each: no blind second POST


def test_sigkill_while_the_post_is_in_flight_unanswered_posts_once_after_restart(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, USER_RULE)
        out = tmp_path / "out.jsonl"
        emu.inject_fault("hang", path="scheduledevents", method="POST", delay=120)  # never reaches the platform
        agent = AgentProcess(cfg, tmp_path / "a1.log")
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600)
        wait_until(lambda: not emu.stats()["faults_pending"], 60, "the POST in flight")
        wait_until(lambda: [r for r in action_rows(tmp_path) if r["phase"] == "posting"], 10, "the row marked posting")
        agent.kill()
        assert posts(emu) == [] and emu.document()["Events"][0]["EventStatus"] == "Scheduled"
        agent = AgentProcess(cfg, tmp_path / "a2.log")
        wait_until(lambda: audits(out, "approved", event_id), 60, "the approval after the restart")
        wait_until(lambda: any(r["type"] == "scheduledevent.started" for r in read_jsonl(out)), 60, "started")
        assert agent.terminate() == 0
    (approved,) = audits(out, "approved", event_id)
    assert approved["data"]["Reason"] == "approved" and posts(emu) == [[event_id]]
    assert [r["state"] for r in action_rows(tmp_path)] == ["done"]


def test_sigkill_after_the_post_before_its_outcome_is_committed_never_posts_again(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, USER_RULE)
        out = tmp_path / "out.jsonl"
        # IMDS accepts the POST (the event starts), its answer trickles: the agent dies before it has it.
        emu.inject_fault("drip", path="scheduledevents", method="POST", delay=5)
        agent = AgentProcess(cfg, tmp_path / "a1.log")
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600, complete_after=600)
        wait_until(lambda: posts(emu), 60, "the POST accepted")
        agent.kill()
        assert audits(out, "approved") == []
        agent = AgentProcess(cfg, tmp_path / "a2.log")
        wait_until(lambda: audits(out, "approved", event_id), 60, "the outcome after the restart")
        wait_until(lambda: any(r["type"] == "scheduledevent.started" for r in read_jsonl(out)), 60, "started")
        assert agent.terminate() == 0
    (approved,) = audits(out, "approved", event_id)
    assert approved["data"]["Reason"] == "approved_before_restart"
    assert posts(emu) == [[event_id]]  # no second POST
    assert [(r["state"], r["attempts"]) for r in action_rows(tmp_path)] == [("done", 2)]


# -- deadlines and `at` ---------------------------------------------------------------------------

def env_hook(tmp_path: Path) -> Path:
    return script(tmp_path, "env.sh", f'env > {tmp_path}/env-$SEFWD_EVENT_ID\n')


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_a_preempt_hook_gets_the_time_left_before_notbefore_less_the_margin(tmp_path):
    hook = env_hook(tmp_path)
    approval = f'''
[approval]
hook_timeout = "5m"
deadline_margin = "5s"
[approval.hooks]
scheduled = {{ command = ["{hook}"], at = "notbefore - 2m", event_types = ["Preempt", "Reboot"] }}
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        freeze = emu.schedule(type="Freeze", resources=["myVM"], start_after=600)  # not in event_types
        preempt = emu.schedule(type="Preempt", resources=["myVM"])  # 30 s of notice: at once
        seen = wait_until(lambda: (tmp_path / f"env-{preempt}").is_file() and read_env(tmp_path / f"env-{preempt}"),
                          60, "the Preempt hook")
        wait_until(lambda: audits(out, "ran", preempt), 60, "its outcome")
        assert agent.terminate() == 0
    not_before = epoch(seen["SEFWD_EVENT_NOT_BEFORE"])
    assert 0 < int(seen["SEFWD_SECONDS_LEFT"]) <= 25
    assert epoch(seen["SEFWD_DEADLINE"]) <= not_before - 5 + 1
    assert not (tmp_path / f"env-{freeze}").exists() and audits(out, "planned", freeze) == []


def test_a_redeploy_days_ahead_is_not_acted_on_until_notbefore_minus_at(tmp_path):
    hook = env_hook(tmp_path)
    approval = f'''
[approval.hooks]
scheduled = {{ command = ["{hook}"], at = "notbefore - 2m" }}
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, approval)
        agent = AgentProcess(cfg, tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Redeploy", resources=["myVM"], start_after=3 * 86400)
        (planned,) = wait_until(lambda: audits(out, "planned", event_id), 60, "the hook planned")
        (row,) = action_rows(tmp_path)
        assert row["state"] == "planned" and row["due"] == row["deadline"] - 120
        assert row["deadline"] - time.time() > 3 * 86400 - 60
        assert planned["data"]["Action"]["Due"] is not None
        status = sefwd("status", "--config", str(cfg))
        assert "actions: planned 1" in status.stdout, status.stdout
        # Azure moves the maintenance closer: the plan of the old version goes, the new one is due in 5 s.
        emu.update(event_id, start_after=125)
        seen = wait_until(lambda: (tmp_path / f"env-{event_id}").is_file() and read_env(tmp_path / f"env-{event_id}"),
                          60, "the hook at NotBefore - 2m")
        # The hook writes its file as it starts; its "ran" audit follows when it has finished (a stop
        # before that leaves the row to run again at the next start, unaudited until then).
        (ran,) = wait_until(lambda: audits(out, "ran", event_id), 60, "the hook's run audited")
        assert agent.terminate() == 0
    ran_at = epoch(ran["time"])
    assert ran_at >= epoch(seen["SEFWD_EVENT_NOT_BEFORE"]) - 120 - 1
    assert [a["data"]["Reason"] for a in audits(out, "superseded", event_id)] == ["event_updated"]


# -- dry run --------------------------------------------------------------------------------------

def test_dry_run_plans_and_audits_but_performs_nothing(tmp_path):
    marker = tmp_path / "hook-ran"
    hook = script(tmp_path, "drain.sh", f"touch {marker}\n")
    approval = f'''
[approval.hooks]
scheduled = ["{hook}"]
[approval.callback]
listen = "127.0.0.1:0"
secret_env = "CB_SECRET"
{USER_RULE}
after_hooks = true
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval), tmp_path / "a.log", args=("run", "--dry-run"),
                             env={"CB_SECRET": CB_SECRET})
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", source="User", resources=["myVM"], start_after=600)
        wait_until(lambda: len(audits(out, "skipped", event_id)) == 2, 60, "both actions skipped")
        body = body_for(event_id, approver="ops", ResourceId=MY_VM)
        answer = requests.post(callback_url(agent), data=body, headers=signed(body), timeout=30)
        assert (answer.status_code, answer.json()["reason"]) == (409, "dry_run")
        (held,) = wait_until(lambda: audits(out, "held", event_id), 60, "the callback's dry run audited")
        assert held["data"]["DryRun"] is True and "would post" in held["data"]["Detail"]
        assert agent.terminate() == 0
        assert "dry run: " in agent.logs()
    assert not marker.exists() and posts(emu) == []
    planned = audits(out, "planned", event_id)
    assert [(p["data"]["Action"]["Kind"], p["data"]["DryRun"]) for p in planned] == [("hook", True), ("approve", True)]
    skipped = audits(out, "skipped", event_id)
    assert {s["data"]["Reason"] for s in skipped} == {"dry_run"}
    assert any("would post StartRequests" in s["data"]["Detail"] for s in skipped)
    assert any("would run" in s["data"]["Detail"] for s in skipped)
    assert audits(out, "approved") == [] and audits(out, "ran") == []


# -- undo runs once per event, to completion ------------------------------------------------------

def test_an_undo_hook_killed_with_the_agent_runs_again_and_a_finished_one_never(tmp_path):
    runs = tmp_path / "runs"
    pid = tmp_path / "undo.pid"
    # First run: stays (as if uncordoning took long) until the agent is killed; later runs finish.
    hook = script(tmp_path, "undo.sh", f'echo "$SEFWD_EVENT_ID" >> {runs}\n'
                                       f'if [ ! -e {tmp_path}/first ]; then touch {tmp_path}/first; echo $$ > {pid}; sleep 60; fi\n'
                                       'echo uncordoned\n')
    approval = f'''
[approval.hooks]
canceled = ["{hook}"]
ended = ["{hook}"]
completed = ["{hook}"]
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, approval)
        out = tmp_path / "out.jsonl"
        agent = AgentProcess(cfg, tmp_path / "a1.log")
        try:
            event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
            wait_until(lambda: any(r["subject"] == event_id for r in read_jsonl(out)), 60, "scheduled")
            emu.cancel(event_id)
            wait_until(lambda: pid.is_file() and pid.read_text().strip(), 60, "the undo hook running")
            agent.kill()
            kill_pids([pid], "undo.sh")  # (the hook outlived the agent: it leads its own process group)
            assert audits(out, "ran") == []
            agent = AgentProcess(cfg, tmp_path / "a2.log")
            (ran,) = wait_until(lambda: audits(out, "ran", event_id), 60, "the undo hook run again")
            assert agent.terminate() == 0
            agent = AgentProcess(cfg, tmp_path / "a3.log")
            wait_until(lambda: len([r for r in read_jsonl(out) if r["type"] == "forwarder.started"]) == 3, 60, "third start")
            polls = emu.stats()["requests"]["myVM"]["GET"]
            wait_until(lambda: emu.stats()["requests"]["myVM"]["GET"] >= polls + 4, 30, "more polls")
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
            kill_pids([pid], "undo.sh")
    assert runs.read_text().split() == [event_id, event_id]  # killed once, finished once, never again
    assert ran["data"]["Reason"] == "hook_ok" and "uncordoned" in ran["data"]["Hook"]["Output"]
    assert ran["data"]["Action"]["Kind"] == "undo" and ran["data"]["Action"]["Attempts"] == 2
    assert [r["state"] for r in action_rows(tmp_path)] == ["done"]


# -- the hook's environment: no secrets in, none out ----------------------------------------------

def test_a_hook_sees_no_agent_secret_and_its_output_is_redacted(tmp_path):
    hook = script(tmp_path, "show.sh", 'env\necho "sas https://acct.blob.core.windows.net/c?sv=1&sig=SIGVALUE"\n'
                                       f'echo "leaked {SECRET}"\necho "Endpoint=sb://x/;SharedAccessKey=KEYVALUE"\n')
    approval = f'''
[approval]
hook_env = ["ALLOWED_VAR"]
[approval.hooks]
scheduled = ["{hook}"]
[approval.callback]
listen = "127.0.0.1:0"
secret_env = "SEFWD_CALLBACK_SECRET"
'''
    env = {"SEFWD_CALLBACK_SECRET": SECRET, "WEBHOOK_SECRET": "hunter2-webhook", "ALLOWED_VAR": "visible"}
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval), tmp_path / "a.log", env=env)
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        (ran,) = wait_until(lambda: audits(out, "ran", event_id), 60, "the hook's outcome")
        assert agent.terminate() == 0
    output = ran["data"]["Hook"]["Output"]
    assert f"SEFWD_EVENT_ID={event_id}" in output and "ALLOWED_VAR=visible" in output and "PATH=" in output
    assert "SEFWD_CALLBACK_SECRET" not in output and "WEBHOOK_SECRET" not in output
    for secret in (SECRET, "hunter2", "SIGVALUE", "KEYVALUE"):
        assert secret not in output and secret not in orjson.dumps(read_jsonl(out)).decode()
    assert "sig=***" in output and "SharedAccessKey=***" in output and "leaked ***" in output


def test_sigkill_after_a_callback_approval_was_posted_records_it_once_after_restart(tmp_path):
    """The signed callback's approval is an action row too: marked posting before the POST."""
    approval = '[approval.callback]\nlisten = "127.0.0.1:0"\nsecret_env = "CB_SECRET"\n'

    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, approval)
        out = tmp_path / "out.jsonl"
        emu.inject_fault("drip", path="scheduledevents", method="POST", delay=5)
        agent = AgentProcess(cfg, tmp_path / "a1.log", env={"CB_SECRET": CB_SECRET})
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600, complete_after=600)
        wait_until(lambda: any(r["subject"] == event_id for r in read_jsonl(out)), 60, "scheduled")
        body = body_for(event_id, approver="ops", ResourceId=MY_VM)
        url = callback_url(agent)  # port 0: the OS picks, the agent's log says

        def ask() -> None:
            try:
                requests.post(url, data=body, headers=signed(body), timeout=60)
            except requests.RequestException:
                pass  # the agent dies before it answers

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        wait_until(lambda: posts(emu), 60, "the POST accepted")
        agent.kill()
        asking.join(30)
        assert audits(out, "approved") == []
        agent = AgentProcess(cfg, tmp_path / "a2.log", env={"CB_SECRET": CB_SECRET})
        wait_until(lambda: audits(out, "approved", event_id), 60, "the outcome after the restart")
        assert agent.terminate() == 0
    (approved,) = audits(out, "approved", event_id)
    assert approved["data"]["Reason"] == "approved_before_restart" and approved["data"]["Actor"] == "callback"
    assert posts(emu) == [[event_id]]
    assert [(r["kind"], r["actor"], r["state"]) for r in action_rows(tmp_path)] == [("approve", "callback", "done")]
