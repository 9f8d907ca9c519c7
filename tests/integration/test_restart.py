"""Restarts: SIGKILL between Scheduled and removal, then the right completed/canceled after restart."""
from __future__ import annotations

import pytest

from forwarder.emulator import Emulator
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config


def _types(out, event_id):
    """Kinds in order, de-duplicated by record id (delivery is at-least-once)."""
    seen, kinds = {}, []
    for r in read_jsonl(out):
        if r.get("subject") != event_id:
            continue
        if r["id"] in seen:
            assert seen[r["id"]] == r, "a re-delivered record must be identical"
            continue
        seen[r["id"]] = r
        kinds.append(r["type"].split(".", 1)[1])
    return kinds


@pytest.mark.parametrize("outcome", ["canceled", "completed"])
def test_sigkill_then_event_vanishes_while_down(tmp_path, outcome):
    with Emulator(vms=["myVM"]) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        out = tmp_path / "out.jsonl"
        agent = AgentProcess(config, tmp_path / "a1.log")
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: "scheduled" in _types(out, event_id), 60, "scheduled record")
        if outcome == "completed":
            emu.start_event(event_id)
            wait_until(lambda: "started" in _types(out, event_id), 30, "started record")
        agent.kill()
        if outcome == "completed":
            emu.complete(event_id)
        else:
            emu.cancel(event_id)
        before = read_jsonl(out)
        agent = AgentProcess(config, tmp_path / "a2.log")
        wait_until(lambda: outcome in _types(out, event_id), 60, f"{outcome} record after restart")
        assert agent.terminate() == 0
    records = read_jsonl(out)
    kinds = _types(out, event_id)
    expected = ["scheduled", "started", "completed"] if outcome == "completed" else ["scheduled", "canceled"]
    assert kinds == expected
    removal = [r for r in records if r["type"] == f"scheduledevent.{outcome}"][0]
    assert removal["data"]["Initial"] is False
    restarted = [r for r in records[len(before):] if r["type"] == "forwarder.started"]
    assert restarted and restarted[-1]["data"]["Resumed"] is True
    # Sequence continues across the restart; nothing but the removal (and lifecycle) is new.
    unique = list({r["id"]: r for r in records}.values())
    seqs = [int(r["sequence"]) for r in unique]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_restart_with_unchanged_document_emits_nothing_new(tmp_path):
    with Emulator(vms=["myVM"]) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Freeze", resources=["myVM"], duration=5, start_after=600)
        agent = AgentProcess(config, tmp_path / "a1.log")
        wait_until(lambda: "scheduled" in _types(out, event_id), 60, "scheduled record")
        assert read_jsonl(out)[1]["data"]["Initial"] is True  # fresh install: current events are Initial
        assert agent.terminate() == 0
        polls = emu.stats()["requests"]
        agent = AgentProcess(config, tmp_path / "a2.log")
        wait_until(lambda: len([r for r in read_jsonl(out) if r["type"] == "forwarder.started"]) == 2, 60, "second start")
        first_gets = sum(v.get("GET", 0) for v in polls.values()) if isinstance(polls, dict) else 0
        wait_until(lambda: sum(v.get("GET", 0) for v in emu.stats()["requests"].values()) >= first_gets + 4, 30, "polls after restart")
        assert agent.terminate() == 0
    assert _types(out, event_id) == ["scheduled"]


def test_bad_documents_are_skipped_without_losing_state(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        out = tmp_path / "out.jsonl"
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        agent = AgentProcess(config, tmp_path / "a.log")
        wait_until(lambda: "scheduled" in _types(out, event_id), 60, "scheduled record")
        emu.inject_fault("html", status=200, count=3)
        emu.inject_fault("malformed", count=3)
        emu.inject_fault("status", status=500, count=3)
        wait_until(lambda: not emu.stats()["faults_pending"], 30, "faults served")
        emu.cancel(event_id)
        wait_until(lambda: "canceled" in _types(out, event_id), 30, "canceled record")
        assert agent.terminate() == 0
        logs = agent.logs()
    assert _types(out, event_id) == ["scheduled", "canceled"]  # no false cancel from the bad documents
    assert "skipping a bad IMDS document" in logs and "IMDS poll failed" in logs
