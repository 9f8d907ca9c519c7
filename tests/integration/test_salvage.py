"""Salvaging a damaged state.db is durable: a failure or a crash part way is resumed by the next
start, rows with missing or wrong-kind values are counted lost (never fatal), and the
``forwarder.data_lost`` announcement is retried until it commits."""
from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
from pathlib import Path

import orjson
import pytest

from forwarder.store.outbox import StoreOutbox
from forwarder.emulator import Emulator
from forwarder.errors import StateError
from forwarder.imds.identity import VmIdentity
from forwarder.imds.client import ImdsClient
from forwarder.agent.poller import Poller
from forwarder.records import RecordFactory
from forwarder.store.recovery import SALVAGE_TMP, open_agent_store, pending_loss
from forwarder.sinkapi import Record
from forwarder.store.database import SavedState, Store
from tests.agent import wait_until
from tests.integration.test_store_faults import fill, small_fs  # noqa: F401 - small_fs is a fixture

DB_NAMES = {"state.db", "state.db-wal", "state.db-shm", "agent.lock"}


def body(seq: int, pad: int = 0) -> bytes:
    return Record.from_dict({"id": f"r{seq}", "type": "scheduledevent.scheduled", "sequence": str(seq),
                             "pad": "x" * pad}).body


def damaged_store(state: Path, n: int, pad: int = 0) -> list[int]:
    """A state.db of ``n`` undelivered records whose saved sequence counter is garbage, so that a
    start sets it aside and salvages it; returns the records' sequence numbers."""
    store = Store.open(state)
    base = store.load_state().sequence
    seqs = list(range(base + 1, base + n + 1))
    store.commit([Record.from_body(body(s, pad)) for s in seqs], SavedState(sequence=base + n))
    with store.transaction() as c:
        c.execute("UPDATE meta SET value = 'garbage' WHERE key = 'sequence'")
    store.close()
    return seqs


def stored_sequences(store: Store) -> list[int]:
    return [int(orjson.loads(b)["sequence"]) for (b,) in store.query("SELECT body FROM records ORDER BY id")]


def test_a_salvage_that_runs_out_of_space_leaves_the_damaged_database_in_place_and_a_retry_finishes_it(small_fs):
    state = small_fs / "state"
    seqs = damaged_store(state, 400, pad=1000)  # ~0.5 MB of records; the salvage needs as much again
    before = (state / "state.db").read_bytes()
    filler = fill(small_fs)
    os.truncate(filler, filler.stat().st_size - 256 * 1024)  # room to open and check, not to salvage
    with pytest.raises(StateError, match="cannot salvage .* left in place"):
        open_agent_store(state)
    assert {p.name for p in state.iterdir()} <= DB_NAMES, "nothing renamed, no partial salvage left"
    assert (state / "state.db").read_bytes() == before
    filler.unlink()
    store, loss = open_agent_store(state)
    assert loss is not None and loss.reason == "database_damaged"
    assert (loss.salvaged_records, loss.unreadable_rows, loss.uncounted) == (400, 0, [])
    assert (state / loss.renamed_to).read_bytes() == before, "the damaged database is kept as it was"
    assert stored_sequences(store) == seqs
    assert store.load_state().sequence >= seqs[-1]
    assert store.losses() == {"*": {"database_damaged": 1}}
    store.close()
    store, again = open_agent_store(state)  # announced only once committed: still pending, nothing salvaged twice
    assert again == loss
    assert {p.name for p in state.glob("state.db.damaged-*") if not p.name.endswith(("-wal", "-shm"))} == {loss.renamed_to}
    store.close()


def test_rows_with_missing_or_wrong_kind_values_are_counted_lost_and_the_rest_salvaged(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    conn = sqlite3.connect(state / "state.db", isolation_level=None)
    conn.executescript("""
        CREATE TABLE meta(key TEXT PRIMARY KEY, value BLOB);
        CREATE TABLE records(id INTEGER PRIMARY KEY AUTOINCREMENT, body BLOB, type TEXT, priority INTEGER,
                             time_ms INTEGER);
        CREATE TABLE cursors(sink TEXT PRIMARY KEY, next INTEGER);
        CREATE TABLE dead_letters(id INTEGER PRIMARY KEY AUTOINCREMENT, sink TEXT, body BLOB, reason TEXT,
                                  detail TEXT, time TEXT);
        INSERT INTO meta VALUES ('sequence', 'not a number');
    """)
    t = "scheduledevent.scheduled"
    conn.executemany("INSERT INTO records(body, type, priority, time_ms) VALUES (?, ?, 2, ?)", [
        (body(10), t, 1), (None, t, 2), (body(11), None, 3), (body(12), t, "not a time"), (12345, t, 5),
        (b"", t, 6), (body(13), t, 7)])
    conn.executemany("INSERT INTO dead_letters(sink, body, reason, detail, time) VALUES (?, ?, ?, ?, ?)", [
        ("hook", body(20), "http_400", "bad", "2026-01-01T00:00:00Z"), (None, body(21), "http_400", "", ""),
        ("hook", body(22), None, None, None)])
    conn.close()
    store, loss = open_agent_store(state)
    assert loss is not None
    assert (loss.salvaged_records, loss.salvaged_dead_letters, loss.unreadable_rows) == (3, 2, 5)
    assert stored_sequences(store) == [10, 12, 13]
    assert [(d.record.to_dict()["sequence"], d.reason, d.detail) for d in store.dead_letters("hook")] == [
        ("20", "http_400", "bad"), ("22", "", "")]
    assert store.losses()["*"] == {"database_damaged": 1, "unreadable_rows": 5}
    assert pending_loss(store) == loss
    store.close()


def test_a_salvage_that_finished_before_a_crash_is_moved_into_place_by_the_next_start(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    seqs = damaged_store(a, 5)
    shutil.copytree(a, b)
    store, done = open_agent_store(b)  # the same salvage, run to the end in a copy
    store.close()
    assert done is not None
    ns = done.renamed_to.rsplit("-", 1)[1]
    # What a crash between the salvage and its switch leaves: the damaged database still in
    # place, the complete salvage beside it (and a partial one from an earlier attempt).
    shutil.copy(b / "state.db", a / f"state.db.salvaged-{ns}")
    (a / SALVAGE_TMP).write_bytes(b"half a database")
    store, loss = open_agent_store(a)
    assert loss == done and stored_sequences(store) == seqs
    assert {p.name for p in a.iterdir() if not p.name.endswith(("-wal", "-shm"))} - DB_NAMES == {done.renamed_to}
    store.close()


def test_the_data_lost_record_waits_while_the_store_refuses_commits_and_goes_out_once_it_accepts(tmp_path, caplog):
    state = tmp_path / "state"
    damaged_store(state, 3)
    store, loss = open_agent_store(state)
    assert loss is not None
    store.conn.execute("PRAGMA busy_timeout=100")  # the 5 s default, shortened for the test
    lost = "SELECT body FROM records WHERE type = 'forwarder.data_lost'"
    stop = threading.Event()
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        imds = ImdsClient(emu.url, "2020-07-01")
        poller = Poller(imds, store.load_state(), RecordFactory(VmIdentity.fallback(), "2020-07-01"),
                        StoreOutbox(store), poll_interval=0.2, heartbeat=0, compute_refresh=0, stop=stop)
        other = sqlite3.connect(state / "state.db", isolation_level=None)  # e.g. a `sefwd` command
        other.execute("BEGIN IMMEDIATE")
        thread = threading.Thread(target=poller.run)
        with caplog.at_level(logging.ERROR, logger="forwarder.agent.poller"):
            thread.start()
            try:
                wait_until(lambda: poller.stats.outbox_errors >= 4, 60, "commits refused while the lock is held")
                assert store.query(lost) == [] and pending_loss(store) == loss, "still pending"
                other.execute("ROLLBACK")
                (row,) = wait_until(lambda: store.query(lost), 60, "the announcement committed")
            finally:
                stop.set()
                thread.join(30)
                imds.close()
    data = orjson.loads(row[0])["data"]
    assert {k: data[k] for k in loss.record_data()} == loss.record_data()
    assert pending_loss(store) is None and store.inbox() == []
    assert any("could not commit" in r.getMessage() for r in caplog.records)
    store.close()
    store, again = open_agent_store(state)
    assert again is None and len(store.query(lost)) == 1, "announced once"
    store.close()
