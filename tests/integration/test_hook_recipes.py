"""The hook recipes of docs/approvals.md (deploy/hooks/) against the environment contract they rely on.

Fake `kubectl`, `az` and `systemctl` programs on PATH record their argv (and the variables the
recipe needs) to a file; the recipes themselves are the shipped scripts, run by the real agent
or by ``run_hook`` as the agent runs them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from forwarder.approval.hooks import run_hook
from forwarder.emulator import Emulator
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config

HOOKS = ROOT / "deploy" / "hooks"


def fake(bindir: Path, name: str, log: Path, *variables: str) -> None:
    """A program that appends one line per call: the variables asked for, then its argv."""
    bindir.mkdir(exist_ok=True)
    shown = " ".join(f'"{v}=${v}"' for v in variables)
    path = bindir / name
    path.write_text(f'#!/bin/sh\nprintf "%s|" {name} {shown} "$@" >> {log}\necho >> {log}\n')
    path.chmod(0o755)


def calls(log: Path) -> list[list[str]]:
    return [line.rstrip("|").split("|") for line in log.read_text().splitlines()] if log.exists() else []


def record(event_id: str = "EV-1", event_type: str = "Reboot") -> dict[str, Any]:
    return {"id": "r1", "type": "scheduledevent.scheduled",
            "data": {"EventId": event_id, "EventType": event_type, "Change": "scheduled", "Resources": ["vm1"]}}


def test_kubectl_drain_with_the_time_left_then_uncordon_once_over(tmp_path):
    bindir, log = tmp_path / "bin", tmp_path / "kubectl.log"
    fake(bindir, "kubectl", log, "KUBECONFIG")
    approval = f'''
[approval]
hook_timeout = "1h"
deadline_margin = "5s"
hook_env = ["KUBECONFIG", "NODE_NAME"]
[approval.hooks]
scheduled = {{ command = ["{HOOKS}/k8s-drain.sh"], at = "notbefore - 15m", event_types = ["Reboot", "Redeploy"] }}
canceled = ["{HOOKS}/k8s-uncordon.sh"]
completed = ["{HOOKS}/k8s-uncordon.sh"]
ended = ["{HOOKS}/k8s-uncordon.sh"]
'''
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "KUBECONFIG": "/etc/kubernetes/node.conf", "NODE_NAME": "node-7",
           "SEFWD_CALLBACK_SECRET": "whsec_not-for-hooks"}
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        cfg = write_config(tmp_path / "c.toml", emu.vm_url("myVM"), tmp_path / "state", extra=approval)
        agent = AgentProcess(cfg, tmp_path / "a.log", env=env)
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)  # 10 min < 15 min: at once
        wait_until(lambda: calls(log), 60, "kubectl drain")
        emu.cancel(event_id)
        wait_until(lambda: len(calls(log)) == 2, 60, "kubectl uncordon")
        wait_until(lambda: len([r for r in read_jsonl(out) if r["type"] == "approval.ran"]) == 2, 60, "both audited")
        assert agent.terminate() == 0
    drain, uncordon = calls(log)
    assert drain[:5] == ["kubectl", "KUBECONFIG=/etc/kubernetes/node.conf", "drain", "node-7", "--ignore-daemonsets"]
    grace = int(drain[6].removeprefix("--grace-period="))
    assert 600 - 5 - 5 - 60 <= grace <= 600 - 5 - 5 and drain[7] == f"--timeout={grace}s"
    assert uncordon == ["kubectl", "KUBECONFIG=/etc/kubernetes/node.conf", "uncordon", "node-7"]
    outputs = [r["data"]["Hook"]["Output"] for r in read_jsonl(out) if r["type"] == "approval.ran"]
    assert f"draining node-7 for Reboot {event_id}" in outputs[0] and "uncordoning node-7 after canceled" in outputs[1]


def test_load_balancer_pool_leave_and_join(tmp_path):
    bindir, log = tmp_path / "bin", tmp_path / "az.log"
    fake(bindir, "az", log)
    names = {"LB_RESOURCE_GROUP": "rg1", "LB_NAME": "lb1", "LB_POOL": "web", "LB_NIC": "vm1-nic"}
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", **names}
    for verb in ("leave", "join"):
        result = run_hook([str(HOOKS / "lb-pool.sh"), verb], record(), timeout=30, output_limit=4096, extra_env=env)
        assert result.ok, result
    leave, join = calls(log)
    common = ["--resource-group", "rg1", "--nic-name", "vm1-nic", "--ip-config-name", "ipconfig1", "--lb-name", "lb1",
              "--address-pool", "web"]
    assert leave == ["az", "network", "nic", "ip-config", "address-pool", "remove", *common]
    assert join == ["az", "network", "nic", "ip-config", "address-pool", "add", *common]
    # Without the names (the operator forgot hook_env), the recipe fails loudly, not silently.
    missing = run_hook([str(HOOKS / "lb-pool.sh"), "leave"], record(), timeout=30, output_limit=4096,
                       extra_env={"PATH": env["PATH"]})
    assert not missing.ok and "LB_NAME" in missing.output


def test_graceful_service_stop_is_bounded_by_the_time_left(tmp_path):
    bindir, log = tmp_path / "bin", tmp_path / "systemctl.log"
    fake(bindir, "systemctl", log, "SERVICE")
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "SERVICE": "myapp.service", "SEFWD_SECONDS_LEFT": "42"}
    result = run_hook([str(HOOKS / "service-stop.sh")], record(), timeout=30, output_limit=4096, extra_env=env)
    assert result.ok, result
    assert calls(log) == [["systemctl", "SERVICE=myapp.service", "stop", "myapp.service"]]
    assert "stopping myapp.service within 42s" in result.output
