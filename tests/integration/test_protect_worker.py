"""The hold's worker on a real store with real commands: what each way a transition ends leaves behind
(the row, the protect.* audit entry, the warning), and that a stop lets it run again at the next start."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.protect import hold
from forwarder.protect.settings import ProtectConfig
from forwarder.protect.worker import HoldWorker
from forwarder.store import actions as rows
from forwarder.store.database import Store
from tests.agent import wait_until

VM = VmIdentity(name="vm1")


def document(*events: tuple[str, float]) -> Any:
    from email.utils import formatdate

    return parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm1"],
         "EventStatus": "Scheduled", "NotBefore": formatdate(time.time() + notice, usegmt=True)}
        for event_id, notice in events]})


def entries(store: Store) -> list[dict[str, Any]]:
    return [e for _, e in store.inbox() if isinstance(e, dict) and e.get("Family") == "protect"]


def run(tmp_path: Path, config: ProtectConfig, *events: tuple[str, float]) -> tuple[Store, HoldWorker, threading.Event]:
    store = Store.open(tmp_path / "state", fsync=False)
    stop = threading.Event()
    worker = HoldWorker(config, store, stop, hold_dir=tmp_path / "hold").start()
    with store.transaction() as c:
        hold.plan(c, document(*events), VM, config, now=time.time())
    worker.wake()
    return store, worker, stop


def test_an_enter_without_leave_and_a_hold_left_with_nothing_to_run(tmp_path):
    config = ProtectConfig(enter=["/bin/sh", "-c", 'echo "$SEFWD_TRANSITION $SEFWD_HOLD_EVENTS $SEFWD_HOLD_DIR"'], settle=0.0)
    store, worker, stop = run(tmp_path, config, ("E1", 120))
    try:
        entered = wait_until(lambda: [e for e in entries(store) if e["Outcome"] == "entered"], 30, "entered")[0]
        assert entered["Hook"]["Output"].strip() == f"enter E1 {tmp_path / 'hold'}"
        assert 100 < entered["DrainSlackSeconds"] <= 120 and entered["EventIds"] == ["E1"]
        with store.transaction() as c:
            hold.plan(c, document(), VM, config, now=time.time())
        worker.wake()
        left = wait_until(lambda: [e for e in entries(store) if e["Outcome"] == "left"], 30, "left")[0]
        assert left["Reason"] == "nothing_to_run" and left["OutOfServiceSeconds"] >= 0
    finally:
        stop.set()
        worker.close()
        store.close()


def test_a_failed_enter_is_a_miss_and_still_undone(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "forwarder.protect")
    config = ProtectConfig(enter="echo no kubectl; exit 3", leave="echo undo", settle=0.0)
    store, worker, stop = run(tmp_path, config, ("E1", 120))
    try:
        missed = wait_until(lambda: [e for e in entries(store) if e["Outcome"] == "missed"], 30, "missed")[0]
        assert (missed["Reason"], missed["Hook"]["ExitCode"]) == ("enter_failed", 3)
        assert "enter failed: exit code 3" in missed["Detail"]
        assert any("protect: enter" in r.message and "failed" in r.message for r in caplog.records)
        with store.transaction() as c:
            hold.plan(c, document(), VM, config, now=time.time())
        worker.wake()
        wait_until(lambda: [e for e in entries(store) if e["Outcome"] == "left"], 30, "the undo after a failed enter")
    finally:
        stop.set()
        worker.close()
        store.close()


def test_a_stop_cuts_the_transition_and_leaves_it_to_run_again(tmp_path):
    config = ProtectConfig(enter=["sleep", "30"], leave="true")
    store, worker, stop = run(tmp_path, config, ("E1", 600))
    try:
        wait_until(lambda: store.query("SELECT state FROM actions WHERE kind = 'enter'")[0][0] == rows.RUNNING, 30,
                   "the enter running")
        started = time.monotonic()
        stop.set()
        worker.close()
        assert time.monotonic() - started < 10  # cut at once, not after its 30 s
        assert store.query("SELECT state, attempts FROM actions WHERE kind = 'enter'")[0] == (rows.PLANNED, 1)
        assert not entries(store)  # nothing happened that needs a record
    finally:
        stop.set()
        store.close()
