"""Hard hook deadlines and recovered actions, end to end: `sefwd run` against the IMDS emulator, real
hook processes (some ignoring SIGTERM), read from the process table, the store and the file sink.

A hook for an event still to come is gone — SIGTERM, then SIGKILL to its process group — by
NotBefore − deadline_margin, also when Azure moves NotBefore earlier while it runs; rows a killed
agent left behind wait for the first poll of the next start, which supersedes those of events
that left meanwhile.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from forwarder.emulator import Emulator
from tests.agent import AgentProcess, read_jsonl, wait_until
from tests.integration.test_actions import action_rows, audits, config, epoch, script
from tests.integration.test_approval_hooks import gone

MARGIN = 2.0

# The hook leads its process group and starts one child. With IGNORE=both, neither dies of SIGTERM;
# with IGNORE=child, the hook does and its child does not. Each writes its pid, and a line when
# SIGTERM arrives.
STUBBORN = '''
import os, signal, subprocess, sys, time
where, ignore = sys.argv[1], sys.argv[2]
def noted(name):
    def on_term(*_):
        with open(os.path.join(where, name + ".term"), "a") as f:
            f.write("%f\\n" % time.time())
        if name == "hook" and ignore != "both":
            os._exit(143)
    return on_term
if len(sys.argv) > 3:  # the child
    signal.signal(signal.SIGTERM, noted("child"))
    open(os.path.join(where, "child.pid"), "w").write(str(os.getpid()))
else:
    signal.signal(signal.SIGTERM, noted("hook"))
    subprocess.Popen([sys.executable, __file__, where, ignore, "child"])
    open(os.path.join(where, "hook.pid"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
'''


def stubborn_hook(tmp_path: Path) -> str:
    """A hook per event: its files under tmp_path/<EventId>; a Reboot ignores SIGTERM, a Redeploy only its child."""
    code = tmp_path / "stubborn.py"
    code.write_text(STUBBORN)
    return str(script(tmp_path, "stubborn.sh",
                      f'd={tmp_path}/$SEFWD_EVENT_ID; mkdir -p "$d"; env > "$d/env"\n'
                      f'if [ "$SEFWD_EVENT_TYPE" = Reboot ]; then i=both; else i=child; fi\n'
                      f'exec {sys.executable} {code} "$d" "$i"\n'))


def pids(where: Path) -> list[int]:
    try:
        return [int((where / name).read_text()) for name in ("hook.pid", "child.pid")]
    except (FileNotFoundError, ValueError):
        return []


def not_before(out: Path, event_id: str, kind: str) -> float:
    (record,) = wait_until(lambda: [r for r in read_jsonl(out) if r["subject"] == event_id
                                    and r["type"] == f"scheduledevent.{kind}"], 60, f"the {kind} record")
    return epoch(record["data"]["NotBefore"])


def approval(hook: str, margin: float = MARGIN) -> str:
    return f'''
[approval]
hook_timeout = "5m"
deadline_margin = "{margin:g}s"
[approval.hooks]
scheduled = ["{hook}"]
'''


def kill_all(files: list[Path], script_name: str) -> None:
    """Every pid listed in ``files`` still running ``script_name``, with its group (a test that failed)."""
    for path in files:
        try:
            listed = [int(p) for p in path.read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in listed:
            try:
                if script_name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def assert_gone_by(last: float, where: Path, ignored_by: tuple[str, ...]) -> None:
    """At ``last`` (NotBefore − margin) the hook and its child are gone; SIGTERM came first."""
    procs = pids(where)
    wait_until(lambda: time.time() >= last, 120, "NotBefore - deadline_margin")
    alive = [p for p in procs if not gone(p)]
    assert alive == [], f"still running at NotBefore - deadline_margin: {alive}"
    for name in ignored_by:
        (term,) = [float(t) for t in (where / f"{name}.term").read_text().split()]
        assert term < last


def test_a_hook_ignoring_sigterm_is_gone_by_notbefore_less_the_margin(tmp_path: Path) -> None:
    hook = stubborn_hook(tmp_path)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval(hook)), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        try:
            both = emu.schedule(type="Reboot", resources=["myVM"], start_after=9)
            child = emu.schedule(type="Redeploy", resources=["myVM"], start_after=9)
            last = {e: not_before(out, e, "scheduled") - MARGIN for e in (both, child)}
            for where in (tmp_path / both, tmp_path / child):
                procs = wait_until(partial(pids, where), 30, "the hook and its child")
                assert not any(gone(p) for p in procs)
            # (asserted from the process table at that moment: no sleep decides the outcome)
            assert_gone_by(last[both], tmp_path / both, ("hook", "child"))
            assert_gone_by(last[child], tmp_path / child, ("child",))
            ran = {e: wait_until(partial(audits, out, "ran", e), 30, "the outcome") for e in (both, child)}
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
            kill_all([tmp_path / e / n for e in (both, child) for n in ("hook.pid", "child.pid")], "stubborn.py")
    for event_id, (record,) in ran.items():
        data = record["data"]
        assert (data["Reason"], data["Action"]["State"], data["Hook"]["TimedOut"]) == ("hook_timed_out", "failed", True)
        env = dict(line.split("=", 1) for line in (tmp_path / event_id / "env").read_text().splitlines() if "=" in line)
        # SEFWD_DEADLINE is the SIGTERM: before the SIGKILL, which comes before NotBefore - margin.
        assert epoch(env["SEFWD_DEADLINE"]) < last[event_id]
    assert ran[both][0]["data"]["Hook"]["ExitCode"] == -9  # it ignored SIGTERM: killed
    assert ran[child][0]["data"]["Hook"]["ExitCode"] == 143  # it obeyed; its child was killed


def test_a_running_hook_follows_a_notbefore_moved_earlier(tmp_path: Path) -> None:
    hook = stubborn_hook(tmp_path)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval(hook)), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        try:
            wait_until(lambda: pids(tmp_path / event_id), 60, "the hook and its child")
            assert not any(gone(p) for p in pids(tmp_path / event_id))
            emu.update(event_id, start_after=9)  # Azure moves the maintenance closer while the drain runs
            last = not_before(out, event_id, "updated") - MARGIN
            assert_gone_by(last, tmp_path / event_id, ("hook", "child"))
            (ran,) = wait_until(lambda: audits(out, "ran", event_id), 30, "the outcome")
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
            kill_all([tmp_path / event_id / n for n in ("hook.pid", "child.pid")], "stubborn.py")
    assert ran["data"]["Reason"] == "hook_timed_out" and ran["data"]["Hook"]["ExitCode"] == -9
    (row,) = [r for r in action_rows(tmp_path) if r["change"] == "scheduled"]
    assert row["deadline"] == last + MARGIN  # the row follows too (a restart would keep it)


def test_rows_left_by_a_killed_agent_wait_for_the_first_poll(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    hook = script(tmp_path, "slow.sh", f'echo $$ >> {marks}/$SEFWD_EVENT_ID\nsleep 60\n')
    cfg_text = approval(str(hook))
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = config(tmp_path, emu, cfg_text)
        out = tmp_path / "out.jsonl"
        agent = AgentProcess(cfg, tmp_path / "a1.log")
        left = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        stays = emu.schedule(type="Redeploy", resources=["myVM"], start_after=600)
        runs: dict[str, Any] = {}
        try:
            wait_until(lambda: all((marks / e).is_file() for e in (left, stays)), 60, "both hooks running")
            agent.kill()
            kill_all([marks / left, marks / stays], "slow.sh")
            assert sorted(r["state"] for r in action_rows(tmp_path)) == ["running", "running"]
            emu.cancel(left)  # while the agent is down, one event leaves
            # The restarted agent's first poll is slow: whatever runs before it, runs on the old document.
            emu.inject_fault("slow", path="scheduledevents", method="GET", delay=3, count=1)
            agent = AgentProcess(cfg, tmp_path / "a2.log")
            (superseded,) = wait_until(lambda: audits(out, "superseded", left), 60, "the left event's hook superseded")
            wait_until(lambda: len((marks / stays).read_text().split()) == 2, 60, "the other hook taken up again")
            runs = {e: len((marks / e).read_text().split()) for e in (left, stays)}
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
            kill_all([marks / left, marks / stays], "slow.sh")
    assert runs == {left: 1, stays: 2}  # the hook of the event that left never ran again
    assert superseded["data"]["Reason"].startswith("event_")
    states = {r["event_id"]: r["state"] for r in action_rows(tmp_path)}
    assert states[left] == "superseded"


def test_a_hook_whose_last_moment_has_passed_does_not_run_and_its_approval_is_held(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    hook = script(tmp_path, "drain.sh", f'echo ran >> {marks}/$SEFWD_EVENT_ID\n')
    rules = '''
[[approval.rules]]
name = "drain-then-approve"
event_type = "Reboot"
action = "approve"
after_hooks = true
'''
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = AgentProcess(config(tmp_path, emu, approval(str(hook), margin=30) + rules), tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        late = emu.schedule(type="Reboot", resources=["myVM"], start_after=20)  # NotBefore - 30 s has passed
        early = emu.schedule(type="Redeploy", resources=["myVM"], start_after=600)  # in time: it runs
        (skipped,) = wait_until(lambda: audits(out, "skipped", late), 60, "the late hook's outcome")
        (held,) = wait_until(lambda: audits(out, "held", late), 60, "the approval held")
        wait_until(lambda: (marks / early).is_file(), 60, "the other hook")
        assert agent.terminate() == 0
    assert (skipped["data"]["Reason"], skipped["data"]["Action"]["State"]) == ("deadline_passed", "failed")
    assert held["data"]["Reason"] == "hook_failed"
    assert not (marks / late).exists() and (marks / early).read_text() == "ran\n"
    assert emu.stats()["start_requests"] == []
