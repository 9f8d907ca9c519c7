"""The `sefwd` command line, run as a real subprocess."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from datetime import datetime, timedelta

import orjson
import pytest

from forwarder.common.compat import tomllib
from forwarder.agent.demo import DRAIN_LEAD_S
from forwarder.emulator import Emulator
from forwarder.store.database import Store
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config
from benchmarks.peers.webhook_receiver import WebhookReceiver


def sefwd(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forwarder", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=str(ROOT))


@pytest.fixture(scope="module")
def demo_json() -> subprocess.CompletedProcess[str]:
    """One `sefwd demo --json` run, read by the tests below."""
    # In real time (about 9 s): at 0.5 the Reboot's completion and the Redeploy's cancel can share one poll (an
    # incarnation jump: "ended"), and only at full time is the hold entered from NotBefore - 5s rather than at once.
    return sefwd("demo", "--json", timeout=180)


def test_demo_prints_scheduled_started_completed_on_stdout_only(demo_json):
    done = demo_json
    assert done.returncode == 0, done.stderr[-2000:]
    records = [orjson.loads(line) for line in done.stdout.splitlines()]
    types = [r["type"] for r in records]
    for t in ("scheduledevent.scheduled", "scheduledevent.started", "scheduledevent.completed", "scheduledevent.canceled"):
        assert t in types
    assert types[0] == "forwarder.started" and types[-1] == "forwarder.stopped"
    assert "sefwd demo" in done.stderr  # logs and banners go to stderr, never stdout


def test_demo_shows_protection_in_the_same_timeline(demo_json):
    """The probe turns 503 and back, this VM's hold enters (the drain) from NotBefore - 5s and before the Reboot
    is approved, leaves (the undo) after the Reboot, and the people on call get messages (stderr, beside the records)."""
    done = demo_json
    assert done.returncode == 0, done.stderr[-2000:]
    records = [orjson.loads(line) for line in done.stdout.splitlines()]
    reboot = "B2D1C6E8-0002-4C5D-9E8F-000000000002"
    scheduled = next(r for r in records if r["type"] == "scheduledevent.scheduled" and r["subject"] == reboot)
    mine = [r for r in records if r["subject"] == reboot]
    order = [r["type"] for r in mine]
    entered, left = order.index("protect.entered"), order.index("protect.left")
    assert order.count("protect.entered") == order.count("protect.left") == 1  # one hold, one drain, one undo
    assert entered < order.index("approval.approved") < order.index("scheduledevent.completed") < left
    assert not any(t == "protect.missed" for t in (r["type"] for r in records))
    enter = mine[entered]["data"]
    assert enter["EventIds"] == [reboot] and enter["Hook"]["Output"].startswith("draining Reboot B2D1C6E8")
    assert mine[left]["data"]["Hook"]["Output"].startswith("back in service after Reboot B2D1C6E8")

    def when(value: str) -> datetime:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))

    # The drain began no earlier than NotBefore - DRAIN_LEAD_S (or when the agent saw the event, if later) and
    # was over before NotBefore (cut off 1 s before it, deadline_margin, it would be protect.missed).
    not_before = when(scheduled["data"]["NotBefore"])
    began = when(enter["FinishedAt"]) - timedelta(seconds=enter["Hook"]["DurationSeconds"])
    assert when(enter["NotBefore"]) == not_before
    assert began >= max(not_before - timedelta(seconds=DRAIN_LEAD_S), when(scheduled["time"])) - timedelta(seconds=0.1)
    assert enter["DrainSlackSeconds"] > 0
    lines = done.stderr.splitlines()
    probe = [line.split("  ", 2)[2] for line in lines if "  probe  " in line]
    assert [p[:3] for p in probe] == ["503", "200"] and "maintenance: Reboot B2D1C6E8" in probe[0]
    if importlib.util.find_spec("apprise") is not None:  # the [notify] extra (in the test extra)
        titles = [line.split("  ", 2)[2] for line in lines if "  notify  " in line]
        assert len(titles) == 4 and titles[0].startswith("Reboot of demo-vm-0 scheduled")  # "in 6 s", "in 5 s" or "now"
        assert titles[1:] == [f"Out of service: demo-vm-0 ({reboot})", "Reboot of demo-vm-0 completed",
                              f"Back in service: demo-vm-0 ({reboot})"]
    else:
        assert "pip install 'scheduled-events-forwarder[notify]'" in done.stderr


def test_config_example_is_valid_and_check_lists_every_problem(tmp_path):
    example = sefwd("config", "example")
    assert example.returncode == 0
    data = tomllib.loads(example.stdout)
    assert {"imds", "state", "agent", "journal", "delivery", "sinks"} <= set(data)
    path = tmp_path / "c.toml"
    path.write_text(example.stdout.replace("/var/lib/sefwd", str(tmp_path / "state")))
    ok = sefwd("config", "check", "--config", str(path))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[imds]\npoll_interval = "fast"\napi_version = "2099-01-01"\nfoo = 1\n[[sinks]]\ntype = "nope"\n')
    res = sefwd("config", "check", "--config", str(bad))
    assert res.returncode == 2
    for needle in ("poll_interval", "api_version", "foo", "nope"):
        assert needle in res.stderr


def test_once_prints_current_events_and_exit_codes(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        event_id = emu.schedule(type="Freeze", resources=["myVM"], duration=5, start_after=600)
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        res = sefwd("once", "--config", str(config))
        assert res.returncode == 0, res.stderr
        (record,) = [orjson.loads(line) for line in res.stdout.splitlines()]
        assert record["subject"] == event_id and record["data"]["Initial"] is True
        assert not (tmp_path / "state" / "state.json").exists()  # once changes no state
        emu.inject_fault("malformed")
        assert sefwd("once", "--config", str(config)).returncode == 3
    dead = write_config(tmp_path / "d.toml", "http://127.0.0.1:9", tmp_path / "state")
    res = sefwd("once", "--config", str(dead))
    assert res.returncode == 1 and "not reachable" in res.stderr


def test_status_deadletter_list_and_replay(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=400) as rx:
        sinks = (f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
                 f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\n')
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", sinks=sinks)
        agent = AgentProcess(config, tmp_path / "a.log")
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: (tmp_path / "state" / "state.db").exists(), 60, "the store")
        store = Store.open(tmp_path / "state")  # read next to the running agent, as the CLI does
        wait_until(lambda: any(d.record.to_dict().get("subject") == event_id for d in store.dead_letters("hook")),
                   60, "dead letter")
        wait_until(lambda: store.meta().get("status"), 30, "status report")
        # A sink sending records to dead letters makes the agent degraded (issue 32): exit 4, the latest error
        # named, once the report (rewritten within status_interval of a change) says so
        status = wait_until(lambda: (res := sefwd("status", "--config", str(config), "--json")).returncode == 4 and res,
                            30, "status to say degraded")
        st = orjson.loads(status.stdout)
        assert st["running"] is True and st["dead_letters"]["hook"] >= 2
        assert st["health"]["state"] == "degraded"
        assert [r for r in st["health"]["reasons"] if "sink hook is dead-lettering" in r and "http_400" in r]
        assert [e["EventId"] for e in st["current_events"]] == [event_id]
        human = sefwd("status", "--config", str(config))
        assert "sink hook" in human.stdout and event_id in human.stdout
        assert agent.terminate() == 0
        stopped = sefwd("status", "--config", str(config), "--json")
        assert stopped.returncode == 1 and orjson.loads(stopped.stdout)["health"]["state"] == "not_running"
        typo = sefwd("deadletter", "list", "hokk", "--config", str(config))
        assert typo.returncode == 2 and "no sink named 'hokk' (configured: file, hook)" in typo.stderr, typo.stderr
        listed = sefwd("deadletter", "list", "hook", "--config", str(config), "--json")
        rows = [orjson.loads(line) for line in listed.stdout.splitlines()]
        assert rows and all(r["reason"] == "http_400" for r in rows)
        rx.set_policy(200)
        rx.clear()
        replay = sefwd("deadletter", "replay", "hook", "--config", str(config))
        assert replay.returncode == 0, replay.stderr
        assert f"replayed {len(rows)}" in replay.stderr
        got = {r.json()["id"] for r in rx.wait_for(len(rows), 10)}
        assert got == {r["record"]["id"] for r in rows}
        assert store.dead_counts() == {}


def test_heartbeats_are_emitted(tmp_path):
    with Emulator(vms=["myVM"]) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra="")
        text = config.read_text().replace('heartbeat = "0"', 'heartbeat = "1s"')
        config.write_text(text)
        agent = AgentProcess(config, tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        beats = wait_until(lambda: [r for r in read_jsonl(out) if r["type"] == "forwarder.heartbeat"][1:], 60, "two heartbeats")
        assert agent.terminate() == 0
    data = beats[0]["data"]
    assert data["Polls"] > 0 and data["LastPollOk"] and data["Vm"]["Name"] == "myVM"
