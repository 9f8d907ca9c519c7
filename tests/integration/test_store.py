"""The SQLite store on a real filesystem: transactions, cursors, collection, size cap, locking."""
from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import orjson
import pytest

from forwarder.errors import StateError
from forwarder.store.recovery import lock_state_dir, open_agent_store
from forwarder.sinkapi import Record
from forwarder.store.database import SavedState, Store, StoreError, sequence_floor


def recs(n, start=0, rtype="scheduledevent.scheduled", pad=0):
    return [Record.from_dict({"id": f"r{i}", "type": rtype, "n": i, "pad": "x" * pad}) for i in range(start, start + n)]


def ns(entries):
    return [orjson.loads(e.body)["n"] for e in entries]


def drain(store, sink, batch=7):
    out, pos = [], store.cursor(sink)
    while got := store.read(sink, pos, batch):
        out += got
        pos = got[-1].index + 1
    return out


def test_records_and_state_commit_together_and_survive_reopen(tmp_path):
    store = Store.open(tmp_path)
    fresh = store.load_state()
    assert fresh.document is None and fresh.sequence >= sequence_floor(time.time() - 60)
    store.commit(recs(30), SavedState(sequence=fresh.sequence + 30, document='{"Events":[]}', api_version="2020-07-01",
                                      vm={"vm_id": "x"}))
    entries = drain(store, "s")
    assert ns(entries) == list(range(30))
    store.advance("s", entries[19].index + 1)
    store.close()
    again = Store.open(tmp_path)
    saved = again.load_state()
    assert saved == SavedState(fresh.sequence + 30, '{"Events":[]}', "2020-07-01", {"vm_id": "x"})
    assert ns(drain(again, "s")) == list(range(20, 30))  # resumes at its committed cursor


def test_each_sink_has_its_own_cursor_and_collection_waits_for_the_slowest(tmp_path):
    store = Store.open(tmp_path)
    store.sinks = ("fast", "slow")
    store.commit(recs(100))
    fast = drain(store, "fast")
    store.cursor("slow")
    store.advance("fast", fast[-1].index + 1)
    store.collect()
    assert len(drain(store, "slow")) == 100  # slow still needs everything
    store.advance("slow", fast[49].index + 1)
    store.collect()
    assert ns(drain(store, "slow")) == list(range(50, 100))
    assert store.query("SELECT count(*) FROM records")[0][0] == 50


def test_ids_never_go_back_after_a_full_drain(tmp_path):
    store = Store.open(tmp_path)
    store.sinks = ("s",)
    store.commit(recs(5))
    end = drain(store, "s")[-1].index + 1
    store.advance("s", end)
    store.collect()
    assert store.query("SELECT count(*) FROM records")[0][0] == 0
    store.close()
    store = Store.open(tmp_path)
    store.commit(recs(1, 5))
    (entry,) = drain(store, "s")  # a new record gets an id past the cursor, so it is never skipped
    assert entry.index == end and ns([entry]) == [5]


def test_size_cap_evicts_heartbeats_and_audits_before_scheduled_events_and_counts_per_sink(tmp_path, caplog):
    store = Store.open(tmp_path, max_size=40_000)
    store.sinks = ("slow", "done")
    store.cursor("slow")
    events = recs(10, 0, pad=1000)
    store.commit(events)
    store.advance("done", store.next_index)  # "done" delivered the events already
    noise = [r for i in range(40) for r in (recs(1, 100 + 2 * i, "forwarder.heartbeat", 400)
                                           + recs(1, 101 + 2 * i, "approval.refused", 400))]
    with caplog.at_level(logging.ERROR):
        for r in noise:
            store.commit([r])
    store.commit(recs(5, 10, pad=1000))
    kept = drain(store, "slow")
    kept_events = [e for e in kept if orjson.loads(e.body)["type"].startswith("scheduledevent.")]
    assert len(kept_events) == 15, "no scheduled event was evicted while lower-priority records remained"
    assert store.size <= 40_000
    lost = store.losses()
    assert lost["slow"]["evicted_size_cap"] == 80 + 15 - len(kept)
    assert lost["done"]["evicted_size_cap"] == lost["slow"]["evicted_size_cap"]  # its heartbeats were undelivered too
    assert "size cap" in caplog.text


def test_dead_letters_are_committed_with_the_cursor_and_settled_by_id(tmp_path):
    store = Store.open(tmp_path)
    store.commit(recs(3))
    entries = drain(store, "s")
    store.advance("s", entries[-1].index + 1, [(entries[1].body, "http_400", "bad")], "2026-01-01T00:00:00Z")
    (dl,) = store.dead_letters("s")
    assert dl.reason == "http_400" and dl.record.id == "r1" and store.dead_counts() == {"s": 1}
    store.settle_dead([dl.id], "http_400", "still bad")
    assert store.dead_letters()[0].detail == "still bad"
    store.settle_dead([dl.id])
    assert store.dead_letters() == []


def test_second_agent_on_same_state_dir_is_refused(tmp_path):
    fd = lock_state_dir(tmp_path)
    assert fd is not None
    try:
        with pytest.raises(StateError, match="another sefwd agent"):
            lock_state_dir(tmp_path)
    finally:
        os.close(fd)
    again = lock_state_dir(tmp_path)  # released: the next agent may start
    assert again is not None
    os.close(again)


def test_old_layout_is_set_aside_with_one_log_line(tmp_path, caplog):
    (tmp_path / "state.json").write_bytes(b'{"sequence": 3}')
    (tmp_path / "journal" / "cursors").mkdir(parents=True)
    (tmp_path / "journal" / "seg-00000000000000000000.log").write_bytes(b"SEFWDJ01")
    (tmp_path / "deadletter").mkdir()
    with caplog.at_level(logging.ERROR):
        store, loss = open_agent_store(tmp_path)
    assert loss is None and store.load_state().document is None
    (aside,) = tmp_path.glob("old-layout-*")
    assert sorted(p.name for p in aside.iterdir()) == ["deadletter", "journal", "state.json"]
    assert [r for r in caplog.records if "old file layout" in r.getMessage()] and len(caplog.records) == 1


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from forwarder.sinkapi import Record
    from forwarder.store.database import SavedState, Store, StoreError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    store = Store.open(Path(sys.argv[1]))
    base = store.load_state().sequence
    store.commit([Record.from_dict({"id": "a", "type": "t"})] * 10, SavedState(sequence=base + 10))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))  # no file may grow or be written
    try:
        store.commit([Record.from_dict({"id": "b", "type": "t", "pad": "x" * 400})] * 5, SavedState(sequence=base + 15))
    except StoreError as exc:
        print("refused:", exc)
    else:
        print("accepted")
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    store.commit([Record.from_dict({"id": "c", "type": "t"})], SavedState(sequence=base + 11))
    print("after", store.load_state().sequence - base)
    """
)


def test_full_disk_refuses_loudly_changes_nothing_and_recovers_without_reopening(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "refused:" in out.stdout and "after 11" in out.stdout, out.stdout + out.stderr
    store = Store.open(tmp_path)
    assert [orjson.loads(e.body)["id"] for e in drain(store, "s")] == ["a"] * 10 + ["c"]


def test_store_error_is_a_state_error():
    assert issubclass(StoreError, StateError)


def test_a_lock_held_too_long_by_another_process_fails_the_commit_whole_and_the_retry_works(tmp_path):
    store = Store.open(tmp_path)
    store.conn.execute("PRAGMA busy_timeout=200")  # the 5 s default, shortened for the test
    base = store.load_state().sequence
    other = sqlite3.connect(tmp_path / "state.db", isolation_level=None)  # e.g. a `sefwd` command
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreError, match="locked"):
        store.commit(recs(3), SavedState(sequence=base + 3))
    assert store.append_failures == 1
    other.execute("ROLLBACK")
    assert drain(store, "s") == [] and store.load_state().sequence == base  # nothing half-done
    store.commit(recs(3), SavedState(sequence=base + 3))
    assert ns(drain(store, "s")) == [0, 1, 2] and store.load_state().sequence == base + 3


def test_the_page_cache_is_capped_so_memory_levels_off(tmp_path):
    # A long run's history (finished actions) must not fill SQLite's 2000 KiB default cache page by page.
    from forwarder.store.database import PAGE_CACHE_KIB

    store = Store.open(tmp_path)
    try:
        assert store.query("PRAGMA cache_size") == [(-PAGE_CACHE_KIB,)]
        assert PAGE_CACHE_KIB <= 256
    finally:
        store.close()
