"""`--json` where a person might script: config check, deadletter replay, emulator --list-scenarios."""
from __future__ import annotations

import os
import subprocess
import sys

import orjson

from forwarder.emulator.scenario import builtin_scenarios
from forwarder.sinkapi import Record
from forwarder.store.database import Store
from tests.agent import ROOT
from benchmarks.peers.webhook_receiver import WebhookReceiver


def sefwd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forwarder", *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=str(ROOT))


def test_config_check_json_lists_problems(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    res = sefwd("config", "check", "--json", "--config", str(good))
    assert res.returncode == 0
    assert orjson.loads(res.stdout) == {"valid": True, "source": str(good), "problems": []}
    bad = tmp_path / "bad.toml"
    bad.write_text('[imds]\npoll_interval = "fast"\nfoo = 1\n')
    res = sefwd("config", "check", "--json", "--config", str(bad))
    assert res.returncode == 2
    answer = orjson.loads(res.stdout)
    assert answer["valid"] is False and len(answer["problems"]) == 2
    assert any("poll_interval" in p for p in answer["problems"]) and any("foo" in p for p in answer["problems"])


def test_emulator_list_scenarios_json():
    res = sefwd("emulator", "--list-scenarios", "--json")
    assert res.returncode == 0
    listed = [orjson.loads(line) for line in res.stdout.splitlines()]
    assert [s["name"] for s in listed] == list(builtin_scenarios())
    assert all(s["description"] for s in listed)


def test_deadletter_replay_json_gives_counts(tmp_path):
    state = tmp_path / "state"
    store = Store.open(state)
    try:
        bodies = [Record.from_dict({"specversion": "1.0", "id": f"r{i}", "type": "t", "source": "/s", "data": {}}).body
                  for i in range(3)]
        store.advance("hook", 0, dead=[(b, "http_400", "refused") for b in bodies], now="2026-01-01T00:00:00Z")
    finally:
        store.close()
    with WebhookReceiver() as rx:
        config = tmp_path / "c.toml"
        config.write_text(f'[state]\ndir = "{state}"\n[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\n')
        res = sefwd("deadletter", "replay", "hook", "--json", "--config", str(config))
        assert res.returncode == 0, res.stderr
        assert orjson.loads(res.stdout) == {"sink": "hook", "replayed": 3, "still_dead": 0}
        again = sefwd("deadletter", "replay", "hook", "--json", "--config", str(config))
        assert orjson.loads(again.stdout) == {"sink": "hook", "replayed": 0, "still_dead": 0}
