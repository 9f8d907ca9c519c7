"""Scenarios (every built-in runs to the end, with and without approvals), the control API and the CLI."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent import poll_until as wait_until
import requests

from forwarder.emulator import Emulator, ScenarioError, builtin_scenarios, load_scenario
from tests.conftest import ROOT

SE = "/metadata/scheduledevents"
H = {"Metadata": "true"}
P = {"api-version": "2020-07-01"}
HOST_REBOOT = "602D9444-D2CD-49C7-8624-8643E7171297"

BUILTINS = {
    "live-migration-freeze", "user-reboot", "user-redeploy", "host-maintenance-reboot", "spot-preempt",
    "scale-set-terminate", "canceled-maintenance", "hardware-failure", "demo",
}




def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


class Watcher(threading.Thread):
    """Polls one emulator like an agent would; optionally approves every Scheduled event it sees."""

    def __init__(self, emu: Emulator, approve: bool, vm: str | None = None) -> None:
        super().__init__(daemon=True)
        self.emu, self.approve = emu, approve
        self.base = emu.vm_url(vm) if vm else emu.url
        self.seen: set[tuple[str, str]] = set()
        self.docs: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.t0 = time.monotonic()
        self.finished_after: float | None = None
        self.not_before: dict[str, datetime] = {}
        self.early_starts: list[tuple[str, str]] = []  # (EventId, NotBefore) seen Started before NotBefore

    def run(self) -> None:
        http = session()
        while True:
            last = self.emu.finished.is_set()  # one more poll after the end, to see the final document
            if self.finished_after is None and last:
                self.finished_after = time.monotonic() - self.t0
            r = http.get(self.base + SE, params=P, headers=H, timeout=5)
            if r.status_code != 200:
                self.errors.append(f"GET {r.status_code}")
            doc = r.json() if r.status_code == 200 else {"Events": []}
            if r.status_code == 200 and (not self.docs or self.docs[-1] != doc):
                self.docs.append(doc)
            now = datetime.now(timezone.utc)
            for ev in doc["Events"]:
                self.seen.add((ev["EventId"], ev["EventStatus"]))
                if ev["NotBefore"]:
                    self.not_before[ev["EventId"]] = parsedate_to_datetime(ev["NotBefore"])
                elif (not self.approve and ev["EventId"] in self.not_before
                      and now < self.not_before[ev["EventId"]]):
                    self.early_starts.append((ev["EventId"], ev["NotBefore"]))
                if self.approve and ev["EventStatus"] == "Scheduled":
                    body = json.dumps({"StartRequests": [{"EventId": ev["EventId"]}]})
                    code = http.post(self.base + SE, params=P, headers=H, data=body, timeout=5).status_code
                    if code != 200:
                        self.errors.append(f"POST {code}")
            if last:
                return
            self.emu.finished.wait(0.05)


def run_all(approve: bool, time_scale: float,
            scales: dict[str, float] | None = None) -> dict[str, tuple[Emulator, Watcher]]:
    """Every built-in at ``time_scale`` (``scales``: another one for some)."""
    runs: dict[str, tuple[Emulator, Watcher]] = {}
    for name in sorted(BUILTINS):
        emu = Emulator(scenario=name, rate_limit=None, time_scale=(scales or {}).get(name, time_scale)).start()
        w = Watcher(emu, approve)
        w.start()
        runs[name] = (emu, w)
    return runs


def changes(emu: Emulator) -> list[str]:
    return [h["change"].split(" ")[0] for h in emu.stats()["history"]]


def test_builtin_scenarios_are_all_shipped() -> None:
    assert set(builtin_scenarios()) == BUILTINS
    for name in BUILTINS:
        sc = load_scenario(name)
        assert sc.name == name and sc.description and sc.event_ids


def test_every_builtin_runs_to_the_end_without_approvals() -> None:
    runs = run_all(approve=False, time_scale=0.25)
    try:
        for name, (emu, w) in runs.items():
            assert emu.wait_finished(10), name
            w.join(5)
            assert not w.errors, (name, w.errors)
        expected_changes = {
            "hardware-failure": ["hardware-failure", "completed"],
            "canceled-maintenance": ["scheduled", "canceled"],
            "host-maintenance-reboot": ["scheduled", "updated", "started", "completed"],
        }
        for name, (emu, w) in runs.items():
            got = changes(emu)
            if name == "demo":
                assert Counter(got) == Counter(scheduled=3, started=2, completed=2, canceled=1)
            else:
                assert got == expected_changes.get(name, ["scheduled", "started", "completed"]), name
            # Only the scenario that says so approves (another VM of the availability set, early).
            approvers = [(r["vm"], r["accepted"]) for r in emu.stats()["start_requests"]]
            assert emu.stats()["events"] == [] and approvers == (
                [("myVM2", True)] if name == "host-maintenance-reboot" else []), name
            # IMDS's promise: no event starts before its NotBefore unless approved.
            starts = [h["change"] for h in emu.stats()["history"] if h["change"].startswith("started")]
            assert all(c in ("started (not-before)", "started (approved by myVM2)") for c in starts), (name, starts)
            early = {event_id for event_id, _ in w.early_starts}
            assert early == ({HOST_REBOOT} if name == "host-maintenance-reboot" else set()), (name, early)
            # The watcher saw what an agent polling every 50 ms would see.
            statuses = {s for _, s in w.seen}
            if name == "hardware-failure":
                assert statuses == {"Started"}
            elif name == "canceled-maintenance":
                assert statuses == {"Scheduled"}
            else:
                assert statuses == {"Scheduled", "Started"}, name
            incs = [d["DocumentIncarnation"] for d in w.docs]
            assert incs == sorted(set(incs)), name  # only ever goes up
        # Scenario-specific content.
        lm = runs["live-migration-freeze"][1].docs
        freeze = next(d["Events"][0] for d in lm if d["Events"])
        assert (freeze["EventType"], freeze["Resources"], freeze["DurationInSeconds"], freeze["EventSource"]) == (
            "Freeze", ["WestNO_0", "WestNO_1"], 5, "Platform")
        assert [d["DocumentIncarnation"] for d in lm][-3:] == [2, 3, 4]
        vmss = runs["scale-set-terminate"][0].stats()["vms"]
        assert vmss["myss_3"]["vmScaleSetName"] == "myss" and vmss["myss_4"]["default"] is False
        term = next(d["Events"][0] for d in runs["scale-set-terminate"][1].docs if d["Events"])
        assert (term["EventType"], term["Resources"]) == ("Terminate", ["myss_3"])
        upd = [d["Events"][0]["NotBefore"] for d in runs["host-maintenance-reboot"][1].docs if d["Events"]]
        assert len(set(upd)) >= 3  # first NotBefore, the moved one, "" once Started
    finally:
        for emu, _ in runs.values():
            emu.stop()


def test_approval_shortens_every_builtin() -> None:
    # The demo's cancel (8 s in) is what approvals cannot shorten: at 0.25 (the scale of the test without
    # approvals) it ends with the others; its NotBefores stay 1.5 s ahead of a watcher polling every 50 ms.
    runs = run_all(approve=True, time_scale=0.5, scales={"demo": 0.25})
    try:
        for name, (emu, w) in runs.items():
            assert emu.wait_finished(10), name
            w.join(5)
            assert not w.errors, (name, w.errors)
        for name, (emu, w) in runs.items():
            starts = [h["change"] for h in emu.stats()["history"] if h["change"].startswith("started")]
            if name == "hardware-failure":
                assert starts == []
                continue
            assert starts and all(s.startswith("started (approved by") for s in starts), (name, starts)
            assert emu.stats()["start_requests"], name
            assert w.finished_after is not None
        # Unapproved, live-migration-freeze needs 0.5 + 5 + 2 s (x0.5); approved, well under that.
        assert runs["live-migration-freeze"][1].finished_after < 3.0
    finally:
        for emu, _ in runs.values():
            emu.stop()


def test_approval_from_a_second_vm_prefix_on_the_seed_scenario() -> None:
    with Emulator(scenario="live-migration-freeze", rate_limit=None) as emu:
        w = Watcher(emu, approve=True, vm="WestNO_1")
        w.start()
        assert emu.wait_finished(6)  # unapproved it would take 7.5 s (NotBefore 5 s after it appears)
        w.join(5)
        assert emu.stats()["start_requests"][0]["vm"] == "WestNO_1"
        assert emu.stats()["history"][1]["change"] == "started (approved by WestNO_1)"


# -- scenario files ------------------------------------------------------------------------------


def test_scenario_file_with_faults_and_end(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text("""
name = "mine"
vms = ["x", { name = "y", zone = "3" }]
first_call_delay = "0s"

[[steps]]
at = "0s"
action = "fault"
kind = "status"
status = 500
count = 2

[[steps]]
at = "0.1s"
action = "schedule"
id = "EV-1"
type = "Reboot"
start_after = "0.2s"
complete_after = "0.2s"

[[steps]]
at = "0.2s"
action = "end"

[[steps]]
at = "5s"
action = "schedule"
id = "NEVER"
""")
    sc = load_scenario(str(path))
    assert sc.name == "mine" and [s.action for s in sc.steps] == ["fault", "schedule", "end", "schedule"]
    with Emulator(scenario=path, rate_limit=None) as emu:
        http = session()
        assert emu.wait_finished(5)
        codes = [http.get(emu.url + SE, params=P, headers=H).status_code for _ in range(3)]
        assert codes == [500, 500, 200]
        assert changes(emu) == ["scheduled", "started", "completed"]  # NEVER was after the end
        compute = http.get(emu.vm_url("y") + "/metadata/instance/compute", params={"api-version": "2021-02-01"},
                           headers=H).json()
        assert compute["zone"] == "3"


def test_invalid_scenarios_list_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("""
colour = "red"
[[steps]]
at = "soon"
action = "schedule"
[[steps]]
action = "explode"
[[steps]]
at = "1s"
action = "schedule"
type = "Nap"
flavour = 1
[[steps]]
at = "2s"
action = "cancel"
id = "ghost"
[[steps]]
at = "3s"
action = "fault"
kind = "slow"
[[steps]]
at = "4s"
action = "schedule"
id = "both"
not_before = "+15m"
start_after = "4s"
[[steps]]
at = "5s"
action = "approve"
id = "both"
by = "me"
""")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    text = "\n".join(info.value.problems)
    for needle in ("colour", "soon", "explode", "Nap", "flavour", "ghost", "slow fault needs a delay",
                   "not_before or start_after", "approve takes id"):
        assert needle in text, needle
    with pytest.raises(ScenarioError, match="built-in scenarios are"):
        load_scenario("no-such-scenario")
    (tmp_path / "broken.toml").write_text("steps = [")
    with pytest.raises(ScenarioError, match="invalid TOML"):
        load_scenario(tmp_path / "broken.toml")


def test_scenario_approval_by_another_vm_starts_the_event_long_before_not_before() -> None:
    """The real capture: approved early by a VM in Resources, the event runs and is gone before NotBefore."""
    with Emulator(scenario="host-maintenance-reboot", rate_limit=None, time_scale=0.5) as emu:
        w = Watcher(emu, approve=False)
        w.start()
        assert emu.wait_finished(10)
        w.join(5)
        history = emu.stats()["history"]
        assert [h["change"] for h in history] == ["scheduled", "updated", "started (approved by myVM2)", "completed"]
        started = datetime.fromisoformat(history[2]["time"])
        assert started < w.not_before[HOST_REBOOT]  # 15 minutes (x0.5) early, approved
        assert [h["incarnation"] for h in history] == [2, 3, 4, 5]


# -- control API ----------------------------------------------------------------------------------


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(vms=["a", "b"], rate_limit=None) as e:
        yield e


def test_control_api(emu: Emulator) -> None:
    http = session()
    ctl = emu.url + "/_emulator"
    r = http.post(ctl + "/events", json={"id": "X1", "type": "Freeze", "duration": 5, "resources": ["a", "b"],
                                         "start_after": "10m"})
    assert (r.status_code, r.json()) == (201, {"EventId": "X1"})
    r = http.post(ctl + "/events", json={"EventType": "Reboot", "EventSource": "User"})  # IMDS names work too
    second = r.json()["EventId"]
    assert r.status_code == 201 and re.fullmatch(r"[0-9A-F-]{36}", second)
    assert http.post(ctl + "/events/X1/update", json={"description": "moved"}).status_code == 200
    assert http.post(ctl + "/events/X1/start", json={}).status_code == 200
    assert http.post(ctl + f"/events/{second}/cancel").status_code == 200
    state = http.get(ctl + "/state").json()
    (ev,) = state["events"]
    assert (ev["EventId"], ev["EventStatus"], ev["Description"], ev["StartedBy"]) == ("X1", "Started", "moved", "api")
    assert state["incarnation"] == 6
    assert [h["change"] for h in state["history"]] == ["scheduled", "scheduled", "updated", "started (api)", "canceled"]
    assert http.post(ctl + "/events/X1/complete").status_code == 200
    assert http.get(ctl + "/state").json()["events"] == []
    # Approval as another VM of the set: starts the event at once, recorded as its StartRequests.
    http.post(ctl + "/events", json={"id": "X2", "type": "Reboot", "resources": ["a", "b"]})
    assert http.post(ctl + "/events/X2/approve", json={"vm": "a"}).status_code == 200
    state = http.get(ctl + "/state").json()
    assert state["events"][0]["StartedBy"] == "approved by a" and state["start_requests"][-1]["vm"] == "a"
    assert http.post(ctl + "/events/X2/approve", json={"vm": 7}).status_code == 400
    emu.complete("X2")

    r = http.post(ctl + "/faults", json={"kind": "status", "status": 410, "count": 1})
    assert r.status_code == 201 and r.json()["pending"][0]["status"] == 410
    assert http.get(emu.url + SE, params=P, headers=H).status_code == 410
    http.get(emu.url + SE, params=P, headers=H)
    assert http.get(ctl + "/state").json()["requests"]["a"]["by_status"] == {"410": 1, "200": 1}

    # Errors are explicit.
    assert http.post(ctl + "/events/ghost/start").status_code == 404
    assert http.post(ctl + "/events", json={"type": "Nap"}).status_code == 400
    assert http.post(ctl + "/events", data="{nope").status_code == 400
    assert http.post(ctl + "/faults", json={"kind": "meteor"}).status_code == 400
    assert http.get(ctl + "/nothing").status_code == 404

    # Reset, then run a scenario through the API.
    assert http.post(ctl + "/reset").status_code == 200
    state = http.get(ctl + "/state").json()
    assert state["requests"] == {} and state["events"] == [] and state["faults_pending"] == []
    r = http.post(ctl + "/scenario", json={"name": "hardware-failure"})
    assert r.status_code == 200 and r.json()["scenario"] == "hardware-failure"
    assert wait_until(lambda: http.get(ctl + "/state").json()["events"])
    assert http.post(ctl + "/scenario", json={"name": "nope"}).status_code == 400


# -- CLI ----------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forwarder.emulator", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)


def test_cli_serves_and_ctl_drives_it() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "forwarder.emulator", "--listen", "127.0.0.1:0", "--vm", "cli-vm"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        url = None
        assert proc.stderr is not None
        for _ in range(50):
            line = proc.stderr.readline()
            m = re.search(r"IMDS emulator at (http://127\.0\.0\.1:\d+) ", line)
            if m or not line:
                url = m.group(1) if m else None
                break
        assert url, "the emulator did not print its URL"
        out = _cli("ctl", url, "schedule", "--type", "Freeze", "--id", "CLI-1", "--duration", "5",
                   "--resources", "cli-vm", "other-vm")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"EventId": "CLI-1"}
        doc = session().get(url + "/vm/other-vm" + SE, params=P, headers=H).json()
        assert doc["Events"][0]["EventId"] == "CLI-1"
        state = json.loads(_cli("ctl", url, "state").stdout)
        assert state["events"][0]["Resources"] == ["cli-vm", "other-vm"]
        assert _cli("ctl", url, "approve", "CLI-1").returncode == 0  # as other-vm, the last in Resources
        state = json.loads(_cli("ctl", url, "state").stdout)
        assert state["events"][0]["StartedBy"] == "approved by other-vm"
        assert _cli("ctl", url, "cancel", "CLI-1").returncode == 0
        assert _cli("ctl", url, "cancel", "CLI-1").returncode == 1  # gone now
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_runs_a_scenario_to_the_end_and_refuses_remote_binds() -> None:
    done = _cli("--listen", "127.0.0.1:0", "--scenario", "user-reboot", "--time-scale", "0.1", "--exit-when-finished")
    assert done.returncode == 0, done.stderr
    assert "scenario user-reboot finished" in done.stderr
    refused = _cli("--listen", "0.0.0.0:0")
    assert refused.returncode == 2 and "--allow-remote" in refused.stderr
    listed = _cli("--list-scenarios")
    assert listed.returncode == 0 and all(name in listed.stdout for name in BUILTINS)


def test_a_held_scenario_waits_for_its_start_and_gives_its_vms_at_once() -> None:
    """`sefwd demo` holds the scenario until the agent's first poll: a slow start loses none of its seconds."""
    scenario = load_scenario("demo")
    with Emulator(scenario=scenario, start_scenario=False, rate_limit=None) as emu:
        http = session()
        r = http.get(emu.url + SE, headers=H, params=P)
        # The scenario's VMs answer at once (the default VM is its first), with no event: the timeline waits.
        assert (r.status_code, r.json()["Events"]) == (200, [])
        assert emu.platform.default_vm == scenario.vms[0].name
        assert not emu.wait_finished(0.3)
        emu.run_scenario(scenario)
        first = wait_until(lambda: http.get(emu.url + SE, headers=H, params=P).json()["Events"], 30)
        assert first[0]["EventId"] == "A1F0E5A7-0001-4C5D-9E8F-000000000001"
        assert emu.wait_finished(90)
