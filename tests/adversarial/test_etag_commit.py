"""A failed store commit never hides a change behind an ETag (issue 20, item 1).

IMDS (here the emulator with ``etag=True``) answers ``304`` to ``If-None-Match`` while the document
is unchanged. The validator the poller sends must be the one of the last *committed* document: when
the commit of a new document fails (a real fault: another process holds the database's write lock,
as ``sefwd approve`` or a replay may), the next poll must fetch the body again, or the new event,
its ``scheduled`` record and its notice time are lost until the document changes again. The
approver reads the document for every approval: it needs the body, so it never sends
``If-None-Match`` (a ``304`` there failed the second approval as ``imds_unavailable``).
"""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import orjson

from forwarder.agent.poller import Poller
from forwarder.approval.approver import Approver
from forwarder.approval.settings import ApprovalConfig
from forwarder.emulator import Emulator
from forwarder.imds.client import ImdsClient, RequestBudget
from forwarder.imds.identity import VmIdentity
from forwarder.records import RecordFactory
from forwarder.store.database import DB_FILE, Store

API = "2020-07-01"


def scheduled(store: Store, event_id: str) -> list[dict]:
    rows = store.query("SELECT body FROM records")
    return [r for (b,) in rows if (r := orjson.loads(b))["type"].endswith("scheduledevent.scheduled")
            and r.get("subject") == event_id]


def test_a_failed_commit_forgets_the_etag_so_the_next_poll_fetches_the_change(tmp_path: Path) -> None:
    with Emulator(vms=["myVM"], rate_limit=None, etag=True) as emu:
        imds = ImdsClient(emu.url, API, budget=RequestBudget())
        store = Store.open(tmp_path, fsync=False)
        store.conn.execute("PRAGMA busy_timeout=200")  # a locked database fails the commit in 0.2 s, not 5
        try:
            state = store.load_state()
            poller = Poller(imds, state, RecordFactory(VmIdentity(name="myVM"), API, sequence=state.sequence), store,
                            poll_interval=0.5, boot_id=lambda: None, boot_time=lambda: None)
            poller.poll_once()  # the empty document, committed
            event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
            other = sqlite3.connect(str(tmp_path / DB_FILE), isolation_level=None)
            other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            poller.poll_once()
            assert poller.stats.outbox_errors == 1, "the commit of the new document failed"
            other.execute("ROLLBACK")
            other.close()
            for _ in range(3):  # the document does not change again
                poller.poll_once()
            found = scheduled(store, event_id)
        finally:
            imds.close()
            store.close()
    print(f"scheduled records lost after a failed commit: {1 - len(found)}")
    assert len(found) == 1, "the event's scheduled record was lost behind a 304"


def test_the_approver_reads_the_body_every_time_even_when_imds_sends_etags(tmp_path: Path) -> None:
    with Emulator(vms=["myVM"], rate_limit=None, etag=True) as emu:
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        audits: list[dict] = []
        imds = ImdsClient(emu.url, API, budget=RequestBudget())
        approver = Approver(ApprovalConfig(scope="any"), imds, lambda: VmIdentity(name="myVM"), audits.append,
                            tmp_path, threading.Event())
        try:
            # A refused request (no POST, so the document stays the same), then a good one.
            outcomes = [approver.approve(["00000000-0000-0000-0000-000000000000"], actor="cli").reason,
                        approver.approve([event_id], actor="cli").reason]
        finally:
            imds.close()
    print(f"approvals failed as imds_unavailable: {outcomes.count('imds_unavailable')} of 1")
    assert outcomes == ["unknown_event", "approved"], outcomes
    assert [a["Outcome"] for a in audits] == ["refused", "approved"]
