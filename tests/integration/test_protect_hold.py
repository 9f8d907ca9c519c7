"""This VM's hold end to end: the real agent, the emulator, the shipped deploy/hooks recipes and a fake
``kubectl`` on PATH that logs each call's start and end (wall-clock seconds) and the hold it ran for.

The node is drained once per hold, undone once after the hold's last event ended, never for another
VM's event, never before the drain is over; approvals wait for the drain; restarts (clean, dry run,
``kill -9``) resume exactly where the hold was.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from forwarder.emulator import Emulator
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config

HOOKS = ROOT / "deploy" / "hooks"


def fake_kubectl(bindir: Path, log: Path, *, drain_sleep: float = 0.0, uncordon_sleep: float = 0.0,
                 cordoned: bool = False, first_sleep: dict[str, float] | None = None) -> None:
    """kubectl that logs `<epoch> start|end <hold> <args>`; `drain`/`uncordon` take the given time.

    ``first_sleep``: {verb: seconds}, the first call of that verb takes this long instead (the call an agent
    is killed during: long enough that only a stop ends it, however slowly the next agent starts) and writes
    its shell's pid to ``<bindir>/first-<verb>.pid``."""
    bindir.mkdir(exist_ok=True)
    path = bindir / "kubectl"
    # The first call of a verb claims it (mkdir is atomic) and writes its pid before it logs `start`, so a test
    # that saw the start also finds the pid.
    first = "".join(f'if [ "$1" = {verb} ] && mkdir "{bindir}/first-{verb}" 2>/dev/null; then '
                    f'echo $$ > "{bindir}/first-{verb}.pid"; first={seconds}; fi\n'
                    for verb, seconds in (first_sleep or {}).items())
    path.write_text(
        "#!/bin/sh\nfirst=\n"
        + first +
        f'echo "$(date +%s.%N) start ${{SEFWD_HOLD_ID:-}} $*" >> {log}\n'
        'if [ -n "$first" ]; then sleep "$first"; '
        f'elif [ "$1" = drain ]; then sleep {drain_sleep}; '
        f'elif [ "$1" = uncordon ]; then sleep {uncordon_sleep}; fi\n'
        f'if [ "$1" = get ]; then echo {"true" if cordoned else "false"}; fi\n'
        f'echo "$(date +%s.%N) end ${{SEFWD_HOLD_ID:-}} $*" >> {log}\n')
    path.chmod(0o755)


def first_call_running(bindir: Path, verb: str) -> bool:
    """Whether the first `verb` call's shell still runs (a zombie nobody reaped yet has ended)."""
    pid = (bindir / f"first-{verb}.pid").read_text().strip()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and "kubectl" in Path(f"/proc/{pid}/cmdline").read_text()


def calls(log: Path, verb: str | None = None, phase: str | None = None) -> list[tuple[float, str, str, list[str]]]:
    """(time, start|end, hold, argv) of every kubectl call (only `verb`, only `phase`, when given)."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        when, what, hold, *argv = line.split(" ")
        if (verb is None or argv[:1] == [verb]) and (phase is None or what == phase):
            out.append((float(when), what, hold, argv))
    return out


def protect_toml(*, settle: str = "0s", at: str | None = None, extra: str = "", types: str = "") -> str:
    return (f'[protect]\nenter = ["{HOOKS}/k8s-drain.sh"]\nleave = ["{HOOKS}/k8s-uncordon.sh"]\n'
            f'settle = "{settle}"\ndeadline_margin = "2s"\nhook_env = ["KUBECONFIG", "NODE_NAME"]\n'
            + (f'at = "{at}"\n' if at else "") + types + extra)


def env_for(bindir: Path) -> dict[str, str]:
    return {"PATH": f"{bindir}:{os.environ['PATH']}", "KUBECONFIG": "/etc/kubernetes/node.conf", "NODE_NAME": "node-1"}


def records(out: Path, rtype: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(out) if r["type"] == rtype]


def start(tmp_path: Path, emu: Emulator, toml: str, *, args: tuple[str, ...] = ("run",)) -> AgentProcess:
    cfg = write_config(tmp_path / "c.toml", emu.vm_url("myVM"), tmp_path / "state", extra=toml)
    return AgentProcess(cfg, tmp_path / "a.log", env=env_for(tmp_path / "bin"), args=args)


def gone(out: Path) -> list[dict[str, Any]]:
    """The records of events that left the document (completed, canceled or ended, as the evidence says)."""
    return [r for r in read_jsonl(out) if r["type"] in ("scheduledevent.completed", "scheduledevent.canceled",
                                                         "scheduledevent.ended")]


def status(agent: AgentProcess) -> str:
    """`sefwd status` as a person reads it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    done = subprocess.run([sys.executable, "-m", "forwarder", "status", "--config", str(agent.config)],
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=60)
    return done.stdout


def epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()  # (3.10 reads no "Z")


def test_another_vms_reboot_and_freeze_leave_this_node_alone(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log)
    types = 'event_types = ["Reboot", "Freeze"]\n'
    with Emulator(vms=["myVM", "other"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml(types=types))
        reboot = emu.schedule(type="Reboot", resources=["other"], start_after=600)
        freeze = emu.schedule(type="Freeze", resources=["other"], start_after=600)
        wait_until(lambda: len(records(out, "scheduledevent.scheduled")) == 2, 60, "both events seen")
        emu.complete(freeze)
        emu.complete(reboot)
        wait_until(lambda: len(gone(out)) == 2, 60, "both gone")
        # This VM's own event afterwards: its drain is the first kubectl call at all.
        own = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: calls(log, "drain", "end"), 60, "this VM's drain")
        emu.cancel(own)
        wait_until(lambda: calls(log, "uncordon", "end"), 60, "this VM's uncordon")
        assert agent.terminate() == 0
    verbs = [argv[0] for _, what, _, argv in calls(log, phase="start")]
    assert verbs == ["get", "drain", "uncordon"], verbs
    entered = records(out, "protect.entered")
    assert [r["data"]["EventIds"] for r in entered] == [[own]]
    assert records(out, "protect.left")[0]["data"]["EventIds"] == [own]
    assert not records(out, "protect.missed")


def test_overlapping_events_one_drain_one_uncordon_after_the_last(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log)
    types = 'event_types = ["Reboot", "Redeploy", "Freeze"]\n'
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml(types=types, settle="1s"))
        reboot = emu.schedule(type="Reboot", resources=["myVM"], start_after=900)
        wait_until(lambda: calls(log, "drain", "end"), 60, "the drain")
        shown = wait_until(lambda: "protect: held" in (text := status(agent)) and text, 60, "the hold in sefwd status")
        assert f"for {reboot}; enter done, leave not yet" in shown
        held_changes_from = time.time()  # every later change of the hold comes after this
        freeze = emu.schedule(type="Freeze", resources=["myVM"], start_after=600)
        redeploy = emu.schedule(type="Redeploy", resources=[], start_after=700)  # naming no VM: ours too
        wait_until(lambda: len(records(out, "scheduledevent.scheduled")) == 3, 60, "three events")
        emu.complete(freeze)  # the Reboot still holds the node: no uncordon
        emu.complete(reboot)
        wait_until(lambda: len(gone(out)) == 2, 60, "two gone")
        emu.cancel(redeploy)
        wait_until(lambda: calls(log, "uncordon", "end"), 60, "the uncordon")
        last_end = max(epoch(h["time"]) for h in emu.stats()["history"] if h["change"] in ("completed", "canceled"))
        wait_until(lambda: records(out, "protect.left"), 60, "protect.left")
        assert agent.terminate() == 0
    assert len(calls(log, "drain", "start")) == 1 and len(calls(log, "uncordon", "start")) == 1
    (uncordon_at, *_), = calls(log, "uncordon", "start")
    assert uncordon_at >= last_end + 1.0 - 0.05  # after the last event ended, plus the settle time
    left, = records(out, "protect.left")
    assert sorted(left["data"]["EventIds"]) == sorted([reboot, freeze, redeploy])
    (drain_end, *_), = calls(log, "drain", "end")
    entered_at, left_at = epoch(left["data"]["EnteredAt"]), epoch(left["data"]["LeftAt"])
    # When the drain finished, not when the hold last changed (however slow the machine: no margin of time).
    assert drain_end - 0.01 <= entered_at < held_changes_from
    assert left_at >= uncordon_at and left["data"]["OutOfServiceSeconds"] == pytest.approx(left_at - entered_at, abs=0.01)


def test_cancel_during_a_slow_drain_gives_drain_then_undo(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, drain_sleep=3)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml())
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: calls(log, "drain", "start"), 60, "the drain to start")
        emu.cancel(event_id)
        wait_until(lambda: calls(log, "uncordon", "end"), 60, "the uncordon")
        assert agent.terminate() == 0
    (drain_end, *_), = calls(log, "drain", "end")
    (uncordon_start, *_), = calls(log, "uncordon", "start")
    assert uncordon_start >= drain_end


def test_moved_notbefore_regates_the_approval_after_the_drain(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, drain_sleep=3)
    approval = ('[approval]\n[[approval.rules]]\nname = "after-drain"\naction = "approve"\nafter_hooks = true\n'
                'event_type = ["Reboot"]\n[approval.hooks]\nupdated = "true"\n')
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml() + approval)
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: calls(log, "drain", "start"), 60, "the drain to start")
        emu.update(event_id, start_after=300)  # Azure moves NotBefore while the drain runs
        wait_until(lambda: emu.stats()["start_requests"], 60, "the approval")
        wait_until(lambda: records(out, "protect.entered"), 60, "protect.entered")
        assert agent.terminate() == 0
    (drain_end, *_), = calls(log, "drain", "end")
    posted = epoch(emu.stats()["start_requests"][0]["time"])
    assert posted >= drain_end, (posted, drain_end)
    assert records(out, "protect.entered")[0]["data"]["NotBefore"] == records(out, "scheduledevent.updated")[0]["data"]["NotBefore"]


def test_dry_run_then_live_drains_and_approves(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log)
    approval = '[approval]\n[[approval.rules]]\nname = "after-drain"\naction = "approve"\nafter_hooks = true\n'
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        dry = start(tmp_path, emu, protect_toml() + approval, args=("run", "--dry-run"))
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: records(out, "protect.entered"), 60, "the dry run's protect.entered")
        wait_until(lambda: records(out, "approval.skipped"), 60, "the dry run's approval")
        assert dry.terminate() == 0
        assert not calls(log) and not emu.stats()["start_requests"]
        live = start(tmp_path, emu, protect_toml() + approval)
        wait_until(lambda: calls(log, "drain", "end"), 60, "the live drain")
        wait_until(lambda: emu.stats()["start_requests"], 60, "the live approval")
        assert live.terminate() == 0
    assert records(out, "protect.entered")[0]["data"]["DryRun"] is True
    assert records(out, "protect.entered")[1]["data"]["DryRun"] is False
    assert emu.stats()["start_requests"][0]["event_ids"] == [event_id]


def _one_of_each(log: Path, out: Path) -> None:
    assert len(records(out, "protect.entered")) == 1, records(out, "protect.entered")
    assert len(records(out, "protect.left")) == 1
    assert len(calls(log, "uncordon", "end")) == 1
    drains = calls(log, "drain", "end")
    assert drains and calls(log, "uncordon", "start")[0][0] >= max(t for t, *_ in drains)


def test_kill_9_during_enter_resumes_it(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, first_sleep={"drain": 300})
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml())
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: calls(log, "drain", "start"), 60, "the drain to start")
        agent.kill()
        again = start(tmp_path, emu, protect_toml())
        wait_until(lambda: records(out, "protect.entered"), 60, "protect.entered after the restart")
        # The killed agent's drain (300 s) was stopped before the new one ran: only a stop ends it this soon.
        assert not first_call_running(tmp_path / "bin", "drain")
        emu.cancel(event_id)
        wait_until(lambda: records(out, "protect.left"), 60, "protect.left")
        assert again.terminate() == 0
    assert len(calls(log, "drain", "start")) == 2  # taken up again: a drain is idempotent
    assert len(calls(log, "drain", "end")) == 1  # the new agent's: the killed agent's drain never finished
    assert "still running (process group" in again.logs()
    _one_of_each(log, out)


def test_kill_9_between_enter_and_approval(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log)
    # The approval waits for the drain and for NotBefore - 10s: the agent is killed in between.
    approval = ('[approval]\n[[approval.rules]]\nname = "late"\naction = "approve"\nafter_hooks = true\n'
                'at = "notbefore - 10s"\n')
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml() + approval)
        emu.schedule(type="Reboot", resources=["myVM"], start_after=16, complete_after=1)
        wait_until(lambda: records(out, "protect.entered"), 60, "protect.entered")
        assert not emu.stats()["start_requests"]
        agent.kill()
        again = start(tmp_path, emu, protect_toml() + approval)
        wait_until(lambda: emu.stats()["start_requests"], 60, "the approval after the restart")
        wait_until(lambda: records(out, "protect.left"), 60, "protect.left once the reboot is over")
        assert again.terminate() == 0
    assert len(calls(log, "drain", "start")) == 1 and len(emu.stats()["start_requests"]) == 1
    _one_of_each(log, out)


def test_kill_9_during_leave_resumes_it(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, first_sleep={"uncordon": 300})
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml())
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: records(out, "protect.entered"), 60, "protect.entered")
        emu.cancel(event_id)
        wait_until(lambda: calls(log, "uncordon", "start"), 60, "the uncordon to start")
        agent.kill()
        again = start(tmp_path, emu, protect_toml())
        wait_until(lambda: records(out, "protect.left"), 60, "protect.left after the restart")
        assert not first_call_running(tmp_path / "bin", "uncordon")  # stopped, not finished (300 s)
        assert again.terminate() == 0
    assert len(calls(log, "drain", "start")) == 1 and len(calls(log, "uncordon", "start")) == 2
    assert len(calls(log, "uncordon", "end")) == 1  # the killed agent's uncordon was stopped first
    assert len(records(out, "protect.left")) == 1 and len(records(out, "protect.entered")) == 1
    drain_end = calls(log, "drain", "end")[0][0]
    assert min(t for t, *_ in calls(log, "uncordon", "start")) >= drain_end


def test_an_admins_cordon_stays(tmp_path):
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, cordoned=True)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml())
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: records(out, "protect.entered"), 60, "protect.entered")
        emu.cancel(event_id)
        wait_until(lambda: records(out, "protect.left"), 60, "protect.left")
        assert agent.terminate() == 0
    assert calls(log, "drain", "end") and not calls(log, "uncordon")
    assert "leaving node-1 cordoned" in records(out, "protect.left")[0]["data"]["Hook"]["Output"]


def _metrics_url(agent: AgentProcess) -> str:
    found = wait_until(lambda: re.search(r"/metrics and /healthz on (http://\S+)", agent.logs()), 60, "telemetry")
    return found[1]


def _scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {m[1] + (m[2] or ""): float(m[3]) for line in text.splitlines()
            if not line.startswith("#") and (m := _SAMPLE.match(line))}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def test_drain_slack_and_held_are_measured(tmp_path):
    pytest.importorskip("opentelemetry.exporter.prometheus")
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml() + '[telemetry]\nlisten = "127.0.0.1:0"\n')
        base = _metrics_url(agent)
        emu.schedule(type="Reboot", resources=["myVM"], start_after=120)
        entered = wait_until(lambda: records(out, "protect.entered"), 60, "protect.entered")[0]["data"]
        samples = wait_until(lambda: (s := _scrape(base)).get("sefwd_protect_held") == 1 and s, 60, "held = 1")
        assert agent.terminate() == 0
    slack = entered["DrainSlackSeconds"]
    assert 100 < slack <= 120
    # (buckets below zero too, for late drains: Prometheus then shows no _sum; +Inf is the count)
    bucket = 'sefwd_protect_drain_slack_seconds_bucket{le="%s"}'
    assert samples[bucket % "+Inf"] == 1 and samples[bucket % "120.0"] == 1 and samples[bucket % "60.0"] == 0
    assert samples["sefwd_protect_drain_slack_last_seconds"] == pytest.approx(slack)


def test_notbefore_moved_earlier_cuts_the_running_drain_and_says_so(tmp_path):
    pytest.importorskip("opentelemetry.exporter.prometheus")
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, drain_sleep=60)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, protect_toml() + '[telemetry]\nlisten = "127.0.0.1:0"\n')
        base = _metrics_url(agent)
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: calls(log, "drain", "start"), 60, "the drain to start")
        emu.update(event_id, start_after=6)  # NotBefore now 6 s away: the drain must be over 2 s before it
        moved = time.time()
        missed = wait_until(lambda: records(out, "protect.missed"), 60, "protect.missed")[0]["data"]
        samples = wait_until(lambda: (s := _scrape(base)).get('sefwd_protect_missed_total{reason="enter_deadline"}') and s,
                             60, "the missed counter")
        assert agent.terminate() == 0
    assert missed["Reason"] == "enter_deadline" and missed["EventIds"] == [event_id]
    assert missed["Hook"]["TimedOut"] is True
    assert time.time() - moved < 30  # cut at the new deadline, not the old one 10 minutes away
    assert samples['sefwd_protect_missed_total{reason="enter_deadline"}'] == 1
    assert "protect: enter" in agent.logs() and "hit its deadline" in agent.logs()


def test_the_old_per_change_recipe_acts_for_this_vm_only_and_undoes_after_the_drain(tmp_path):
    """Existing configs keep working, better: another VM's Reboot does not drain this node
    (affects_this_vm = true by default) and a cancel during the drain is undone after it."""
    log, out = tmp_path / "kubectl.log", tmp_path / "out.jsonl"
    fake_kubectl(tmp_path / "bin", log, drain_sleep=3)
    legacy = (f'[approval]\nhook_env = ["KUBECONFIG", "NODE_NAME"]\n[approval.hooks]\n'
              f'scheduled = {{ command = ["{HOOKS}/k8s-drain.sh"] }}\ncompleted = ["{HOOKS}/k8s-uncordon.sh"]\n'
              f'canceled = ["{HOOKS}/k8s-uncordon.sh"]\nended = ["{HOOKS}/k8s-uncordon.sh"]\n')
    with Emulator(vms=["myVM", "other"], rate_limit=None) as emu:
        agent = start(tmp_path, emu, legacy)
        emu.schedule(type="Reboot", resources=["other"], start_after=600)
        wait_until(lambda: records(out, "scheduledevent.scheduled"), 60, "the other VM's event")
        own = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: calls(log, "drain", "start"), 60, "this VM's drain")
        emu.cancel(own)
        wait_until(lambda: calls(log, "uncordon", "end"), 60, "the uncordon")
        assert agent.terminate() == 0
    assert len(calls(log, "drain", "start")) == 1  # this VM's only
    assert calls(log, "uncordon", "start")[0][0] >= calls(log, "drain", "end")[0][0]
    drains = [r for r in records(out, "approval.ran") if r["data"]["Action"]["HookName"] == "scheduled"]
    assert [r["data"]["EventIds"] for r in drains] == [[own]]
