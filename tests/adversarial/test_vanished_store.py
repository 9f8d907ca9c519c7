"""A vanished store is announced (issue 20, item 8).

When ``state.db`` and its WAL disappear (a careless clean-up, a restore from an old image), the
agent starts a new store: it used to do so without a word, and a consumer could not tell a reset
from a gap. The lock file keeps a small marker (the store's id and its high-water sequence); a new
store created where the marker names another starts with a ``forwarder.data_lost`` record naming
the previous store and the last sequence it handed out. Removing the lock file too is a deliberate
start-over: no announcement. The real agent, real SQLite, the emulator, a real webhook receiver.
"""
from __future__ import annotations

import os
from pathlib import Path

import orjson

from benchmarks.peers.webhook_receiver import WebhookReceiver
from forwarder.emulator import Emulator
from forwarder.store.database import Store
from tests.agent import AgentProcess, wait_until
from tests.integration.test_store_faults import cfg, hook_records, of_type


def _first_run(tmp_path: Path, emu: Emulator, rx: WebhookReceiver, state: Path) -> tuple[str, int]:
    config = cfg(tmp_path, emu, rx, state)
    agent = AgentProcess(config, tmp_path / "a1.log")
    emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
    wait_until(lambda: of_type(hook_records(rx), "scheduledevent.scheduled"), 60, "first run delivered")
    assert agent.kill() is None  # no clean stop: the marker must be current anyway
    store = Store.open(state)
    try:
        meta = store.meta()
    finally:
        store.close()
    store_id = meta.get("store_id")
    return store_id.decode() if isinstance(store_id, bytes) else str(store_id), int(meta["sequence"])


def test_a_vanished_database_is_announced_with_the_previous_store_and_its_last_sequence(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        store_id, last = _first_run(tmp_path, emu, rx, state)
        before = {int(r["sequence"]) for r in hook_records(rx)}
        for p in state.glob("state.db*"):
            p.unlink()
        agent = AgentProcess(cfg(tmp_path, emu, rx, state), tmp_path / "a2.log")
        wait_until(lambda: len(of_type(hook_records(rx), "scheduledevent.scheduled")) >= 2, 60, "re-sent as Initial")
        lost = of_type(hook_records(rx), "forwarder.data_lost")
        assert agent.terminate() == 0
    print(f"forwarder.data_lost records after the database vanished: {len(lost)}")
    assert len(lost) == 1
    data = lost[0]["data"]
    assert data["Reason"] == "database_vanished" and data["PreviousStore"] == store_id
    assert data["LastSequence"] == last >= max(before)
    assert "records" in data["UncountedTables"] and data["StateRestored"] is False
    after = {int(r["sequence"]) for r in hook_records(rx)} - before
    assert min(after) > last, "the new store starts above every number handed out before"
    assert "remove agent.lock too" in agent.logs()


def test_removing_the_marker_too_is_a_deliberate_start_over(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        _first_run(tmp_path, emu, rx, state)
        for p in [*state.glob("state.db*"), state / "agent.lock"]:
            p.unlink()
        agent = AgentProcess(cfg(tmp_path, emu, rx, state), tmp_path / "a2.log")
        wait_until(lambda: len(of_type(hook_records(rx), "scheduledevent.scheduled")) >= 2, 60, "re-sent as Initial")
        assert agent.terminate() == 0
    assert of_type(hook_records(rx), "forwarder.data_lost") == []
    marker = orjson.loads((state / "agent.lock").read_bytes())
    assert set(marker) == {"pid", "store", "sequence"}


def test_a_salvaged_store_keeps_its_id_so_the_marker_raises_no_second_alarm(tmp_path: Path) -> None:
    from forwarder.store.recovery import lock_state_dir, open_agent_store

    state = tmp_path / "state"
    lock = lock_state_dir(state)
    store, loss = open_agent_store(state)  # a healthy start writes the marker
    assert loss is None
    store.load_state()
    with store.transaction() as c:
        c.execute("UPDATE meta SET value = 'garbage' WHERE key = 'sequence'")  # then the database is damaged
    store.close()
    store, loss = open_agent_store(state)
    try:
        announcements = [e for _, e in store.inbox() if isinstance(e, dict) and e.get("Lifecycle") == "data_lost"]
    finally:
        store.close()
        if lock is not None:
            os.close(lock)
    assert loss is not None and loss.reason == "database_damaged"
    assert [a["Data"]["Reason"] for a in announcements] == ["database_damaged"]
